"""Child of test_commit_graph_faults: saves to one ref and rewrites the commit graph, in a loop.

Usage: ``_graph_child.py LOCATION REF ROUNDS LOG``. Each round saves one small commit (every
16th save writes a layer of the graph on its own) and then merges every layer into one
(``update_commit_graph(consolidate=True)``: a new layer published, the old ones deleted),
appending ``begin N`` before the merge and ``done N`` after it (fsynced) so the parent knows
where its SIGKILL landed. ``ROUNDS`` 0 means until killed.
"""

from __future__ import annotations

import itertools
import sys

import _support

import cas_ckpt


def main() -> None:
    location, ref, rounds, log = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with cas_ckpt.open(location, create=False) as repo:
        for n in itertools.count() if rounds == 0 else range(rounds):
            repo.save({"n": n, "ref": ref}, ref=ref, step=n, message=f"{ref} {n}")
            _support.append_line(log, f"begin {n}")
            repo.update_commit_graph(consolidate=True)
            _support.append_line(log, f"done {n}")


if __name__ == "__main__":
    main()
