"""``python -m cas_ckpt``: the ``cas-ckpt`` command line."""

from cas_ckpt.cli import main

raise SystemExit(main())
