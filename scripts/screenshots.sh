#!/usr/bin/env bash
# The screenshots of the browser view in docs/guide.md (docs/img/*.png), taken by the browser
# tests' own set-up (tests/test_browser.py::test_screenshots; needs chromium and chromium-driver).
. "$(dirname "$0")/_venv.sh" test,torch
mkdir -p docs/img
CAS_CKPT_LONG=1 CAS_CKPT_SCREENSHOTS="$PWD/docs/img" exec .venv/bin/python -m pytest -q \
  tests/test_browser.py -k screenshots "$@"
