"""Tiers under SIGKILL: trainers, a peer server and pushes killed at random moments, tiers taken
down and brought back, and two trainers pushing one ref to one peer (issue #50 item 5).

Real processes only. A trainer (``tests/scripts/tier_trainer.py``, forked from a zygote that
imported everything once) runs a ``CheckpointManager`` on a RAM repository (a tmpfs folder) with
``replicate_to=[peer, disk]``, saving a deterministic state per step (any step's bytes recomputed
from the trainer's id and the step). The peer is a ``cas-ckpt serve PEER --write-token T``
process; pushes are ``cas-ckpt push http://... side`` processes. Every kill is SIGKILL after a
random delay (seeded: ``SEED``, overridden by ``$CAS_CKPT_TIER_SEED``, named in every failure)
from an event: the trainer logging the start of a save, or an upload appearing in the peer's
``tmp/``.

The peer listens on a port picked once (free, below the kernel's ephemeral range) and is
restarted on that same port, so a trainer that lives through the outage keeps its tier URL and
reconnects, as a trainer pointed at ``peer-a:9000`` would.

After each case, with every trainer stopped (SIGUSR1: the loop ends, ``close()`` waits for every
tier), every tier's repository is read directly:

* ``fsck`` finds no problem (no ref to a missing block, every block matching its CID);
* every ref (run refs, step refs ``RUN.steps/N``, the pushed ``side`` ref) loads bit for bit as
  the deterministic state of its step (of one of the trainers that may write it);
* no step is lost: the newest step of each trainer that any tier acknowledged (held a ref to), or
  that a synchronous save returned, or that ``close()`` replicated, is still held by some tier,
  except where the test wiped that tier itself (the RAM of a host "rebooted"): then the new
  manager restores the newest step the surviving tiers hold, from the first tier holding it;
* one trainer: ``close()`` returns (every tier caught up after any outage), every tier's head is
  the last step saved, and every step ref names a commit in its run's history there;
* two trainers on one ref (the peer keeping every step): every step of a trainer whose
  ``close()`` returned is held by some tier.

CI: 12 + 6 kills. ``CAS_CKPT_LONG=1``: 180 + 45. The last two tests replay, deterministically, the
two defects the random kills found (``docs/reliability.md``, section 19).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from http_servers import ServerProcess

import cas_ckpt

from ._support import LONG, PYTHON, Timer, child_env, digest, fsck_problems, leftovers, record, scratch_dir

SEED = int(os.environ.get("CAS_CKPT_TIER_SEED", "20261206"))
TOKEN = "tier-kills-write-token"
ROUNDS_PER_KIND = 60 if LONG else 4  # trainer, peer and push kills in the one-trainer test
DUEL_CASES = 45 if LONG else 6  # one kill each (trainer a, trainer b or the peer, in turn)
TIMEOUT = 180.0  # seconds any event may take on a loaded machine before the test fails
TRAINER_TID, SIDE_TID, DUEL_TIDS = 1, 9, (2, 3)
MiB = 1 << 20
SIDE_MOVING = 8 * MiB  # what each side push sends: a temp pack past 4.5 MiB is surely its upload
CONFLICT = re.compile(r"RefConflict|RefDiverged|ReplicationFailed")
STEP_REF = re.compile(r"^(?P<run>.+)\.steps/(?P<step>\d+)$")

TRAINER = Path(__file__).resolve().parents[1] / "scripts" / "tier_trainer.py"
_spec = importlib.util.spec_from_file_location("tier_trainer", TRAINER)
assert _spec is not None and _spec.loader is not None
tier_trainer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tier_trainer)
CLI = str(Path(PYTHON).parent / "cas-ckpt")


def _state(tid: int, step: int) -> dict[str, Any]:
    return tier_trainer.state(tid, step, SIDE_MOVING if tid == SIDE_TID else tier_trainer.MOVING)


def _tids(run: str) -> tuple[int, ...]:
    if run == "side":
        return (SIDE_TID,)
    return DUEL_TIDS if run.startswith("duel/") else (TRAINER_TID,)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def _wait(what: str, ready: Callable[[], Any], context: str, timeout: float = TIMEOUT,
          dead: Callable[[], str | None] = lambda: None) -> Any:
    """Poll ``ready`` until it returns something true; fail naming ``what`` after ``timeout`` or
    as soon as ``dead`` says why it never will."""
    deadline = time.monotonic() + timeout
    while True:
        found = ready()
        if found:
            return found
        why = dead()
        if why is not None:
            found = ready()
            if found:
                return found
            raise AssertionError(f"{context}: waiting for {what}: {why}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{context}: {what} did not happen in {timeout:.0f} s")
        time.sleep(0.002)


# ----------------------------------------------------------------------------------------------
# Processes
# ----------------------------------------------------------------------------------------------
class Zygote:
    """``tier_trainer.py``: imports once, forks each trainer, reports each one's exit."""

    def __init__(self, err: Path) -> None:
        self.err = err
        self._errf = open(err, "a")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen([PYTHON, str(TRAINER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._errf, text=True, env=child_env())
        self._lines: queue.Queue[str] = queue.Queue()
        self._exit: int | None = None
        threading.Thread(target=self._read, daemon=True).start()
        assert self._next(TIMEOUT) == "ready", f"the trainer zygote did not start: {_tail(err)}"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put("eof")

    def _next(self, timeout: float) -> str:
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the trainer zygote said nothing in {timeout:.0f} s: "
                                 f"{_tail(self.err)}") from None

    def fork(self, args: dict[str, Any]) -> int:
        assert self.proc.stdin is not None
        self._exit = None
        self.proc.stdin.write(f"run {json.dumps(args)}\n")
        self.proc.stdin.flush()
        return int(self._next(60))

    def exited(self) -> int | None:
        """The running trainer's wait status, once it ended (without blocking)."""
        if self._exit is None:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                return None
            assert line.startswith("exit "), line
            self._exit = int(line.split()[1])
        return self._exit

    def reap(self, timeout: float) -> int:
        if self._exit is None:
            line = self._next(timeout)
            assert line.startswith("exit "), line
            self._exit = int(line.split()[1])
        return self._exit

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with_suppressed(stream.close)
        self._errf.close()


class Trainer:
    """One trainer slot: its RAM repository, disk tier, log, and the zygote it is forked from."""

    def __init__(self, name: str, tid: int, zygote: Zygote, ram: Path, disk: Path, log: Path) -> None:
        self.name, self.tid, self.zygote = name, tid, zygote
        self.ram, self.disk, self.log = ram, disk, log
        self.pid: int | None = None
        self.offset = 0
        self.async_save = False
        self.context = ""

    @property
    def running(self) -> bool:
        return self.pid is not None

    def lines(self, since: int | None = None) -> list[list[str]]:
        try:
            with open(self.log, "rb") as f:
                f.seek(self.offset if since is None else since)
                data = f.read()
        except FileNotFoundError:
            return []
        return [line.split() for line in data.decode().splitlines() if line.strip()]

    def size(self) -> int:
        try:
            return self.log.stat().st_size
        except FileNotFoundError:
            return 0

    def _dead(self) -> str | None:
        status = self.zygote.exited()
        if status is None:
            return None
        return f"trainer {self.name} ended (status {status}): {_tail(self.zygote.err)}"

    def start(self, ref: str, url: str, async_save: bool, context: str, *,
              remote_keep: tuple[int, int] = (3, 4), pause: float = 0.02) -> list[str]:
        """Fork a trainer (``remote_keep``: keep_last on the peer and the disk, 0 for every step;
        ``pause``: seconds between steps); return its ``start`` (or ``start-failed``) line."""
        self.launch(ref, url, async_save, context, remote_keep=remote_keep, pause=pause)
        return self.started()

    def launch(self, ref: str, url: str, async_save: bool, context: str, *,
               remote_keep: tuple[int, int] = (3, 4), pause: float = 0.02) -> None:
        assert self.pid is None
        self.context, self.async_save = context, async_save
        self.offset = self.size()
        self.pid = self.zygote.fork(dict(
            repo=str(self.ram), ref=ref, tid=self.tid, tiers=[url, str(self.disk)], token=TOKEN,
            async_save=async_save, log=str(self.log), remote_keep=list(remote_keep), pause=pause))

    def started(self) -> list[str]:
        """Wait for the trainer launched last to log ``start`` (or ``start-failed``: then reaped)."""
        first = _wait(f"trainer {self.name} to start",
                      lambda: next((p for p in self.lines() if p[0] in ("start", "start-failed")), None),
                      self.context, dead=self._dead)
        if first[0] == "start-failed":
            status = self.zygote.reap(TIMEOUT)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (self.context, status)
            self.pid = None
        return first

    def saves(self) -> list[int]:
        return [int(p[1]) for p in self.lines() if p[0] == "saved"]

    def wait_saves(self, more: int) -> None:
        """Until this run logged ``more`` further saves."""
        target = len(self.saves()) + more
        _wait(f"{more} more saves of trainer {self.name}", lambda: len(self.saves()) >= target,
              self.context, dead=self._dead)

    def wait_begin(self) -> None:
        """Until this run logs the start of a save (after now)."""
        mark = self.size()
        _wait(f"a save of trainer {self.name} to begin",
              lambda: any(p[0] == "begin" for p in self.lines(mark)), self.context, dead=self._dead)

    def kill(self) -> bool:
        """SIGKILL; True if it died inside a save (its last line a ``begin``)."""
        assert self.pid is not None
        os.kill(self.pid, signal.SIGKILL)
        status = self.zygote.reap(TIMEOUT)
        self.pid = None
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"{self.context}: trainer {self.name} ended by itself before the kill (status {status}): "
            f"{_tail(self.zygote.err)}")
        lines = self.lines()
        return bool(lines) and lines[-1][0] == "begin"

    def stop(self) -> list[list[str]]:
        """SIGUSR1: the loop ends, ``close()`` waits for every tier; this run's lines."""
        assert self.pid is not None
        os.kill(self.pid, signal.SIGUSR1)
        status = self.zygote.reap(TIMEOUT * 2)
        self.pid = None
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
            f"{self.context}: trainer {self.name} failed (status {status}): {_tail(self.zygote.err)}")
        return self.lines()

    def abandon(self) -> None:
        if self.pid is not None:
            with_suppressed(lambda: os.kill(self.pid, signal.SIGKILL))  # type: ignore[arg-type]
            with_suppressed(lambda: self.zygote.reap(30))
            self.pid = None


