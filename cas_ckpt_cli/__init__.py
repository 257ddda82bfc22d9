"""The ``cas-ckpt`` console script's entry point, outside the ``cas_ckpt`` package on purpose.

Importing ``cas_ckpt`` (numpy, the stores) takes a noticeable moment; a Ctrl-C then would otherwise
print a traceback from the script's own import line. This module imports nothing heavy itself.
"""

from __future__ import annotations

import sys

EXIT_INTERRUPTED = 130  # as cas_ckpt.cli.EXIT_INTERRUPTED


def main() -> int:
    """Import the command line, then run it; an interrupt while importing is exit 130, quietly."""
    try:
        from cas_ckpt.cli import main as run
    except KeyboardInterrupt:
        print("cas-ckpt: error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return run()
