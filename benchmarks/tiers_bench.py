#!/usr/bin/env python
"""Every-step checkpoints over tiers (issue #50, item 4): a CPU training loop that saves every step
with ``async_save=True`` into a tmpfs repository replicated to a peer's ``cas-ckpt serve`` on
loopback and to a disk folder, against the same loop without checkpoints and with DCP's
``async_save`` to local disk every step; then recovery after SIGKILL and after losing the host.

The state is ``--tensors`` (default 40) float32 torch tensors; ``--scenarios`` gives its size and
the step's length (default 256 MiB at 0.5 s and 2 s, 1 GiB at 2 s: a 1 GiB state's background
work takes far longer than 0.5 s on 2 cores, the background figures show it). A step changes the
state in place (``add_``: every element of the tensors it touches), then does a fixed amount of
CPU work (``--matmul-dim`` float32 matmuls on ``--threads`` torch threads, default 1024 and 1,
calibrated before each pattern to fill the step). Patterns: ``all`` (every tensor
changes every step, as training's weights do: every chunk is new) and ``10pct`` (every 10th
tensor: the rest deduplicates). Measured, for each size, step length and pattern:

* **loop** (runs in turn: no checkpoints, cas_ckpt, DCP [``all`` only], no checkpoints again):
  ``--steps`` steps; per save the *stall* (the time the loop is held: cas_ckpt's ``save()``, and
  DCP's wait for its previous save plus its ``async_save`` call), against a *memcpy* of the state
  (its tensors copied into preallocated, touched buffers: ``torch`` ``copy_`` and ``np.copyto``,
  the faster median); the loop's steps/s against the mean of the two no-checkpoint runs'; the
  tiers' lag after each save; the CPU seconds of the background work (this process's threads
  other than the loop's, and the peer server's); the wait at ``close()`` (every tier caught up).
* **background**: with no training work, a few saves one by one: the seconds until the local save
  is durable and until every tier has it (each tier's push), and the CPU seconds it all took: the
  work a step must hide. It fits in a step where its CPU seconds are at most ``step x (cores - 1)``
  (the loop holds one core). The throughput target applies only there.
* **recovery after SIGKILL**: a trainer subprocess saves every step (``all``; ``--child-step-seconds``
  apart, default 2) and is killed with SIGKILL right after its ``--kill-after``-th save returned
  (default 3; that save in flight); a new manager on
  the same tiers is made and ``restore()``s (``last_restore.tier`` must be ``"local"``), every
  tensor read once (a sum), against ``safetensors.torch.load_file`` of the same state from a file
  in tmpfs, every tensor read the same way; the restored state is checked against the expected one.
  Then, the tiers caught up, ``restore()`` alone: verified (the default), ``verify=False``, and
  ``mmap=True, verify=False``.
* **recovery after losing the host**: the tmpfs repository and the disk tier deleted, a new
  manager restores from the peer: ``last_restore.bytes`` must equal the bytes of the blocks the new
  repository then holds (``repo.stats().total_bytes``: it started empty), and the state is checked.

    .venv/bin/python benchmarks/tiers_bench.py              # ~9-11 min on 2 cores
    .venv/bin/python benchmarks/tiers_bench.py --quick      # seconds: the smoke test

Writes ``results/tiers-DATE.json`` (``--json`` elsewhere; none with ``--quick`` unless given);
``--render FILE`` prints the tables of an earlier run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from _context import machine, tree_state

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MiB = 1024 * 1024
GiB = 1024 * MiB
TOKEN = "tiers-bench-write-token"
TICK = os.sysconf("SC_CLK_TCK")
TARGETS = {"stall_vs_memcpy": 1.2, "throughput_vs_none": 0.95, "sigkill_vs_safetensors": 1.5}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    text = text.strip().lower()
    for suffix, unit in (("gib", GiB), ("mib", MiB), ("g", GiB), ("m", MiB)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * unit)
    return int(text) * MiB  # a plain number: MiB


# -- the state and the step ------------------------------------------------------------------
def make_state(size: int, tensors: int, seed: int = 0) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    n = size // 4 // tensors
    return {f"layer{i:02d}.weight": torch.rand(n, generator=gen) for i in range(tensors)}


def changed(state: dict[str, Any], pattern: str) -> list[str]:
    names = list(state)
    return names if pattern == "all" else names[::10]


def update(state: dict[str, Any], names: list[str]) -> None:
    """An optimizer step's worth of change: every element of these tensors, in place."""
    for name in names:
        state[name].add_(1e-3)


