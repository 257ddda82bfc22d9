#!/usr/bin/env bash
# Set up and run the demo: train, checkpoint, crash, resume, print history and storage figures.
. "$(dirname "$0")/_venv.sh" demo
exec .venv/bin/python -m cas_ckpt.demo "$@"
