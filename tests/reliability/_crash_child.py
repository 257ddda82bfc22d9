"""Child of test_crash_points: crash the commit protocol at every filesystem step, and cut the power.

Usage: ``_crash_child.py WORKDIR PACK_SIZE SCENARIO...``; prints one JSON object (points, images, failures).
Real fsyncs are skipped in this process: durability is modelled (below), not left to the disk.

For each scenario this process builds a baseline repository, then for N = 1, 2, ... forks a child
that patches the ``os`` functions that change the disk (open with O_CREAT, write, fsync, link,
rename, replace, unlink, mkdir, rmdir, ftruncate) and runs the scenario's protocol; the Nth such
call inside the repository does not happen: the child "crashes" there. Until the protocol
completes without reaching N, which is the last point (a crash right after the call returned).

At each point the child writes up to four disk images (duplicates dropped):

* ``kill``: the disk as it is (the process died, the kernel kept everything);
* ``power``: what a power cut leaves when nothing that was not made durable survives: file data past
  the size at the file's last fsync is lost, and each directory holds the entries it had at its last
  fsync (an entry created, linked, renamed or removed since is undone);
* ``power-names``: entries kept, unsynced data lost (metadata journaled ahead of data);
* ``power-data``: data kept, unsynced entries undone.

This process then checks each image: the repository opens, each ref holds its old checkpoint or the
new one (complete, bit for bit), fsck is clean, and a later save and GC work and leave no temp packs
or locks. At the last point the new state must be in every image: a save that returned is durable.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _support

import cas_ckpt

PACK_SIZE = 384 * 1024  # small packs: a save rolls over several of them (argv can change it)
CRASH_EXIT = 77
DONE_EXIT = 0

_REAL = {
    name: getattr(os, name)
    for name in (
        "open",
        "write",
        "fsync",
        "link",
        "rename",
        "replace",
        "unlink",
        "remove",
        "mkdir",
        "rmdir",
        "ftruncate",
        "truncate",
    )
}


def open_repo(root: Path, *, create: bool = False) -> cas_ckpt.Repository:
    """The repository with small packs (cas_ckpt.open with a pack size)."""
    if create:
        cas_ckpt.open(root).close()
    refs = cas_ckpt.refs.LocalRefStore(root)
    store = cas_ckpt.blocks.LocalStore(root, pack_size=PACK_SIZE)
    return cas_ckpt.Repository(store, refs, create=False, location=str(root))


# ----------------------------------------------------------------------------------------------
# Scenarios
# ----------------------------------------------------------------------------------------------
@dataclass
class Scenario:
    """``setup`` builds the baseline; ``run`` is the protocol under test.

    ``expect`` maps each ref to (old value, new value): a value is None (no ref) or
    (digest, parent) for a checkpoint; ``old`` values get their CID filled in by ``setup``.
    """

    name: str
    setup: Callable[[Path], dict[str, Any]]
    run: Callable[[Path], None]
    fresh: bool = False  # the baseline has no repository yet


def _state(tag: str, i: int) -> dict[str, Any]:
    return _support.make_state(11, i, scale=0.25) | {"tag": tag}


def _setup_one(root: Path) -> dict[str, Any]:
    with open_repo(root, create=True) as repo:
        cid = repo.save(_state("a", 0), ref="main")
    return {"main": (str(cid), _support.digest(_state("a", 0)))}


def _setup_two(root: Path) -> dict[str, Any]:
    with open_repo(root, create=True) as repo:
        repo.save(_state("a", 3), ref="main")
        cid = repo.save(_state("a", 0), ref="main")
    return {"main": (str(cid), _support.digest(_state("a", 0)))}


def _run_save(root: Path) -> None:
    with open_repo(root) as repo:
        repo.save(_state("b", 1), ref="main")


def _run_new_ref(root: Path) -> None:
    with open_repo(root) as repo:
        repo.save(_state("c", 2), ref="runs/x/y")


def _run_init(root: Path) -> None:
    with cas_ckpt.open(root) as repo:
        repo.save(_state("a", 0), ref="main")


def _setup_gc(root: Path) -> dict[str, Any]:
    with open_repo(root, create=True) as repo:
        for i in range(3):
            repo.save(_state("g", i), ref="main")  # the first two become garbage
        repo.save(_state("k", 5), ref="keep")
        kept = {ref: (str(repo.resolve(ref)), _support.digest(repo.load(ref))) for ref in ("main", "keep")}
    # a temp pack left by a writer that died (no lock held): GC's clean_temp removes it
    (root / "tmp" / "0123456789abcdef0123456789abcdef.pack.tmp").write_bytes(b"CASPACK1 partial")
    return kept


def _run_gc(root: Path) -> None:
    with open_repo(root) as repo:
        repo.gc(reflog_expiry=0)  # main's first two checkpoints are swept


def _run_refops(root: Path) -> None:
    with open_repo(root) as repo:
        repo.set_ref("other/tag", "main")
        repo.delete_ref("main", expected=repo.resolve("main"))


SCENARIOS = {
    "init": Scenario("init", lambda root: {}, _run_init, fresh=True),
    "save": Scenario("save", _setup_one, _run_save),
    "new-ref": Scenario("new-ref", _setup_one, _run_new_ref),
    "gc": Scenario("gc", _setup_gc, _run_gc),
    "refops": Scenario("refops", _setup_two, _run_refops),
}


def allowed(scenario: str, base: dict[str, Any]) -> dict[str, tuple[list[Any], list[Any]]]:
    """ref -> (states allowed at a crash point, states allowed once the protocol returned).

    A state is None (no ref), ("cid", CID) or ("new", digest, parent CID or None).
    """
    if scenario == "init":
        new = ("new", _support.digest(_state("a", 0)), None)
        return {"main": ([None, new], [new])}
    main = ("cid", *base["main"])
    if scenario == "save":
        new = ("new", _support.digest(_state("b", 1)), base["main"][0])
        return {"main": ([main, new], [new])}
    if scenario == "new-ref":
        new = ("new", _support.digest(_state("c", 2)), None)
        return {"main": ([main], [main]), "runs/x/y": ([None, new], [new])}
    if scenario == "gc":
        keep = ("cid", *base["keep"])
        return {"main": ([main], [main]), "keep": ([keep], [keep])}
    if scenario == "refops":
        return {"main": ([main, None], [None]), "other/tag": ([None, main], [main])}
    raise KeyError(scenario)


# ----------------------------------------------------------------------------------------------
# The injection layer (in the forked child only)
# ----------------------------------------------------------------------------------------------
class Crash(Exception):
    pass


def _listing(path: str) -> dict[str, tuple[int, bool]]:
    out = {}
    for entry in os.scandir(path):
        st = entry.stat(follow_symlinks=False)
        out[entry.name] = (st.st_ino, stat.S_ISDIR(st.st_mode))
    return out


class Injector:
    """Counts the calls that change the disk below ``top``; the ``crash_at``-th one never happens."""

    def __init__(self, top: Path, graveyard: Path, images: Path, crash_at: int) -> None:
        self.top = os.path.realpath(top)
        self.graveyard = graveyard
        self.images = images
        self.crash_at = crash_at
        self.count = 0
        self.active = True
        self.durable_size: dict[int, int] = {}
        self.durable_ns: dict[str, dict[str, tuple[int, bool]]] = {}
        for dirpath, _dirs, files in os.walk(self.top):
            self.durable_ns[dirpath] = _listing(dirpath)
            for f in files:
                st = os.lstat(os.path.join(dirpath, f))
                self.durable_size[st.st_ino] = st.st_size

    # -- bookkeeping ---------------------------------------------------------------------------
    def inside(self, path: Any) -> bool:
        if isinstance(path, int):
            try:
                path = _REAL_READLINK(f"/proc/self/fd/{path}").removesuffix(" (deleted)")
            except OSError:
                return False
        path = os.path.abspath(os.fsdecode(path))
        return path == self.top or path.startswith(self.top + os.sep)

    def step(self, kind: str, target: Any) -> None:
        if not self.active or not self.inside(target):
            return
        self.count += 1
        if self.count == self.crash_at:
            self.active = False
            self.write_images(f"{kind} {self.describe(target)}")
            os._exit(CRASH_EXIT)

    def describe(self, target: Any) -> str:
        if isinstance(target, int):
            target = _REAL_READLINK(f"/proc/self/fd/{target}").removesuffix(" (deleted)")
        return os.path.relpath(os.fsdecode(target), self.top)

    def bury(self, path: Any) -> None:
        """Keep an inode's bytes (for images where its removal is undone)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISREG(st.st_mode):
            grave = self.graveyard / str(st.st_ino)
            if not grave.exists():
                _REAL["link"](path, grave)

    # -- wrappers ------------------------------------------------------------------------------
    def install(self) -> None:
        inj = self

        def open_(path: Any, flags: int, mode: int = 0o777, *, dir_fd: Any = None) -> int:
            if flags & os.O_TRUNC or (flags & os.O_CREAT and not os.path.lexists(path)):
                inj.step("create", path)
            return _REAL["open"](path, flags, mode, dir_fd=dir_fd)

        def write(fd: int, data: Any) -> int:
            inj.step("write", fd)
            return _REAL["write"](fd, data)

        def fsync(fd: int) -> None:
            inj.step("fsync", fd)
            # No real fsync: what is durable is modelled here, and that is all the images use.
            if inj.active and inj.inside(fd):
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    path = _REAL_READLINK(f"/proc/self/fd/{fd}")
                    inj.durable_ns[path] = _listing(path)
                else:
                    inj.durable_size[st.st_ino] = st.st_size

        def link(src: Any, dst: Any, **kw: Any) -> None:
            inj.step("link", dst)
            _REAL["link"](src, dst, **kw)

        def make_rename(name: str) -> Callable[..., None]:
            def rename(src: Any, dst: Any, **kw: Any) -> None:
                inj.step(name, dst)
                if inj.active and inj.inside(dst):
                    inj.bury(dst)
                _REAL[name](src, dst, **kw)

            return rename

        def make_unlink(name: str) -> Callable[..., None]:
            def unlink(path: Any, **kw: Any) -> None:
                inj.step("unlink", path)
                if inj.active and inj.inside(path):
                    inj.bury(path)
                _REAL[name](path, **kw)

            return unlink

        def mkdir(path: Any, mode: int = 0o777, **kw: Any) -> None:
            if not os.path.lexists(path):  # mkdir(exist_ok=True) on an existing one changes nothing
                inj.step("mkdir", path)
            _REAL["mkdir"](path, mode, **kw)

        def rmdir(path: Any, **kw: Any) -> None:
            inj.step("rmdir", path)
            _REAL["rmdir"](path, **kw)

        def ftruncate(fd: int, length: int) -> None:
            inj.step("ftruncate", fd)
            _REAL["ftruncate"](fd, length)

        def truncate(path: Any, length: int) -> None:
            inj.step("truncate", path)
            _REAL["truncate"](path, length)

        os.open = open_
        os.write = write
        os.fsync = fsync
        os.link = link
        os.rename = make_rename("rename")
        os.replace = make_rename("replace")
        os.unlink = make_unlink("unlink")
        os.remove = make_unlink("remove")
        os.mkdir = mkdir
        os.rmdir = rmdir
        os.ftruncate = ftruncate
        os.truncate = truncate

    def uninstall(self) -> None:
        for name, fn in _REAL.items():
            setattr(os, name, fn)

    # -- images --------------------------------------------------------------------------------
    def write_images(self, label: str) -> None:
        self.uninstall()
        sources: dict[int, str] = {}
        for dirpath, _dirs, files in os.walk(self.top):
            for f in files:
                path = os.path.join(dirpath, f)
                sources.setdefault(os.lstat(path).st_ino, path)
        for grave in self.graveyard.iterdir():
            sources.setdefault(int(grave.name), str(grave))
        seen: dict[str, str] = {}
        for mode, (data_synced, names_synced) in {
            "kill": (False, False),
            "power": (True, True),
            "power-names": (True, False),
            "power-data": (False, True),
        }.items():
            out = self.images / mode
            self._copy(self.top, out, sources, data_synced, names_synced)
            sig = _signature(out)
            if sig in seen:
                shutil.rmtree(out)
                continue
            seen[sig] = mode
            if mode != "kill":
                _age(out, 60.0)  # the power came back a while later: files look old
        (self.images / "label").write_text(label)

    def _copy(
        self, src: str, dst: Path, sources: dict[int, str], data_synced: bool, names_synced: bool
    ) -> None:
        dst.mkdir(parents=True)
        if names_synced:
            entries = self.durable_ns.get(src, {})
        else:
            entries = _listing(src) if os.path.isdir(src) else {}
        for name, (ino, is_dir) in sorted(entries.items()):
            child = os.path.join(src, name)
            if is_dir:
                self._copy(child, dst / name, sources, data_synced, names_synced)
                continue
            size = self.durable_size.get(ino, 0) if data_synced else None
            origin = sources.get(ino)
            data = b""
            if origin is not None:
                with open(origin, "rb") as f:
                    data = f.read() if size is None else f.read(size)
            (dst / name).write_bytes(data)