def state_after(size: int, tensors: int, updates: int) -> dict[str, Any]:
    """What the trainer subprocess holds after ``updates`` steps (pattern ``all``)."""
    state = make_state(size, tensors)
    for _ in range(updates):
        update(state, list(state))
    return state


def touch(state: dict[str, Any]) -> float:
    """Read every tensor once (a restore or a lazy load is timed until its bytes were read)."""
    return sum(float(t.sum()) for t in state.values())


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


class Work:
    """A fixed amount of CPU work: float32 matmuls, calibrated to seconds on an idle loop."""

    def __init__(self, dim: int) -> None:
        import torch

        gen = torch.Generator().manual_seed(1)
        self.a, self.b = torch.rand(dim, dim, generator=gen), torch.rand(dim, dim, generator=gen)
        self.out = torch.empty(dim, dim)
        self.per_iter = self.measure()

    def measure(self) -> float:
        """Seconds per matmul now (the machine's load changes: measured again before each pattern)."""
        import torch

        times = []
        for _ in range(7):
            started = time.perf_counter()
            for _ in range(20):
                torch.mm(self.a, self.b, out=self.out)
            times.append((time.perf_counter() - started) / 20)
        return statistics.median(times)

    def iters(self, seconds: float) -> int:
        return max(0, round(seconds / self.per_iter))

    def run(self, iters: int) -> None:
        import torch

        for _ in range(iters):
            torch.mm(self.a, self.b, out=self.out)


def memcpy(state: dict[str, Any], reps: int = 5) -> dict[str, float]:
    """Median seconds to copy the state into preallocated, touched buffers: torch and numpy."""
    import torch

    buffers = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():
        buffers[k].copy_(v)  # faulted in
    out: dict[str, list[float]] = {"torch_copy_": [], "np_copyto": []}
    for _ in range(reps):
        started = time.perf_counter()
        for k, v in state.items():
            buffers[k].copy_(v)
        out["torch_copy_"].append(time.perf_counter() - started)
        started = time.perf_counter()
        for k, v in state.items():
            np.copyto(buffers[k].numpy(), v.numpy())
        out["np_copyto"].append(time.perf_counter() - started)
    medians = {k: statistics.median(v) for k, v in out.items()}
    medians["reference"] = min(medians.values())
    return medians


