# Sourced by the other scripts: make .venv (once) and install the project with the given extras.
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=".venv/.installed-$1"
# setup.py and the C source too: an editable install builds cas_ckpt/_hashpool*.so in place.
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
    || [ cas_ckpt/_hashpool.c -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$1]"
  touch "$stamp"
fi