_REAL_READLINK = os.readlink


def _age(root: Path, seconds: float) -> None:
    then = time.time() - seconds
    for path in root.rglob("*"):
        os.utime(path, (then, then), follow_symlinks=False)


def _signature(root: Path) -> str:
    parts = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_dir():
            parts.append(f"{rel}/")
        else:
            parts.append(f"{rel}:{zlib.crc32(path.read_bytes())}")
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------
# Checking an image
# ----------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    points: int = 0
    images: int = 0
    later_saves: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    states: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def check_image(image: Path, scenario: str, base: dict[str, Any], done: bool, outcome: Outcome) -> None:
    root = image / "repo"
    rules = allowed(scenario, base)
    if scenario == "init" and not (root / "config.json").exists():
        # Interrupted before the repository existed: opening must create it afresh.
        for ref, (at_crash, _) in rules.items():
            if None not in at_crash or done:
                raise AssertionError(f"{ref}: the repository is gone")
        with cas_ckpt.open(root) as repo:
            repo.save(_support.small_state("init"), ref="main")
        outcome.states["init:recreated"] = outcome.states.get("init:recreated", 0) + 1
        outcome.later_saves += 1
        return
    with cas_ckpt.open(root, create=False) as repo:
        refs = {name: str(cid) for name, cid in repo.refs().items()}
        extra = set(refs) - set(rules)
        assert not extra, f"unexpected refs {extra}"
        for ref, (at_crash, at_done) in rules.items():
            options = at_done if done else at_crash
            value = refs.get(ref)
            state = _classify(repo, ref, value, options)
            key = f"{scenario}:{ref}:{state}"
            outcome.states[key] = outcome.states.get(key, 0) + 1
        problems = _support.fsck_problems(repo)
        assert not problems, f"fsck: {problems}"
        # A later save works (stale locks are broken), and GC clears every leftover.
        for n, ref in enumerate(sorted(rules)):
            cid = repo.save(_support.small_state(ref, n), ref=ref)
            assert _support.digest(repo.load(cid)) == _support.digest(_support.small_state(ref, n))
            outcome.later_saves += 1
        repo.gc()
        problems = _support.fsck_problems(repo)
        assert not problems, f"fsck after a later save and GC: {problems}"
    found = _support.leftovers(root)
    assert not found["temp_packs"] and not found["locks"], f"leftovers after GC: {found}"