def nice_background(pids: list[int]) -> None:
    """``--nice-background``: every thread of this process but the loop's, and of ``pids``, at
    nice 19 (threads they start inherit it): the loop keeps its core while they wait."""
    loop = threading.get_native_id()
    tasks = [int(t) for t in os.listdir("/proc/self/task") if int(t) != loop]
    for pid in pids:
        with contextlib.suppress(OSError):
            tasks += [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    for tid in tasks:
        with contextlib.suppress(OSError):
            if os.getpriority(os.PRIO_PROCESS, tid) != 19:
                os.setpriority(os.PRIO_PROCESS, tid, 19)


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


# -- the tiers -------------------------------------------------------------------------------
class Peer:
    """``cas-ckpt serve REPO --write-token`` on 127.0.0.1, a port the kernel picks."""

    def __init__(self, repo: Path, log_file: Path) -> None:
        self._log = log_file.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cas_ckpt", "serve", str(repo), "--host", "127.0.0.1", "--port", "0",
             "--write-token", TOKEN],
            stdout=subprocess.PIPE, stderr=self._log, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # printed once it listens
        if " at " not in line:
            self.stop()
            raise RuntimeError(f"cas-ckpt serve did not start; its log: {log_file}")
        self.url = line.split(" at ")[1].split()[0]
        self._drain = threading.Thread(target=self.proc.stdout.read, daemon=True)
        self._drain.start()

    def cpu(self) -> float:
        """The server's CPU seconds so far (user + system)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / TICK

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class Tiers:
    """A tmpfs repository, a peer serving a tmpfs repository of its own, and a disk folder."""

    def __init__(self, shm: Path, disk: Path, hash_name: str) -> None:
        import cas_ckpt

        self.top_shm = Path(tempfile.mkdtemp(prefix="tiers-bench-", dir=shm))
        self.top_disk = Path(tempfile.mkdtemp(prefix="tiers-bench-", dir=disk))
        self.ram, self.peer_repo = self.top_shm / "ram", self.top_shm / "peer"
        self.disk = self.top_disk / "disk"
        self.hash = hash_name
        for repo in (self.ram, self.peer_repo):  # the manager makes its tiers with its own settings
            cas_ckpt.open(repo, hash=hash_name).close()
        self.peer = Peer(self.peer_repo, self.top_disk / "peer.log")

    def manager_args(self) -> dict[str, Any]:
        return {"repo": str(self.ram), "ref": "run", "keep_last": 2, "async_save": True,
                "replicate_to": [self.peer.url, str(self.disk)], "remote_retention": {"keep_last": 2},
                "remote_storage_options": [{"token": TOKEN}, None]}

    def manager(self) -> Any:
        import cas_ckpt

        args = self.manager_args()
        return cas_ckpt.CheckpointManager(args.pop("repo"), args.pop("ref"), **args)

    def close(self) -> None:
        self.peer.stop()
        shutil.rmtree(self.top_shm, ignore_errors=True)
        shutil.rmtree(self.top_disk, ignore_errors=True)


@contextlib.contextmanager
def tiers(args: argparse.Namespace) -> Iterator[Tiers]:
    made = Tiers(args.shm, args.workdir, args.hash)
    try:
        yield made
    finally:
        made.close()


# -- the loop --------------------------------------------------------------------------------
def run_loop(mode: str, state: dict[str, Any], names: list[str], iters: int, args: argparse.Namespace,
             work: Work) -> dict[str, Any]:
    """``args.steps`` steps of update + work, saving every step as ``mode`` says."""
    import torch.distributed.checkpoint as dcp

    from cas_ckpt.errors import ReplicationFailed

    steps, floor = args.steps, 2 * GiB + 2 * sum(t.nbytes for t in state.values())
    stalls, waits, lags = [], [], []
    made = contextlib.ExitStack()
    mgr = future = None
    dcp_dir = None
    with made:
        if mode == "cas":
            where = made.enter_context(tiers(args))
            mgr = where.manager()
            made.callback(lambda: mgr._closed or mgr.close())  # on an error; normally closed below
            server_cpu0 = where.peer.cpu()
        elif mode == "dcp":
            dcp_dir = Path(tempfile.mkdtemp(prefix="tiers-bench-dcp-", dir=args.workdir))
            made.callback(shutil.rmtree, dcp_dir, True)
        stopped = None
        cpu0, thread0, started = time.process_time(), time.thread_time(), time.perf_counter()
        for step in range(steps):
            if mode != "none" and mem_available() < floor:
                stopped = f"stopped after {step} steps: {mem_available() / GiB:.1f} GiB of memory left"
                log(f"    {stopped}")
                break
            update(state, names)
            work.run(iters)
            began = time.perf_counter()
            if mode == "cas":
                # save() first waits for the save in flight (its _drain), then copies the state:
                # the two timed apart, exactly what save() does in that order.
                mgr._drain()
                waited = time.perf_counter()
                mgr.save(step, state)
                lags.append([lag.steps for lag in mgr.replication_lag])
            elif mode == "dcp":
                if future is not None:
                    future.result()
                waited = time.perf_counter()
                with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
                    warnings.simplefilter("ignore")
                    future = dcp.async_save(state, checkpoint_id=dcp_dir / f"step-{step}")
            else:
                waited = began
            ended = time.perf_counter()
            if args.nice_background and mode != "none":
                nice_background([where.peer.proc.pid] if mode == "cas" else [])
            if mode != "none":
                stalls.append(ended - began)
                waits.append(waited - began)
        loop_seconds = time.perf_counter() - started
        done = len(stalls) if mode != "none" else steps
        cpu = time.process_time() - cpu0
        loop_cpu = time.thread_time() - thread0
        out: dict[str, Any] = {"mode": mode, "steps": done, "loop_seconds": loop_seconds,
                               "steps_per_second": done / loop_seconds, "loop_thread_cpu": loop_cpu,
                               "background_cpu": cpu - loop_cpu}
        if stopped:
            out["stopped"] = stopped
        if mode == "none":
            return out
        out.update({"stall_seconds": stalls, "wait_previous_seconds": waits})
        began = time.perf_counter()
        if mode == "cas":
            assert mgr is not None
            out["lag_steps"] = lags
            out["last_save"] = {"bytes_written": mgr.last_report.bytes_written if mgr.last_report else None}
            try:
                mgr.close()  # every tier catches up
            except ReplicationFailed as exc:  # recorded: the figures say which tier could not
                out["replication_failed"] = str(exc)
                log(f"    close(): {exc}")
            out["server_cpu"] = where.peer.cpu() - server_cpu0
        elif future is not None:
            future.result()
        out["close_seconds"] = time.perf_counter() - began
        out["background_cpu"] = time.process_time() - cpu0 - loop_cpu + out.get("server_cpu", 0.0)
    return out


def background(state: dict[str, Any], names: list[str], args: argparse.Namespace, saves: int = 3
               ) -> dict[str, Any]:
    """With no training work: each save's background work, one save at a time (the first, a
    fresh repository's, is reported apart)."""
    rows = []
    with tiers(args) as where:
        mgr = where.manager()
        try:
            for step in range(saves):
                update(state, names)
                cpu0, server0 = time.process_time(), where.peer.cpu()
                began = time.perf_counter()
                mgr.save(step, state)
                returned = time.perf_counter()
                mgr._drain()  # the local save is durable
                local = time.perf_counter()
                mgr.wait()  # and every tier has it
                every = time.perf_counter()
                pushes = [{"tier": r.where, "seconds": r.last_report.seconds if r.last_report else None,
                           "bytes_sent": r.last_report.bytes_sent if r.last_report else None}
                          for r in mgr._replicators]
                rows.append({"save_returned": returned - began, "local_durable": local - began,
                             "every_tier": every - began, "pushes": pushes,
                             "bytes_written": mgr.last_report.bytes_written if mgr.last_report else None,
                             "cpu": time.process_time() - cpu0 + where.peer.cpu() - server0,
                             "server_cpu": where.peer.cpu() - server0})
        finally:
            mgr.close()
    later = rows[1:] or rows
    return {"saves": rows, "median": {
        "local_durable": statistics.median(r["local_durable"] for r in later),
        "every_tier": statistics.median(r["every_tier"] for r in later),
        "cpu": statistics.median(r["cpu"] for r in later),
        "server_cpu": statistics.median(r["server_cpu"] for r in later),
        "save_returned": statistics.median(r["save_returned"] for r in later),
        "peer_push": statistics.median(r["pushes"][0]["seconds"] for r in later),
        "disk_push": statistics.median(r["pushes"][1]["seconds"] for r in later),
        "bytes_written": statistics.median(r["bytes_written"] for r in later)}}


