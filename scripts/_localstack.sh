# Sourced by scripts/test.sh: make .venv-localstack (LocalStack's S3, the tests' second S3 server,
# tests/localstack_server.py) from tests/localstack-requirements.txt: once, and from scratch again
# whenever that file changes (the stamp is a copy of the file it was installed from).
set -eu
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
ls_req=tests/localstack-requirements.txt
ls_stamp=.venv-localstack/.installed-requirements
if ! [ -x .venv-localstack/bin/python ] || ! cmp -s "$ls_req" "$ls_stamp"; then
  echo "installing LocalStack into .venv-localstack (tests/localstack-requirements.txt)" >&2
  rm -rf .venv-localstack
  "$PY" -m venv .venv-localstack
  .venv-localstack/bin/python -m pip install --quiet --disable-pip-version-check -r "$ls_req"
  cp "$ls_req" "$ls_stamp"
fi