def _classify(repo: cas_ckpt.Repository, ref: str, value: str | None, options: list[Any]) -> str:
    if value is None:
        assert None in options, f"{ref} is missing; allowed: {options}"
        return "absent"
    for option in options:
        if option is None:
            continue
        if option[0] == "cid" and value == option[1]:
            got = _support.digest(repo.load(ref))
            assert got == option[2], f"{ref}: the old checkpoint {value} no longer loads bit-exact"
            return "old"
    for option in options:
        if option is None or option[0] != "new":
            continue
        parents = [str(p) for p in repo.commit(value).parents]
        if parents == ([option[2]] if option[2] else []):
            got = _support.digest(repo.load(ref))
            assert got == option[1], f"{ref}: {value} does not load as the state that was saved"
            return "new"
    raise AssertionError(f"{ref} holds {value}, which is none of {options}")


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------
def run_scenario(work: Path, name: str, outcome: Outcome, max_points: int) -> None:
    scenario = SCENARIOS[name]
    base_top = work / f"{name}-base"
    base_top.mkdir()
    base = {} if scenario.fresh else scenario.setup(base_top / "repo")
    for n in range(1, max_points + 1):
        top = work / f"{name}-run"
        images = work / f"{name}-images"
        graveyard = work / f"{name}-graveyard"
        for d in (top, images, graveyard):
            shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(base_top, top)
        graveyard.mkdir()
        images.mkdir()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                injector = Injector(top, graveyard, images, n)
                injector.install()
                scenario.run(top / "repo")
                injector.active = False
                injector.write_images("completed")
                code = DONE_EXIT
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code not in (CRASH_EXIT, DONE_EXIT):
            outcome.failures.append(f"{name} point {n}: the protocol failed (exit {code})")
            return
        done = code == DONE_EXIT
        label = (images / "label").read_text()
        outcome.points += 1
        kind = "completed" if done else label.split()[0]
        outcome.kinds[kind] = outcome.kinds.get(kind, 0) + 1
        for image in sorted(p for p in images.iterdir() if p.is_dir()):
            outcome.images += 1
            try:
                check_image(image, name, base, done, outcome)
            except Exception as exc:
                outcome.failures.append(
                    f"{name} point {n} ({label}) image {image.name}: {type(exc).__name__}: {exc}"
                )
        if done:
            return
    outcome.failures.append(f"{name}: did not complete within {max_points} points")


def _no_fsync(fd: int) -> None:
    os.fstat(fd)  # still fails on a bad descriptor


def main() -> None:
    work = Path(sys.argv[1]).resolve()
    # Durability is modelled by the injector, so the disk need not really sync: checking the
    # images (later saves, GC) and building baselines runs without waiting on fsync.
    os.fsync = _no_fsync
    _REAL["fsync"] = _no_fsync
    global PACK_SIZE
    PACK_SIZE = int(sys.argv[2])
    outcome = Outcome()
    for name in sys.argv[3:]:
        run_scenario(work, name, outcome, max_points=2000)
    print(json.dumps(outcome.__dict__))


if __name__ == "__main__":
    main()