def summary(run: dict[str, Any], ref: float) -> dict[str, Any]:
    stalls = run.get("stall_seconds") or []
    later = stalls[1:] or stalls
    if not later:
        return {}
    return {"stall_median": statistics.median(later), "stall_max": max(later), "stall_first": stalls[0],
            "wait_previous_median": statistics.median(run["wait_previous_seconds"][1:]
                                                      or run["wait_previous_seconds"]),
            "stall_vs_memcpy": statistics.median(later) / ref}


def measure_scenario(size: int, step_s: float, args: argparse.Namespace, work: Work,
                     state: dict[str, Any], copy: dict[str, float], done: dict[str, Any]) -> dict[str, Any]:
    """The loop at one size and step length; ``done``: the background figures per pattern
    measured at this size already (they do not depend on the step)."""
    out: dict[str, Any] = {"size": size, "step_seconds": step_s, "memcpy": copy, "patterns": {},
                           "loadavg_at_start": os.getloadavg()}
    for pattern in args.patterns:
        names = changed(state, pattern)
        work.per_iter = work.measure()
        times = []
        for _ in range(3):
            began = time.perf_counter()
            update(state, names)
            times.append(time.perf_counter() - began)
        iters = work.iters(step_s - statistics.median(times))
        modes = ["none", "cas", *(["dcp"] if pattern == "all" and "dcp" in args.modes else []), "none"]
        runs: dict[str, Any] = {}
        for i, mode in enumerate(modes):
            label = "none_after" if mode == "none" and i else mode
            log(f"  {size / MiB:.0f} MiB, step {step_s} s, {pattern}: {label}")
            runs[label] = run_loop(mode, state, names, iters, args, work)
            row = runs[label]
            stalls = row.get("stall_seconds")
            log(f"    {row['steps_per_second']:.3f} steps/s"
                + (f", stall median {statistics.median(stalls[1:] or stalls):.3f} s" if stalls else "")
                + (f", close {row['close_seconds']:.2f} s" if "close_seconds" in row else ""))
        if "background" in args.parts:
            if pattern not in done:
                log(f"  {size / MiB:.0f} MiB, {pattern}: background work per save")
                done[pattern] = background(state, names, args)
            runs["background"] = done[pattern]
        base = statistics.mean([runs["none"]["steps_per_second"], runs["none_after"]["steps_per_second"]])
        figures: dict[str, Any] = {"update_seconds": statistics.median(times), "work_iters": iters,
                                   "work_seconds_per_matmul": work.per_iter, "none_steps_per_second": base}
        base_cpu = statistics.mean(runs[k]["loop_thread_cpu"] / runs[k]["steps"]
                                   for k in ("none", "none_after"))
        for mode in ("cas", "dcp"):
            if mode in runs:
                run, done_steps = runs[mode], max(runs[mode]["steps"], 1)
                figures[mode] = {**summary(run, copy["reference"]),
                                 "throughput_vs_none": run["steps_per_second"] / base,
                                 "background_cpu_per_step": run["background_cpu"] / done_steps,
                                 "loop_cpu_vs_none": run["loop_thread_cpu"] / done_steps / base_cpu,
                                 "close_seconds": run["close_seconds"]}
                if "replication_failed" in runs[mode]:
                    figures[mode]["replication_failed"] = runs[mode]["replication_failed"]
        if "cas" in runs:
            figures["cas"]["max_lag_steps"] = max((max(lag) for lag in runs["cas"]["lag_steps"]), default=0)
            if "background" in runs:
                bg = runs["background"]["median"]
                figures["cas"]["background_per_save"] = bg
                figures["cas"]["fits"] = bg["cpu"] <= step_s * ((os.cpu_count() or 1) - 1)
        out["patterns"][pattern] = {"runs": runs, "figures": figures}
    return out


