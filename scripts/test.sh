#!/usr/bin/env bash
# Set up and run every test (torch included). Long modes: CAS_CKPT_LONG=1 scripts/test.sh
. "$(dirname "$0")/_venv.sh" test,torch
.venv/bin/python -m ruff check cas_ckpt tests benchmarks
exec .venv/bin/python -m pytest "$@"
