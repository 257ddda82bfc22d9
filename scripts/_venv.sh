# Sourced by the other scripts: make .venv (once) and install the project with the given extras.
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=".venv/.installed-$1"
# setup.py and every C source and header too (vendored BLAKE3's included): an editable install
# builds the compiled modules (cas_ckpt/_hashpool*.so, cas_ckpt/_headers*.so) in place.
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
    || [ -n "$(find cas_ckpt vendor -maxdepth 2 \( -name '*.c' -o -name '*.h' -o -name '*.S' \) \
              -newer "$stamp")" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$1]"
  touch "$stamp"
fi
