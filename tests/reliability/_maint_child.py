"""Child of test_kill_maintenance: runs one maintenance operation in a loop until it is killed.

Usage: ``_maint_child.py OP REPO LOG [CAR]``. Appends ``begin N`` (fsynced) to LOG before each
round and ``done N ...`` after it; the parent SIGKILLs it at a random moment.

* ``gc``: a scratch checkpoint is saved and its ref deleted, then ``gc(reflog_expiry=0)`` sweeps it
  (merging packs that lost blocks);
* ``import``: the CAR file is imported to ref ``imported``;
* ``delete``: ref ``tmp/N`` is set to ``keep/0`` and deleted again;
* ``retention``: a CheckpointManager with ``keep_last=2`` saves step N (its GC runs each time);
  ``done N DIGEST`` records what step N holds;
* ``upkeep``: two small checkpoints are saved (refs ``up/0``, ``up/1``), then ``upkeep(force=True)``
  merges the small packs and writes an index snapshot, deleting the packs and index files they
  replace.
"""

from __future__ import annotations

import sys

import _support

import cas_ckpt


def main() -> None:
    op, root, log = sys.argv[1], sys.argv[2], sys.argv[3]
    repo = cas_ckpt.open(root, create=False, upkeep=op != "upkeep")  # upkeep: by hand, each round
    manager = cas_ckpt.CheckpointManager(repo, "run", keep_last=2) if op == "retention" else None
    start = manager.latest_step() + 1 if manager is not None and manager.latest_step() is not None else 0
    for n in range(start, start + 10_000):
        _support.append_line(log, f"begin {n}")
        if op == "gc":
            repo.save(_support.make_state(9, n, scale=0.05), ref="scratch")
            repo.delete_ref("scratch")
            repo.gc(reflog_expiry=0)
            _support.append_line(log, f"done {n}")
        elif op == "import":
            repo.import_car(sys.argv[4], ref="imported")
            _support.append_line(log, f"done {n}")
        elif op == "delete":
            repo.set_ref(f"tmp/{n}", "keep/0")
            repo.delete_ref(f"tmp/{n}")
            _support.append_line(log, f"done {n}")
        elif op == "retention":
            assert manager is not None
            state = _support.make_state(5, n, scale=0.05)
            manager.save(n, state)
            _support.append_line(log, f"done {n} {_support.digest(state)}")
        elif op == "upkeep":
            for i in range(2):
                repo.save(_support.make_state(7, 2 * n + i, scale=0.02), ref=f"up/{i}")
            repo.upkeep(force=True)
            _support.append_line(log, f"done {n}")
        else:
            raise SystemExit(f"unknown operation {op}")


if __name__ == "__main__":
    main()
