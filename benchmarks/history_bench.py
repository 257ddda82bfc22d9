#!/usr/bin/env python
"""History queries as history grows: time and S3 requests, before and after the commit graph.

For each history length (``--sizes``, default 100, 1,000 and 10,000 commits) and medium (a local
directory, and an ``s3://`` repository on a moto server started for the run), a repository is
built holding one run's history: the commits of all but the last ``TIP`` steps written in one
transaction (a save's commit node each, with the manager's metadata, ``{"step", "metrics":
{"loss"}}``), then ``TIP`` ordinary saves (on the side with a commit graph these leave the
uncovered tip a save leaves between two layers), step refs for the retained steps. Then, each
``--reps`` times (medians shown), with the S3 requests of each counted:

- ``log``: the whole history (``repo.log``), in a repository just opened (the layers read);
- ``log_10``: the newest 10 commits, as ``cas-ckpt log | head`` would want them;
- ``cli_log``: ``cas-ckpt log RUN`` itself (opening the repository included, its output
  discarded): expired marks and fork points;
- ``diff_meta``: the metadata of the oldest commit (``RUN~N-1``, its data pinned) and of the
  newest, read to compare them; ``diff``: ``repo.diff(RUN~N-1, RUN)`` (the states are small: the
  walk dominates);
- ``steps``: ``CheckpointManager.steps()`` of the run (keep_last=5, keep_best=3 by ``loss``);
- ``retention``: one ``manager.save`` of a small state with that retention (a step expires, GC
  runs: its lineage marking walks the whole history); ``gc``: ``repo.gc`` as retention runs it;
- ``remote_retention`` (S3 only): the two-tier manager's retention on the remote
  (``Replicator._retain_remote``, keep_last=3, keep_best=2), a step to expire each time.

"before" runs the same code against ``--base`` (default 3327dd7, the code before the commit
graph), exported with ``git archive`` into a temporary folder, in a child process of its own;
"after" against this working tree. Nothing here is a threshold: the table shows what was measured.

    .venv/bin/python benchmarks/history_bench.py --json history.json            # ~15-25 min
    .venv/bin/python benchmarks/history_bench.py --sizes 100,1000 --reps 1     # quick, ~2 min
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BASE = "3327dd7"
SIZES = (100, 1000, 10_000)
TIP = 10  # saves made one by one after the bulk of the history
RUN = "run"
OPS = ("log", "log_10", "cli_log", "diff_meta", "diff", "steps", "retention", "gc", "remote_retention")


# -- the child: one side's measurements on one medium and history length --------------------
REQUESTS: collections.Counter[str] = collections.Counter()


def count_requests() -> None:
    """Count every S3 request of every client cas_ckpt makes from now on (by operation name)."""
    from cas_ckpt.backends import s3

    make = s3._make_client

    def counted(*args: Any, **kwargs: Any) -> Any:
        client = make(*args, **kwargs)
        client.meta.events.register("before-call.s3", lambda model, **_: REQUESTS.update([model.name]))
        return client

    s3._make_client = counted


def build(location: str, n: int) -> None:
    """A run of ``n`` commits on ``RUN``: all but the last TIP in one transaction, then TIP
    saves; step refs for the last 5 steps."""
    import numpy as np

    import cas_ckpt

    with cas_ckpt.open(location) as repo:
        with repo.transaction() as txn:
            tree = txn.tree.write({"w": np.zeros(8, np.float32), "step": 0})
            previous: bytes | None = None
            for step in range(n - TIP):
                metadata = {"step": step, "metrics": {"loss": loss(n, step)}}
                parents = [previous] if previous is not None else []
                previous = txn.put_commit(tree, parents, step=step, metadata=metadata, message=None)
            assert previous is not None
            txn.move_ref(RUN, None, previous, "bulk")
        for step in range(n - TIP, n):
            repo.save(state(step), ref=RUN, step=step,
                      metadata={"step": step, "metrics": {"loss": loss(n, step)}})
        for step in range(n - 5, n):
            repo.set_ref(f"{RUN}.steps/{step:012d}", f"{RUN}~{n - 1 - step}")
        repo.pin(f"{RUN}~{n - 1}")  # the first commit's data stays through retention: diff reads it


def loss(n: int, step: int) -> float:
    """A metric that ranks the steps near the head alike whatever the history's length."""
    return 1.0 + (n - 1 - step) % 7


def state(step: int) -> dict[str, Any]:
    import numpy as np

    return {"w": np.full(8, step, np.float32), "step": step}