def with_suppressed(fn: Callable[[], Any]) -> None:
    with contextlib.suppress(OSError, AssertionError):
        fn()


def _free_port() -> int:
    """A free port below the ephemeral range (no client connection takes it while the peer is down)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    picker = random.SystemRandom()  # not the test's seed: two runs at once must not pick alike
    for _ in range(1000):
        port = picker.randrange(20000, max(low, 20001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below the ephemeral range")


class Peer:
    """``cas-ckpt serve REPO --write-token T --port P``, killed and restarted on the same port."""

    def __init__(self, repo: Path) -> None:
        self.repo = repo
        cas_ckpt.open(repo).close()
        self.port = _free_port()
        self.server: ServerProcess | None = None
        self.logs: list[str] = []
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> bool:
        """Start on the same port (True), or, if something else took it meanwhile, a new one."""
        assert self.server is None
        for attempt in range(6):
            try:
                self.server = ServerProcess(self.repo, "--write-token", TOKEN, "--port", str(self.port))
                return attempt < 3
            except RuntimeError as exc:
                if "in use" not in str(exc) and "Errno 98" not in str(exc):
                    raise
                if attempt >= 2:
                    self.port = _free_port()
        raise AssertionError("the peer could not be started")

    def kill(self) -> None:
        assert self.server is not None
        self.server.kill()
        self.logs.append(self.server.stderr())
        self.server = None

    def close(self) -> None:
        if self.server is not None:
            self.kill()

    def uploads(self) -> dict[str, int]:
        """Temp packs in the peer's ``tmp/`` (an upload being written, or a killed server's), by size."""
        found = {}
        try:
            with os.scandir(self.repo / "tmp") as entries:
                for entry in entries:
                    with contextlib.suppress(FileNotFoundError):
                        found[entry.name] = entry.stat().st_size
        except FileNotFoundError:
            pass
        return found

    def new_upload(self, before: dict[str, int], at_least: int = 0) -> bool:
        return any(name not in before and size >= at_least for name, size in self.uploads().items())


# ----------------------------------------------------------------------------------------------
# What the tiers hold
# ----------------------------------------------------------------------------------------------
class Ledger:
    """Reads every tier's repository; remembers the newest step of each trainer acknowledged."""

    def __init__(self) -> None:
        self.digests: dict[tuple[int, int], str] = {}
        self.loaded: dict[tuple[str, str], int] = {}  # (tier, CID) -> the trainer it loaded as
        self.floor: dict[tuple[str, int], tuple[int, str]] = {}  # (run, tid) -> (step, who acked it)
        self.figures = {"checks": 0, "refs_checked": 0, "loads": 0, "off_history": 0}

    def expected(self, tid: int, step: int) -> str:
        if (tid, step) not in self.digests:
            self.digests[(tid, step)] = digest(_state(tid, step))
        return self.digests[(tid, step)]

    def acknowledge(self, run: str, tid: int, step: int, why: str) -> None:
        if step > self.floor.get((run, tid), (-1, ""))[0]:
            self.floor[(run, tid)] = (step, why)

    def forget(self, run: str) -> None:
        self.floor = {k: v for k, v in self.floor.items() if k[0] != run}

    def hold(self, tiers: dict[str, Path], context: str, *,
             lineage: bool = False) -> dict[tuple[str, int], set[int]]:
        """fsck every tier; load every ref's checkpoint bit for bit; (run, trainer) -> the steps held.
        ``lineage``: every step ref must name a commit in its run's history there."""
        held: dict[tuple[str, int], set[int]] = {}
        for name, path in tiers.items():
            if not (path / "config.json").exists():
                continue
            with cas_ckpt.open(path, create=False, read_only=True) as repo:
                problems = fsck_problems(repo)
                assert not problems, f"{context}: fsck of the {name} tier ({path}): {problems}"
                histories: dict[str, set[str]] = {}
                for ref, cid in sorted(repo.refs().items()):
                    match = STEP_REF.match(ref)
                    run = match["run"] if match else ref
                    commit = repo.commit(cid)
                    step = int(match["step"]) if match else commit.step
                    assert step is not None and commit.step == step, (
                        f"{context}: {name} tier: {ref} holds {cid}, a commit of step {commit.step}")
                    key = (str(path), str(cid))
                    if key not in self.loaded:
                        got = digest(repo.load(cid))
                        self.figures["loads"] += 1
                        tids = [t for t in _tids(run) if self.expected(t, step) == got]
                        assert tids, (f"{context}: {name} tier: {ref} ({cid}) does not load bit for bit as "
                                      f"step {step} of trainer {_tids(run)}")
                        self.loaded[key] = tids[0]
                    tid = self.loaded[key]
                    held.setdefault((run, tid), set()).add(step)
                    self.figures["refs_checked"] += 1
                    if match:
                        if run not in histories:
                            known = run in repo.refs()
                            histories[run] = {str(c.cid) for c in repo.log(run)} if known else set()
                        if str(cid) not in histories[run]:
                            self.figures["off_history"] += 1
                            assert not lineage, (f"{context}: {name} tier: step ref {ref} holds {cid}, not "
                                                 f"in the history of {run}")
        return held

    def check(self, tiers: dict[str, Path], context: str, *, lineage: bool = False,
              every: dict[tuple[str, int], list[int]] | None = None) -> dict[tuple[str, int], set[int]]:
        """:meth:`hold`, then: each trainer's newest acknowledged step is still held somewhere (a
        newer one may stand for it), and so is each step of ``every`` ((run, trainer) -> steps)."""
        held = self.hold(tiers, context, lineage=lineage)
        self.figures["checks"] += 1
        for (run, tid), (step, why) in sorted(self.floor.items()):
            assert max(held.get((run, tid), {-1})) >= step, (
                f"{context}: step {step} of trainer {tid} in {run} ({why}) is held by no tier now: "
                f"held {sorted(held.get((run, tid), ()))}")
        for (run, tid), steps in sorted((every or {}).items()):
            lost = sorted(set(steps) - held.get((run, tid), set()))
            assert not lost, (f"{context}: steps {lost} of trainer {tid} in {run}, replicated to every tier "
                              f"(close() returned; the peer keeps every step), are held by no tier now: "
                              f"held {sorted(held.get((run, tid), ()))}")
        for (run, tid), steps in held.items():
            self.acknowledge(run, tid, max(steps), "held by a tier at an earlier check")
        return held


