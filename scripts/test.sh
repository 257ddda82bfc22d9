#!/usr/bin/env bash
# Set up and run every test (torch included). Long modes: CAS_CKPT_LONG=1 scripts/test.sh
. "$(dirname "$0")/_venv.sh" test,torch
# LocalStack's S3 (the S3 tests run on it and on moto), in .venv-localstack: _venv.sh cd'ed here.
. scripts/_localstack.sh
# The reference CAR reader (@ipld/car) for the IPFS interop tests, when node is available.
if command -v npm >/dev/null; then
  npm ci --prefix tests/js --no-audit --no-fund --loglevel=error
fi
.venv/bin/python -m ruff check cas_ckpt cas_ckpt_cli tests benchmarks scripts
exec .venv/bin/python -m pytest "$@"