def measure(medium: str, n: int, reps: int, workdir: Path) -> dict[str, Any]:
    import cas_ckpt
    from cas_ckpt import cli
    from cas_ckpt.two_tier import Replicator, Retention

    if medium == "s3":
        import boto3

        count_requests()
        bucket = f"history-{uuid.uuid4().hex[:16]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        location = f"s3://{bucket}/repo"
    else:
        location = str(workdir / "repo")
    started = time.perf_counter()
    build(location, n)
    built = time.perf_counter() - started
    samples: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)

    def timed(op: str, run: Callable[[], Any]) -> Any:
        REQUESTS.clear()
        started = time.perf_counter()
        result = run()
        samples[op].append((time.perf_counter() - started, sum(REQUESTS.values())))
        return result

    next_step = n
    for _ in range(reps):
        with cas_ckpt.open(location) as repo:  # each repetition a process just started would see
            commits = timed("log", lambda repo=repo: list(repo.log(RUN)))
            assert len(commits) == next_step, (len(commits), next_step)  # a retention save each rep
            timed("log_10", lambda repo=repo: list(repo.log(RUN, limit=10)))

            first = f"{RUN}~{next_step - 1}"  # the first commit, its data pinned

            def diff_meta(repo: Any = repo, first: str = first) -> bool:
                return bool(repo.commit(first).metadata != repo.commit(RUN).metadata)

            assert timed("diff_meta", diff_meta)
            timed("diff", lambda repo=repo, first=first: repo.diff(first, RUN))
        with contextlib.redirect_stdout(io.StringIO()):
            code = timed("cli_log", lambda: cli.main(["--repo", location, "log", RUN]))
        assert code == 0
        with cas_ckpt.open(location) as repo:
            manager = cas_ckpt.CheckpointManager(repo, RUN, keep_last=5, keep_best=3, best_metric="loss")
            try:
                assert len(timed("steps", manager.steps)) >= 3  # remote retention keeps 3
                metrics = {"loss": loss(n, next_step)}
                timed("retention", lambda m=manager, s=next_step, f=metrics: m.save(s, state(s), metrics=f))
                next_step += 1
                timed("gc", lambda repo=repo: repo.gc(expire_reflogs=(RUN, f"{RUN}.steps/")))
            finally:
                manager.close()
            if medium == "s3":
                remote_retention(repo, timed, Replicator, Retention)
    return {"built_seconds": built, "cas_ckpt": str(Path(cas_ckpt.__file__).resolve().parent),
            "samples": samples}


def remote_retention(repo: Any, timed: Callable[..., Any], replicator: Any, retention: Any) -> None:
    """The two-tier manager's retention on ``repo`` as its remote: a step ref to expire first."""
    head = repo.commit(RUN)
    repo.set_ref(f"{RUN}.steps/{0:012d}", f"{RUN}~{head.step}")  # the oldest step, expired by the rules
    rules = retention(keep_last=3, keep_best=2, best_metric="loss", best_mode="min")
    worker = replicator(repo, RUN, repo, step_ref=lambda s: f"{RUN}.steps/{s:012d}", every=None,
                        retention=rules)
    try:
        timed("remote_retention", lambda: worker._retain_remote(repo))
    finally:
        worker.close()


# -- the parent: trees, sides, the table -----------------------------------------------------
@contextlib.contextmanager
def exported(revision: str) -> Iterator[Path]:
    """``revision``'s files in a temporary folder (``git archive``: no worktree is registered)."""
    where = Path(tempfile.mkdtemp(prefix="cas-history-base-"))
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", revision],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def run_side(tree: Path, medium: str, n: int, reps: int) -> dict[str, Any]:
    """One side's measurements, by a child process importing ``tree``'s cas_ckpt."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory(prefix="cas-history-work-") as work:
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", medium, str(n), str(reps), work],
            env=env, capture_output=True, text=True, check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"the side at {tree} ({medium}, {n}) failed:\n{done.stdout}{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result["cas_ckpt"]).is_relative_to(tree.resolve()):
        raise SystemExit(f"the side at {tree} imported cas_ckpt from {result['cas_ckpt']}")
    return result


def summary(samples: list[list[float]]) -> dict[str, float]:
    return {"seconds": statistics.median(s for s, _ in samples),
            "requests": statistics.median(r for _, r in samples)}


def render(runs: list[dict[str, Any]]) -> str:
    lines = [f"{'medium':<7}{'commits':>8}  {'operation':<17}{'before s':>10}{'req':>7}"
             f"{'after s':>10}{'req':>7}{'after/before':>14}"]
    for run in runs:
        before, after = run["before"]["samples"], run["after"]["samples"]
        for op in OPS:
            if op not in after:
                continue
            b, a = summary(before[op]), summary(after[op])
            ratio = a["seconds"] / b["seconds"] if b["seconds"] else float("nan")
            counted = run["medium"] == "s3"
            req_b = f"{b['requests']:.0f}" if counted else "-"
            req_a = f"{a['requests']:.0f}" if counted else "-"
            lines.append(
                f"{run['medium']:<7}{run['commits']:>8}  {op:<17}{b['seconds']:>10.3f}{req_b:>7}"
                f"{a['seconds']:>10.3f}{req_a:>7}{ratio:>14.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        medium, n, reps, work = argv[1], int(argv[2]), int(argv[3]), Path(argv[4])
        print(json.dumps(measure(medium, n, reps, work)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="history lengths (commits)")
    parser.add_argument("--media", default="local,s3", help="local, s3, or both (default)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--base", default=BASE, help=f"the revision before (default {BASE})")
    parser.add_argument("--json", type=Path, help="write every sample here")
    parser.add_argument("--render", type=Path, help="print the table of an earlier --json and exit")
    args = parser.parse_args(argv)
    if args.render:
        print(render(json.loads(args.render.read_text())["runs"]))
        return 0
    sys.path.insert(0, str(HERE))
    from s3_bench import s3_server  # a moto server for the run, unless AWS_ENDPOINT_URL names one

    sizes = [int(s) for s in args.sizes.split(",")]
    media = args.media.split(",")
    runs = []
    with exported(args.base) as base, s3_server() if "s3" in media else contextlib.nullcontext():
        for medium in media:
            for n in sizes:
                if n <= TIP + 5:
                    raise SystemExit(f"a history needs more than {TIP + 5} commits")
                run = {"medium": medium, "commits": n, "before": run_side(base, medium, n, args.reps),
                       "after": run_side(ROOT, medium, n, args.reps)}
                runs.append(run)
                print(render([run]), flush=True)
    print("\n" + render(runs))
    if args.json:
        machine = {"python": platform.python_version(), "cpus": os.cpu_count(),
                   "date": time.strftime("%Y-%m-%d"), "base": args.base, "reps": args.reps}
        args.json.write_text(json.dumps({"machine": machine, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