def _heads(tiers: dict[str, Path], ref: str) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for name, path in tiers.items():
        if not (path / "config.json").exists():
            out[name] = None
            continue
        with cas_ckpt.open(path, create=False, read_only=True) as repo:
            cid = repo.refs_store.get(ref)
            out[name] = None if cid is None else repo.commit(cid).step
    return out


def _acknowledged_by_run(lines: list[list[str]], async_save: bool) -> int | None:
    """The newest step this run's own log proves durable: a synchronous save that returned, or
    every save once ``close()`` returned."""
    saved = [int(p[1]) for p in lines if p[0] == "saved"]
    if not saved:
        return None
    if any(p[0] == "closed" for p in lines) or not async_save:
        return saved[-1]
    return None


# ----------------------------------------------------------------------------------------------
# One trainer, a peer, a disk, side pushes
# ----------------------------------------------------------------------------------------------
def test_trainer_peer_and_pushes_killed_at_random_moments(tmp_path: Path) -> None:
    """A trainer (RAM -> [peer, disk]) killed mid-save and mid-push (a third of those kills also
    wipe its RAM tier: a rebooted host), the peer killed mid-upload and brought back on its port
    while the trainer saves on, and ``cas-ckpt push`` processes to the same peer killed mid-upload."""
    rng = random.Random(SEED)
    timer = Timer()
    figures = {k: 0 for k in (
        "trainer_kills", "trainer_kills_mid_save", "trainer_kills_async", "ram_wipes",
        "restored_from_peer", "restored_from_disk", "peer_kills", "peer_kills_upload_in_flight",
        "saves_while_peer_down", "push_kills", "push_kills_ref_moved", "pushes_finished_before_kill",
        "port_changes", "steps_saved")}
    kinds = ["trainer", "peer", "push"] * ROUNDS_PER_KIND
    rng.shuffle(kinds)
    ledger = Ledger()
    with scratch_dir(tmp_path) as fast:
        ram, side_dir = fast / "ram", fast / "side"
        disk, peer_dir = tmp_path / "disk", tmp_path / "peer"
        tiers = {"ram": ram, "peer": peer_dir, "disk": disk, "side": side_dir}
        peer = Peer(peer_dir)
        zygote = Zygote(tmp_path / "trainer.err")
        trainer = Trainer("t", TRAINER_TID, zygote, ram, disk, tmp_path / "trainer.log")
        side = cas_ckpt.open(side_dir)
        side_step = 0
        try:
            for i, kind in enumerate(kinds):
                context = f"seed {SEED}, round {i} ({kind} kill)"
                first = trainer.start("run", peer.url, rng.random() < 0.5, context)
                assert first[0] == "start", f"{context}: {first}"
                trainer.wait_saves(1)
                if kind == "trainer":
                    trainer.wait_begin()
                    time.sleep(rng.uniform(0.0, 0.01 if rng.random() < 0.5 else 0.3))
                    figures["trainer_kills_async"] += trainer.async_save
                    figures["trainer_kills_mid_save"] += trainer.kill()
                    figures["trainer_kills"] += 1
                    if not trainer.async_save:
                        found = _acknowledged_by_run(trainer.lines(), False)
                        if found is not None:
                            ledger.acknowledge("run", TRAINER_TID, found, "a synchronous save returned")
                    if figures["trainer_kills"] % 3 == 0:  # the host rebooted: its RAM tier is gone
                        figures["ram_wipes"] += 1
                        surviving = {"peer": peer_dir, "disk": disk}
                        held = ledger.hold(surviving, context)
                        heads = _heads(surviving, "run")
                        newest = max((s for s in heads.values() if s is not None), default=None)
                        ledger.forget("run")
                        if ("run", TRAINER_TID) in held:
                            ledger.acknowledge("run", TRAINER_TID, max(held[("run", TRAINER_TID)]),
                                               "held by the peer or the disk when the RAM tier was wiped")
                        shutil.rmtree(ram)
                        again = trainer.start("run", peer.url, rng.random() < 0.5,
                                              context + " after the wipe")
                        assert again[0] == "start", f"{context}: {again}"
                        latest = None if again[4] == "-" else int(again[4])
                        where = {peer.url: "peer", str(disk): "disk"}.get(again[2], again[2])
                        # Newer only if the peer applied a ref move the dead trainer had sent
                        # before the kill, after the heads were read: then from the peer.
                        later = (latest or -1) > (newest or -1) and where == "peer"
                        assert latest == newest or later, (
                            f"{context}: after the RAM tier was wiped the trainer resumed at {latest} "
                            f"from {where}; the tiers' newest was {newest} {heads}")
                        if latest == newest and newest is not None:
                            first_holder = next(n for n in ("peer", "disk") if heads[n] == newest)
                            assert where == first_holder, (
                                f"{context}: restored from {where}, not {first_holder}")
                        if latest is not None:
                            figures[f"restored_from_{where}"] += 1
                    else:
                        again = trainer.start("run", peer.url, rng.random() < 0.5,
                                              context + " after the kill")
                        assert again[0] == "start", f"{context}: {again}"
                    trainer.wait_saves(1)
                elif kind == "peer":
                    before = peer.uploads()
                    _wait("an upload to the peer", lambda before=before: peer.new_upload(before), context,
                          dead=trainer._dead)
                    time.sleep(rng.uniform(0.0, 0.04))
                    figures["peer_kills_upload_in_flight"] += peer.new_upload(before)
                    peer.kill()
                    figures["peer_kills"] += 1
                    trainer.wait_saves(2)  # the loop goes on while a tier is down
                    figures["saves_while_peer_down"] += 2
                    if not peer.start():  # the port was taken meanwhile: the trainer must move
                        figures["port_changes"] += 1
                        trainer.kill()
                        trainer.start("run", peer.url, rng.random() < 0.5, context + " on a new port")
                    trainer.wait_saves(1)
                else:
                    side_step = _kill_a_push(side, side_dir, side_step, peer, rng, ledger, figures, context)
                lines = trainer.stop()
                figures["steps_saved"] += sum(1 for p in lines if p[0] == "saved")
                assert any(p[0] == "closed" for p in lines), (
                    f"{context}: close() failed: {[p for p in lines if p[0] == 'close-failed']}\n"
                    f"{_tail(zygote.err)}")
                last = max(trainer.saves())
                ledger.acknowledge("run", TRAINER_TID, last, "replicated by close()")
                lags = [p for p in lines if p[0] == "lag"]
                assert len(lags) == 2 and all(p[2] == str(last) and p[3] == "0" for p in lags), (
                    f"{context}: close() returned with tiers behind step {last}: {lags}")
                ledger.check(tiers, context, lineage=True)
                heads = _heads({"ram": ram, "peer": peer_dir, "disk": disk}, "run")
                assert set(heads.values()) == {last}, f"{context}: heads {heads}, last saved {last}"
                if kind == "push":  # what old side checkpoints and killed uploads left: collected
                    with cas_ckpt.open(peer_dir, create=False) as there:
                        there.gc(expire_reflogs=["side"])
                    side.gc(reflog_expiry=0)
            # Whatever the killed servers left in the peer's tmp/ goes at its next GC.
            with cas_ckpt.open(peer_dir, create=False) as there:
                there.gc(expire_reflogs=["side"])
            assert not leftovers(peer_dir)["temp_packs"], leftovers(peer_dir)
            ledger.check(tiers, f"seed {SEED}, after the last GC", lineage=True)
        finally:
            trainer.abandon()
            zygote.close()
            peer.close()
            side.close()
    assert figures["trainer_kills"] + figures["peer_kills"] + figures["push_kills"] == 3 * ROUNDS_PER_KIND
    if LONG:  # enough kills that some must land inside a save and inside an upload
        assert figures["trainer_kills_mid_save"] >= 1 and figures["peer_kills_upload_in_flight"] >= 1, figures
    record("tier_kills", seconds=timer.seconds, **figures, **ledger.figures)