# -- recovery --------------------------------------------------------------------------------
def child_main(config: dict[str, Any]) -> None:
    """The trainer that gets killed: saves every step and says so once each save() returned."""
    import torch

    import cas_ckpt

    torch.set_num_threads(1)
    state = make_state(config["size"], config["tensors"])
    mgr = cas_ckpt.CheckpointManager(config["repo"], config["ref"], **config["manager"])
    names = list(state)
    step = 0
    while True:
        update(state, names)
        time.sleep(config["step_seconds"])
        mgr.save(step, state)
        print(f"saved {step}", flush=True)
        step += 1


def recovery(size: int, args: argparse.Namespace) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file

    from cas_ckpt.errors import ReplicationFailed

    out: dict[str, Any] = {"size": size}
    with tiers(args) as where:
        margs = where.manager_args()
        config = {"size": size, "tensors": args.tensors, "repo": margs.pop("repo"), "ref": margs.pop("ref"),
                  "manager": margs, "step_seconds": args.child_step_seconds}
        child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child",
                                  json.dumps(config)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert child.stdout is not None
        try:
            for line in child.stdout:
                if line.strip() == f"saved {args.kill_after - 1}":
                    break
            else:
                raise RuntimeError(f"the trainer ended before {args.kill_after} saves: {child.wait()}")
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
        out["killed_after_saves"] = args.kill_after

        # -- SIGKILL: the RAM tier is intact --
        began = time.perf_counter()
        mgr = where.manager()
        made = time.perf_counter()
        restored = mgr.restore()
        touch(restored)
        ended = time.perf_counter()
        report = mgr.last_restore
        step = mgr.latest_step()
        out["sigkill"] = {"construct_seconds": made - began, "restore_seconds": ended - made,
                          "seconds": ended - began, "tier": report.tier if report else None,
                          "restore_report_step": report.step if report else None, "step": step,
                          "lag_at_start": [lag.steps for lag in mgr.replication_lag]}
        expected = state_after(size, args.tensors, step + 1)
        out["sigkill"]["state_matches"] = same(restored, expected)
        del restored
        try:
            mgr.wait()  # the tiers catch up (untimed); then restore() alone, three ways
        except ReplicationFailed as exc:
            out["sigkill"]["replication_failed"] = str(exc)
            log(f"    wait(): {exc}")
        again: dict[str, list[float]] = {"verified": [], "noverify": [], "mmap_noverify": []}
        for _ in range(args.reps):
            for label, options in (("verified", {}), ("noverify", {"verify": False}),
                                   ("mmap_noverify", {"verify": False, "mmap": True})):
                began = time.perf_counter()
                touch(mgr.restore(**options))
                again[label].append(time.perf_counter() - began)
        out["sigkill"]["restore_again_seconds"] = again
        with contextlib.suppress(ReplicationFailed):  # recorded above
            mgr.close()

        # -- safetensors from tmpfs, the same state --
        path = where.top_shm / "state.safetensors"
        save_file(expected, str(path))
        loads = []
        for _ in range(args.reps):
            began = time.perf_counter()
            touch(load_file(str(path)))
            loads.append(time.perf_counter() - began)
        path.unlink()
        st = statistics.median(loads)
        out["safetensors_seconds"] = loads
        out["sigkill"]["vs_safetensors"] = out["sigkill"]["seconds"] / st
        out["sigkill"]["restore_again_vs_safetensors"] = {k: statistics.median(v) / st
                                                          for k, v in again.items()}

        # -- the host lost: RAM and disk tiers gone, the peer survives --
        import cas_ckpt

        with cas_ckpt.open(where.peer_repo, create=False) as peer:
            peer_step = peer.commit("run").step
            peer_usage = peer.stats()
        shutil.rmtree(where.ram)
        shutil.rmtree(where.disk)
        began = time.perf_counter()
        mgr = where.manager()
        made = time.perf_counter()
        restored = mgr.restore()
        touch(restored)
        ended = time.perf_counter()
        report = mgr.last_restore
        usage = mgr.repo.stats()
        out["host_lost"] = {
            "construct_seconds": made - began, "restore_seconds": ended - made, "seconds": ended - began,
            "tier": report.tier if report else None,
            "is_peer": bool(report and report.tier == where.peer.url),
            "step": report.step if report else None, "peer_step": peer_step,
            "bytes_moved": report.bytes if report else None,
            "blocks_moved": report.blocks if report else None,
            "repo_block_bytes": usage.total_bytes, "repo_blocks": usage.total_blocks,
            "peer_block_bytes": peer_usage.total_bytes,
            "state_bytes": sum(t.nbytes for t in expected.values()),
            "state_matches": same(restored, expected if report and report.step == step
                                  else state_after(size, args.tensors, (report.step if report else 0) + 1)),
        }
        out["host_lost"]["bytes_equal"] = out["host_lost"]["bytes_moved"] == usage.total_bytes
        del restored
        try:
            mgr.close()  # the disk tier gets the step again (untimed)
        except ReplicationFailed as exc:
            out["host_lost"]["replication_failed"] = str(exc)
    return out


# -- the report ------------------------------------------------------------------------------
def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for sc in results["scenarios"]:
        where = f"{sc['size'] / MiB:.0f} MiB, step {sc['step_seconds']} s"
        for pattern, found in sc["patterns"].items():
            cas = found["figures"].get("cas", {})
            if "stall_vs_memcpy" in cas:
                rows.append({"target": "stall <= 1.2x memcpy", "where": f"{where}, {pattern}",
                             "value": cas["stall_vs_memcpy"], "met": cas["stall_vs_memcpy"] <= 1.2})
            fits = cas.get("fits")
            note = None
            if fits is False:
                note = f"background {cas['background_per_save']['cpu']:.2f} CPU-s per save > one free core"
            if cas.get("replication_failed"):
                note = f"{note + '; ' if note else ''}a tier failed: {cas['replication_failed'][:90]}"
            rows.append({"target": "throughput >= 0.95x no checkpoints", "where": f"{where}, {pattern}",
                         "value": cas.get("throughput_vs_none"),
                         "met": None if fits is False else cas.get("throughput_vs_none", 0) >= 0.95,
                         "note": note})
    for rec in results["recovery"]:
        where = f"{rec['size'] / MiB:.0f} MiB"
        sk, hl = rec["sigkill"], rec["host_lost"]
        rows.append({"target": "SIGKILL restore <= 1.5x safetensors (tmpfs)", "where": where,
                     "value": sk["vs_safetensors"],
                     "met": sk["vs_safetensors"] <= 1.5 and sk["tier"] == "local"})
        rows.append({"target": "host lost: bytes moved == blocks the new repo holds", "where": where,
                     "value": f"{hl['bytes_moved']} / {hl['repo_block_bytes']}",
                     "met": bool(hl["bytes_equal"] and hl["is_peer"] and hl["state_matches"])})
    return rows