def _kill_a_push(side: cas_ckpt.Repository, side_dir: Path, side_step: int, peer: Peer, rng: random.Random,
                 ledger: Ledger, figures: dict[str, int], context: str) -> int:
    """Save a new ``side`` checkpoint and push it with ``cas-ckpt push``, SIGKILLed at a random
    moment once its upload is past 4.5 MiB; again (a new checkpoint) while the push finishes first."""
    env = {**os.environ, "CAS_CKPT_TOKEN": TOKEN}
    for _ in range(8):
        side_step += 1
        side.save(_state(SIDE_TID, side_step), ref="side", step=side_step)
        before = peer.uploads()
        push = subprocess.Popen([CLI, "--repo", str(side_dir), "push", peer.url, "side"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            def begun(push: subprocess.Popen[str] = push, before: dict[str, int] = before) -> bool:
                return push.poll() is not None or peer.new_upload(before, 9 * MiB // 2)

            _wait("the push's upload", begun, context)
            time.sleep(rng.uniform(0.0, 0.25))  # inside the upload, or at the ref's move, or after
            if push.poll() is None:
                push.send_signal(signal.SIGKILL)
            _, err = push.communicate(timeout=TIMEOUT)
        finally:
            if push.poll() is None:
                push.kill()
                push.communicate()
        if push.returncode == -signal.SIGKILL:
            figures["push_kills"] += 1
            with cas_ckpt.open(peer.repo, create=False, read_only=True) as there:
                held = there.refs_store.get("side")
                figures["push_kills_ref_moved"] += held is not None and there.commit(held).step == side_step
            return side_step
        assert push.returncode == 0, f"{context}: cas-ckpt push failed ({push.returncode}): {err}"
        figures["pushes_finished_before_kill"] += 1
        ledger.acknowledge("side", SIDE_TID, side_step, "a finished cas-ckpt push")
    raise AssertionError(f"{context}: 8 pushes in a row finished before their kill")


# ----------------------------------------------------------------------------------------------
# Two trainers, one ref, one peer
# ----------------------------------------------------------------------------------------------
def test_two_trainers_pushing_one_ref_to_one_peer(tmp_path: Path) -> None:
    """Two trainers, each with its own RAM repository and disk, run ``duel/N`` (the same ref) and
    replicate it to one peer, which keeps every step; one of them, or the peer, is killed at a
    random moment and brought back. Their leases are local, so both run; the peer's ref moves by
    compare-and-swap, so one wins and the other's pushes fail (``RefConflict``, logged; its next
    manager refuses to start with ``RefDiverged``). Each tier holds only complete checkpoints of one
    trainer or the other, and every step of a trainer whose ``close()`` returned (replicated to
    every tier, and the peer keeps every step) is still held by some tier."""
    rng = random.Random(SEED + 1)
    timer = Timer()
    figures = {k: 0 for k in (
        "cases", "kills_trainer", "kills_peer", "peer_kills_upload_in_flight", "trainer_kills_mid_save",
        "restarts_refused", "cases_with_conflict_logged", "close_failed", "peer_head_of_first_started",
        "peer_head_of_second_started", "peer_ref_moved_by_both", "steps_saved")}
    ledger = Ledger()
    with scratch_dir(tmp_path) as fast:
        peer = Peer(tmp_path / "peer")
        zygotes = {n: Zygote(tmp_path / f"trainer-{n}.err") for n in "ab"}
        trainers: dict[str, Trainer] = {}
        try:
            for case in range(DUEL_CASES):
                ref = f"duel/{case}"
                context = f"seed {SEED + 1}, case {case}"
                trainers = {n: Trainer(n, tid, zygotes[n], fast / f"ram-{n}-{case}",
                                       tmp_path / f"disk-{n}-{case}", tmp_path / f"{n}.log")
                            for n, tid in zip("ab", DUEL_TIDS, strict=True)}
                err_marks = {n: z.err.stat().st_size for n, z in zygotes.items()}
                order = rng.sample("ab", 2)
                options = {"remote_keep": (0, 4), "pause": 0.1}  # the peer keeps every step
                for n in order:  # both at once: they race for the first push
                    trainers[n].launch(ref, peer.url, rng.random() < 0.5, context, **options)
                for n in order:
                    assert trainers[n].started()[0] == "start", context
                for t in trainers.values():
                    t.wait_saves(1)
                target = "abp"[case % 3]
                if target == "p":
                    before = peer.uploads()
                    _wait("an upload to the peer", lambda before=before: peer.new_upload(before), context)
                    time.sleep(rng.uniform(0.0, 0.04))
                    figures["peer_kills_upload_in_flight"] += peer.new_upload(before)
                    peer.kill()
                    figures["kills_peer"] += 1
                    for t in trainers.values():
                        t.wait_saves(1)
                    peer.start()
                else:
                    victim = trainers[target]
                    victim.wait_begin()
                    time.sleep(rng.uniform(0.0, 0.01 if rng.random() < 0.5 else 0.3))
                    figures["trainer_kills_mid_save"] += victim.kill()
                    figures["kills_trainer"] += 1
                    figures["steps_saved"] += len(victim.saves())
                    if not victim.async_save:
                        found = _acknowledged_by_run(victim.lines(), False)
                        if found is not None:
                            ledger.acknowledge(ref, victim.tid, found, "a synchronous save returned")
                    again = victim.start(ref, peer.url, rng.random() < 0.5, context + " after the kill",
                                         **options)
                    if again[0] == "start-failed":  # a diverged run on the peer: refused, not merged
                        assert "RefDiverged" in again[2] or "RefConflict" in again[2], again
                        figures["restarts_refused"] += 1
                for t in trainers.values():
                    if t.running:
                        t.wait_saves(1)
                every: dict[tuple[str, int], list[int]] = {}
                for t in trainers.values():
                    if t.running:
                        lines = t.stop()
                        figures["steps_saved"] += len(t.saves())
                        found = _acknowledged_by_run(lines, t.async_save)
                        if found is not None:
                            ledger.acknowledge(ref, t.tid, found,
                                               "saved, and close() returned or a sync save")
                        failed = [p for p in lines if p[0] == "close-failed"]
                        figures["close_failed"] += bool(failed)
                        assert all(CONFLICT.search(" ".join(p)) for p in failed), f"{context}: {failed}"
                        if not failed:  # every step it saved reached every tier
                            every[(ref, t.tid)] = t.saves()
                conflicts = sum(len(CONFLICT.findall(_since(z.err, err_marks[n])))
                                for n, z in zygotes.items())
                figures["cases_with_conflict_logged"] += conflicts > 0
                tiers = {"peer": peer.repo}
                for n, t in trainers.items():
                    tiers[f"ram-{n}"], tiers[f"disk-{n}"] = t.ram, t.disk
                ledger.check(tiers, context, every=every)
                with cas_ckpt.open(peer.repo, create=False) as there:
                    head = there.refs_store.get(ref)
                    assert head is not None, f"{context}: the peer never got {ref}"
                    tid = ledger.loaded[(str(peer.repo), str(cas_ckpt.cid.to_cid(head)))]
                    first = trainers[order[0]].tid
                    won = "first" if tid == first else "second"
                    figures[f"peer_head_of_{won}_started"] += 1
                    movers = {e.message.split("replicate from ")[-1].split(" (pushed")[0]
                              for e in there.reflog(ref) if e.new}
                    figures["peer_ref_moved_by_both"] += len(movers) > 1
                    # The case is over: its refs go, and GC takes what they held.
                    for name in list(there.refs(ref)):
                        if name == ref or name.startswith(ref + ".steps/"):
                            there.delete_ref(name)
                    there.gc(expire_reflogs=[ref, ref + ".steps/"])
                ledger.forget(ref)
                for t in trainers.values():
                    shutil.rmtree(t.ram, ignore_errors=True)
                    shutil.rmtree(t.disk, ignore_errors=True)
                figures["cases"] += 1
        finally:
            for t in trainers.values():
                t.abandon()
            for z in zygotes.values():
                z.close()
            peer.close()
    assert figures["kills_trainer"] + figures["kills_peer"] == DUEL_CASES
    assert figures["cases_with_conflict_logged"] >= 1, figures  # the loser's failures are logged
    record("tier_kills_two_trainers", seconds=timer.seconds, **figures, **ledger.figures)


# ----------------------------------------------------------------------------------------------
# The moment the random kills found: the peer moved the ref, and died before answering
# ----------------------------------------------------------------------------------------------
def test_a_lost_answer_to_a_ref_move_does_not_stall_the_tier(tmp_path: Path) -> None:
    """Seed 20261206 (round 4, a peer kill) found it: the peer was killed after it moved the run's
    ref to step 27 and before it answered; the trainer saved step 28 before its next attempt, which
    then expected the ref at step 26 (the last answer it got) and was refused with ``RefConflict``,
    as was every later attempt: the tier never caught up, RAM kept every later step, and
    ``close()`` raised ``ReplicationFailed``. Here the answer is lost on purpose (the move reaches
    a real ``cas-ckpt serve``; the client then sees a reset), and step 2 is saved before the
    retry."""
    from cas_ckpt.backends.http import HttpRemote
    from cas_ckpt.errors import RemoteError

    real = HttpRemote.post_json
    moved, go_on = threading.Event(), threading.Event()

    def answer_lost(self: Any, path: str, payload: Any, **kw: Any) -> Any:
        answer = real(self, path, payload, **kw)  # the server moves the ref...
        if path == "/api/v0/refs/run" and payload.get("new") and not moved.is_set():
            moved.set()
            go_on.wait(TIMEOUT)
            raise RemoteError(self.url + path, "connection reset by peer")  # ...its answer is lost
        return answer

    peer = Peer(tmp_path / "peer")
    manager = None
    try:
        manager = cas_ckpt.CheckpointManager(tmp_path / "ram", "run", replicate_to=[peer.url],
                                             remote_storage_options=[{"token": TOKEN}])
        manager.save(0, _state(TRAINER_TID, 0))
        manager.wait()
        HttpRemote.post_json = answer_lost  # type: ignore[method-assign]
        try:
            manager.save(1, _state(TRAINER_TID, 1))
            assert moved.wait(TIMEOUT)
            manager.save(2, _state(TRAINER_TID, 2))  # before the replicator's next attempt
        finally:
            go_on.set()
            HttpRemote.post_json = real  # type: ignore[method-assign]
        manager.wait()  # ReplicationFailed (RefConflict) here: the tier is stuck for good
        lag = manager.replication_lag[0]  # type: ignore[index]
        assert (lag.replicated_step, lag.steps) == (2, 0)
        with cas_ckpt.open(peer.repo, create=False, read_only=True) as there:
            assert there.commit("run").step == 2
        manager.close()
    finally:
        go_on.set()
        if manager is not None and not manager._closed:
            with_suppressed_cas(manager.close)
        peer.close()


def test_a_refused_push_moves_no_step_ref_of_the_other_trainer(tmp_path: Path) -> None:
    """Seed 20261207 (case 1) found it: two managers on one run (separate RAM repositories, one
    peer keeping every step). The second's push of the run's ref is refused (``RefConflict``), but
    the step refs, moved first and forced, already replaced the first trainer's steps 0 and 1 on
    the peer with its own: those steps, acknowledged by the peer and expired from the first
    trainer's RAM (``keep_last=1``), were then held by no tier."""
    peer = Peer(tmp_path / "peer")
    managers: list[cas_ckpt.CheckpointManager] = []
    try:
        for name in ("a", "b"):
            managers.append(cas_ckpt.CheckpointManager(
                tmp_path / name, "duel/x", keep_last=1, replicate_to=[peer.url], remote_retention={},
                remote_storage_options=[{"token": TOKEN}]))
        a, b = managers
        for step in range(3):
            a.save(step, _state(DUEL_TIDS[0], step))
        a.wait()
        b.save(0, _state(DUEL_TIDS[1], 0))
        b.save(1, _state(DUEL_TIDS[1], 1))
        with pytest.raises(cas_ckpt.errors.ReplicationFailed):  # the run is a's on the peer
            b.wait()
        ledger = Ledger()
        held = ledger.hold({"peer": peer.repo, "ram-a": tmp_path / "a"}, f"seed {SEED + 1}")
        assert held[("duel/x", DUEL_TIDS[0])] == {0, 1, 2}, held  # every step the peer acknowledged
    finally:
        for manager in managers:
            with_suppressed_cas(manager.close)
        peer.close()


def with_suppressed_cas(fn: Callable[[], Any]) -> None:
    with contextlib.suppress(cas_ckpt.CasCkptError):
        fn()


def _since(path: Path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")