def render(results: dict[str, Any]) -> str:
    m, c = results["machine"], results["config"]
    nan = float("nan")
    lines = [f"{m['cpus']} CPUs ({m['cpu_model']}), {m['mem_total_gib']} GiB, torch {m['torch']}, load "
             f"average {m['loadavg_at_start'][0]:.1f} at start, {m.get('loadavg_at_end', [0])[0]:.1f} at end;"
             " "
             f"{c['tensors']} float32 tensors, {c['threads']} torch thread(s) for the loop, hash {c['hash']}"
             + ("; background threads and the peer at nice 19" if c.get("nice_background") else ""), "",
             "| state | step | changed | memcpy s | cas stall s (wait prev) | x memcpy | cas steps/s vs none"
             " (loop CPU) | bg CPU-s/save (fits) | max lag | close s | DCP stall s | x memcpy"
             " | DCP vs none |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    failures = []
    for sc in results["scenarios"]:
        for pattern, found in sc["patterns"].items():
            f = found["figures"]
            cas, d = f.get("cas", {}), f.get("dcp", {})
            bg = cas.get("background_per_save")
            cells = [f"{sc['size'] / MiB:.0f} MiB", f"{sc['step_seconds']} s", pattern,
                     f"{sc['memcpy']['reference']:.3f}",
                     f"{cas.get('stall_median', nan):.3f} ({cas.get('wait_previous_median', nan):.3f})",
                     f"{cas.get('stall_vs_memcpy', nan):.2f}",
                     f"{cas.get('throughput_vs_none', nan):.3f} ({cas.get('loop_cpu_vs_none', nan):.2f})",
                     f"{bg['cpu']:.2f} ({'yes' if cas.get('fits') else 'no'})" if bg else "-",
                     str(cas.get("max_lag_steps", "-")), f"{cas.get('close_seconds', nan):.1f}"]
            cells += ([f"{d['stall_median']:.3f}", f"{d['stall_vs_memcpy']:.2f}",
                       f"{d['throughput_vs_none']:.3f}"] if d else ["-", "-", "-"])
            lines.append("| " + " | ".join(cells) + " |")
            if cas.get("replication_failed"):
                failures.append(f"{sc['size'] / MiB:.0f} MiB, step {sc['step_seconds']} s, {pattern}: "
                                f"close() raised: {cas['replication_failed']}")
    if failures:
        lines += ["", *failures]
    background = ["", "| state | changed | save() alone s | local durable s | peer push s | disk push s"
                  " | every tier s | CPU-s (peer's) | bytes written |",
                  "|---|---|---|---|---|---|---|---|---|"]
    seen = set()
    for sc in results["scenarios"]:
        for pattern, found in sc["patterns"].items():
            bg = found["runs"].get("background")
            if not bg or (sc["size"], pattern) in seen:
                continue
            seen.add((sc["size"], pattern))
            b, later = bg["median"], bg["saves"][1:] or bg["saves"]
            alone = b.get("save_returned", statistics.median(r["save_returned"] for r in later))
            cells = [f"{sc['size'] / MiB:.0f} MiB", pattern, f"{alone:.3f}",
                     f"{b['local_durable']:.2f}", f"{b['peer_push']:.2f}", f"{b['disk_push']:.2f}",
                     f"{b['every_tier']:.2f}",
                     f"{b['cpu']:.2f} ({b['server_cpu']:.2f})" if "server_cpu" in b else f"{b['cpu']:.2f}",
                     f"{b['bytes_written'] / MiB:.1f} MiB"]
            background.append("| " + " | ".join(cells) + " |")
    if seen:
        lines += background
    if results["recovery"]:
        lines += ["", "| state | SIGKILL: tier, step | new manager + restore s | safetensors s | ratio"
                  " | restore alone vs safetensors: verified, no verify, mmap no verify | host lost: tier | s"
                  " | MiB moved | = repo blocks | state ok |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for rec in results["recovery"]:
            sk, hl = rec["sigkill"], rec["host_lost"]
            cells = [f"{rec['size'] / MiB:.0f} MiB", f"{sk['tier']}, {sk['step']}",
                     f"{sk['seconds']:.3f} ({sk['construct_seconds']:.3f} + {sk['restore_seconds']:.3f})",
                     f"{statistics.median(rec['safetensors_seconds']):.3f}", f"{sk['vs_safetensors']:.2f}",
                     ", ".join(f"{v:.2f}" for v in sk["restore_again_vs_safetensors"].values()),
                     "peer" if hl["is_peer"] else str(hl["tier"]), f"{hl['seconds']:.2f}",
                     f"{hl['bytes_moved'] / MiB:.1f}", "yes" if hl["bytes_equal"] else "NO",
                     "yes" if sk["state_matches"] and hl["state_matches"] else "NO"]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Targets:"]
    for row in results["targets"]:
        verdict = {True: "MET", False: "NOT MET", None: "n/a"}[row["met"]]
        value = f"{row['value']:.3f}" if isinstance(row["value"], float) else row["value"]
        note = f" ({row['note']})" if row.get("note") else ""
        lines.append(f"  {verdict:<8} {row['target']}: {row['where']}: {value}{note}")
    return "\n".join(lines)






def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", help="SIZE@STEP_SECONDS,... (default 256MiB@0.5,256MiB@2,1GiB@2; "
                        "--quick 16MiB@0.2)")
    parser.add_argument("--recover", help="state sizes of the recovery runs (default: the scenarios')")
    parser.add_argument("--steps", type=int, help="steps per loop run (default 8; --quick 3)")
    parser.add_argument("--patterns", default="all,10pct", help="what changes a step: all, 10pct")
    parser.add_argument("--modes", default="cas,dcp", help="compared with no checkpoints: cas, dcp")
    parser.add_argument("--parts", default="loop,background,recovery", help="what to run")
    parser.add_argument("--tensors", type=int, default=40, help="tensors in the state (default 40)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the loop (default 1)")
    parser.add_argument("--matmul-dim", type=int, default=1024, help="matmul side (default 1024)")
    parser.add_argument("--hash", default="sha2-256", help="the repositories' hash (default sha2-256)")
    parser.add_argument("--nice-background", action="store_true",
                        help="run the background threads and the peer at nice 19 (an experiment)")
    parser.add_argument("--kill-after", type=int, default=3, help="saves before the SIGKILL (default 3)")
    parser.add_argument("--child-step-seconds", type=float, default=2.0, help="the killed trainer's step (2)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each load (default 3)")
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="the tmpfs (default /dev/shm)")
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp"), help="disk tier and DCP (/var/tmp)")
    parser.add_argument("--quick", action="store_true", help="16 MiB, 3 steps: seconds")
    parser.add_argument("--json", type=Path, help="default results/tiers-DATE.json (none with --quick)")
    parser.add_argument("--render", type=Path, help="print the tables of an earlier run's JSON and exit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
        return 0
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0
    import torch

    torch.set_num_threads(args.threads)
    quick = args.quick
    args.scenarios = [(parse_size(item.split("@")[0]), float(item.split("@")[1])) for item in
                      (args.scenarios or ("16MiB@0.2" if quick else "256MiB@0.5,256MiB@2,1GiB@2")).split(",")]
    sizes = list(dict.fromkeys(size for size, _ in args.scenarios))
    args.recover = ([parse_size(item) for item in args.recover.split(",") if item] if args.recover is not None
                    else sizes)
    args.steps = args.steps or (3 if quick else 8)
    args.patterns = [p for p in args.patterns.split(",") if p]
    args.modes = [p for p in args.modes.split(",") if p]
    args.parts = [p for p in args.parts.split(",") if p]
    if quick:
        args.kill_after = min(args.kill_after, 2)
        args.child_step_seconds = min(args.child_step_seconds, 0.2)
        args.reps = min(args.reps, 2)
    if not set(args.patterns) <= {"all", "10pct"} or args.steps < 2:
        parser.error("--patterns takes all and 10pct; --steps at least 2")
    args.shm.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "machine": machine(), "cas_ckpt_tree": tree_state(),
        "config": {"scenarios": args.scenarios, "recover": args.recover, "steps": args.steps,
                   "patterns": args.patterns, "modes": args.modes, "tensors": args.tensors,
                   "threads": args.threads, "matmul_dim": args.matmul_dim,
                   "nice_background": args.nice_background, "hash": args.hash, "kill_after": args.kill_after,
                   "child_step_seconds": args.child_step_seconds, "reps": args.reps,
                   "shm": str(args.shm), "workdir": str(args.workdir),
                   "manager": {"keep_last": 2, "async_save": True, "remote_retention": {"keep_last": 2}}},
        "scenarios": [], "recovery": []}
    out = args.json or (None if quick else HERE / "results" / f"tiers-{results['date']}.json")
    began = time.perf_counter()

    def record() -> None:  # after each part: a run cut short keeps what it measured
        results["seconds"] = time.perf_counter() - began
        results["machine"]["loadavg_at_end"] = os.getloadavg()
        results["targets"] = verdicts(results)
        if out:
            out.write_text(json.dumps(results, indent=1) + "\n")

    work = Work(args.matmul_dim)
    for size in sizes:
        if "loop" in args.parts:
            state = make_state(size, args.tensors)
            copy = memcpy(state)
            log(f"== {size / MiB:.0f} MiB: memcpy {copy['reference']:.3f} s "
                f"(torch {copy['torch_copy_']:.3f}, numpy {copy['np_copyto']:.3f})")
            done: dict[str, Any] = {}
            for step_s in (step for each, step in args.scenarios if each == size):
                results["scenarios"].append(measure_scenario(size, step_s, args, work, state, copy, done))
                record()
            del state
    if "recovery" in args.parts:
        for size in args.recover:
            log(f"== {size / MiB:.0f} MiB: recovery")
            results["recovery"].append(recovery(size, args))
            record()
    record()
    print(render(results))
    if out:
        log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
