"""The ``cas-ckpt`` command line (also ``python -m cas_ckpt``): parsing and printing only.

Every command is a thin layer over :class:`cas_ckpt.Repository`; see ``docs/cli.md``. Errors are one
line on stderr, never a traceback, and the exit code says what kind of failure it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from multiformats import CID

import cas_ckpt
from cas_ckpt import car, codec, hf
from cas_ckpt import cid as cidlib
from cas_ckpt.blocks.compression import SETTINGS
from cas_ckpt.codec import Link
from cas_ckpt.commit import is_commit
from cas_ckpt.errors import (
    AmbiguousPath,
    BlockNotFound,
    CasCkptError,
    CheckpointExpired,
    CorruptBlock,
    CorruptStore,
    DecodeError,
    InvalidCID,
    InvalidRefName,
    PathNotFound,
    RefNotFound,
    RepositoryError,
)
from cas_ckpt.http import DEFAULT_PORT, ENV_TOKEN, ENV_WRITE_TOKEN, MAX_STREAMS, MAX_UPLOAD, STREAM_WAIT
from cas_ckpt.maintenance.describe import describe_leaf, jsonable
from cas_ckpt.maintenance.diff import DiffReport, leaves, value_group
from cas_ckpt.maintenance.gc import DEFAULT_REFLOG_EXPIRY
from cas_ckpt.maintenance.lanes import GraphRow, passing
from cas_ckpt.maintenance.tensors import TensorStats
from cas_ckpt.maintenance.upkeep import UpkeepStatus
from cas_ckpt.paths import select
from cas_ckpt.refs.base import run_of, shown_name
from cas_ckpt.replication import TransferReport
from cas_ckpt.repository import Repository
from cas_ckpt.tree import (
    MAX_CHUNK,
    TreeReader,
)

EXIT_OK = 0  # success (diff: identical; fsck: no problem)
EXIT_CHECK = 1  # the command ran and found something: fsck problems, diff differences
EXIT_USAGE = 2  # bad arguments: unknown option, malformed CID or ref name, wrong kind of block,
# a path that reads two ways
EXIT_NOT_FOUND = 3  # unknown ref, CID not stored, path not in the checkpoint, data collected by GC
EXIT_REPO = 4  # no repository there, newer format, damaged store or block
EXIT_ERROR = 5  # any other failure: bad CAR file, ref moved concurrently, lock timeout, I/O error
EXIT_INTERRUPTED = 130

ENV_REPO = "CAS_CKPT_REPO"
PROG = "cas-ckpt"


class CommandError(CasCkptError):
    """A failure the command line itself detects, with its exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        _fail("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``cas-ckpt cat X | head``): stop quietly, as cat(1) does.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_ERROR
    except CasCkptError as exc:
        _fail(str(exc))
        return exit_code(exc)
    except OSError as exc:
        _fail(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc))
        return EXIT_ERROR


def exit_code(exc: CasCkptError) -> int:
    """The documented exit code for an error."""
    if isinstance(exc, CommandError):
        return exc.code
    if isinstance(exc, (InvalidCID, InvalidRefName, AmbiguousPath)):
        return EXIT_USAGE
    if isinstance(exc, (RefNotFound, BlockNotFound, PathNotFound, CheckpointExpired)):
        return EXIT_NOT_FOUND
    if isinstance(exc, (RepositoryError, CorruptStore, CorruptBlock, DecodeError)):
        return EXIT_REPO
    return EXIT_ERROR


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Content-addressed checkpoints: inspect, check, collect, export, import and replicate.",
        epilog=f"The repository is --repo PATH, else ${ENV_REPO}, else the current directory if it "
        "is one. Exit codes: 0 ok, 1 check found problems/differences, 2 usage, 3 not found, "
        "4 repository error, 5 other error. See docs/cli.md.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {cas_ckpt.__version__}")
    parser.add_argument("--repo", metavar="PATH", help=f"repository directory (default: ${ENV_REPO})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    json_flag = argparse.ArgumentParser(add_help=False)
    json_flag.add_argument("--json", action="store_true", help="print JSON for scripts")
    for register in _COMMANDS:
        register(sub, json_flag)
    return parser


_REPO_AFTER_COMMAND = argparse.ArgumentParser(add_help=False)
# --repo is also accepted after the command; SUPPRESS keeps it from hiding one given before.
_REPO_AFTER_COMMAND.add_argument("--repo", metavar="PATH", default=argparse.SUPPRESS,
                                 help="repository directory")


def _add(
    sub: Any, name: str, run: Callable[[argparse.Namespace], int], help: str, *parents: Any
) -> argparse.ArgumentParser:
    command: argparse.ArgumentParser = sub.add_parser(
        name, help=help, description=help, parents=[_REPO_AFTER_COMMAND, *parents]
    )
    command.set_defaults(run=run)
    return command


def _register_init(sub: Any, json_flag: Any) -> None:
    p = _add(sub, "init", cmd_init, "create a repository (the only command that creates one)")
    p.add_argument("path", nargs="?", help="directory (default: --repo, $CAS_CKPT_REPO or .)")
    p.add_argument("--hash", choices=sorted(cidlib.HASH_CODES), default="sha2-256")
    p.add_argument("--chunk-size", type=int, metavar="BYTES", default=MAX_CHUNK)
    p.add_argument("--compression", choices=SETTINGS, default=None,
                   help="how new blocks are stored (default none); on an existing repository, "
                        "switch to it")


def _register_reading(sub: Any, json_flag: Any) -> None:
    p = _add(sub, "log", cmd_log, "list commits newest first, following first parents", json_flag)
    p.add_argument("target", nargs="?", metavar="REF", help="ref or CID (default main)")
    p.add_argument("-n", "--limit", type=_positive_int, metavar="N", help="show at most N commits")
    p.add_argument("--graph", action="store_true",
                   help="draw forks and merges (no REF: every run; REF: it and the runs it shares "
                        "history with)")
    p = _add(sub, "show", cmd_show, "print one block as JSON (tensors summarised)", json_flag)
    p.add_argument("target", metavar="TARGET", help="ref or CID")
    p = _add(sub, "ls", cmd_ls, "list the values in a checkpoint with dtype, shape, size", json_flag)
    p.add_argument("target", nargs="?", default="main", metavar="TARGET", help="ref or CID")
    p.add_argument("path", nargs="?", metavar="PATH", help="only below this dotted path")
    p = _add(sub, "cat", cmd_cat, "write a block's raw bytes to stdout")
    p.add_argument("target", metavar="CID", help="CID (or ref: its commit block)")
    p = _add(sub, "refs", cmd_refs, "list refs and the CIDs they hold (as ref list)", json_flag)
    p.add_argument("prefix", nargs="?", default="", help="only refs starting with this")
    p = _add(sub, "reflog", cmd_reflog, "a ref's updates, newest first", json_flag)
    p.add_argument("name", metavar="NAME")
    p.add_argument("--drop", action="store_true",
                   help="forget the reflog of deleted ref NAME (what only it keeps goes at the next gc)")
    p = _add(sub, "du", cmd_du, "stored bytes per run, shared and exclusive (what deleting it "
             "would free), and what gc would free", json_flag)
    p.add_argument("--by-ref", action="store_true", help="one line per ref instead of per run")
    p.add_argument("--reflog-expiry", type=_seconds, default=DEFAULT_REFLOG_EXPIRY, metavar="SECONDS",
                   help="count what reflog entries newer than this reach as kept, as gc does "
                        "(default 2592000: 30 days)")
    p = _add(sub, "diff", cmd_diff, "compare two checkpoints (exit 1 if they differ)", json_flag)
    p.add_argument("a", metavar="A", help="ref or CID")
    p.add_argument("b", metavar="B", help="ref or CID")
    p.add_argument("path", nargs="?", metavar="PATH", help="only values below this dotted path")
    p.add_argument("--stat", action="store_true", help="print only the counts")
    p.add_argument("--by-tensor", action="store_true",
                   help="the relative change ||a-b||/||a|| of each changed tensor: model weights, "
                        "optimizer state, other values, each largest first")
    p.add_argument("--model-only", action="store_true",
                   help="only model weights (not optimizer state, step counters, RNG states...)")
    p = _add(sub, "stats", cmd_stats, "per-tensor statistics (min, max, mean, std, L2 norm, NaN and "
             "Inf counts), streamed", json_flag)
    p.add_argument("target", metavar="TARGET", help="ref or CID")
    p.add_argument("path", nargs="?", metavar="PATH", help="only the tensors below this dotted path")
    p.add_argument("--find-nonfinite", action="store_true",
                   help="the first checkpoint of TARGET's history holding a NaN or Inf (exit 1 if found)")


def _register_maintenance(sub: Any, json_flag: Any) -> None:
    p = _add(sub, "pin", cmd_pin, "keep checkpoints through gc without a ref; no TARGET: list pins",
             json_flag)
    p.add_argument("targets", nargs="*", metavar="TARGET")
    p = _add(sub, "unpin", cmd_unpin, "drop pins (exit 3 if one was not pinned)")
    p.add_argument("targets", nargs="+", metavar="TARGET")
    p = _add(sub, "gc", cmd_gc, "remove blocks no ref, pin or live reflog entry reaches", json_flag)
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.add_argument("--grace", type=_seconds, default=0.0, metavar="SECONDS",
                   help="keep blocks stored less than this long ago (default 0)")
    p.add_argument("--reflog-expiry", type=_seconds, default=DEFAULT_REFLOG_EXPIRY, metavar="SECONDS",
                   help="also keep what reflog entries newer than this reach "
                        "(default 2592000: 30 days; 0: refs and pins only)")
    p = _add(sub, "upkeep", cmd_upkeep, "merge small packs and write an index snapshot, if due "
             "(saves do it by themselves)", json_flag)
    p.add_argument("--force", action="store_true", help="run every task, due or not")
    p.add_argument("--dry-run", action="store_true", help="say what is due, change nothing")
    p = _add(sub, "fsck", cmd_fsck, "re-hash blocks and resolve every link (exit 1 on problems)",
             json_flag)
    p.add_argument("--sample", type=_fraction, metavar="FRACTION",
                   help="re-hash only this share of the blocks (0 < FRACTION <= 1)")


def _register_car(sub: Any, json_flag: Any) -> None:
    p = _add(sub, "export", cmd_export, "write a checkpoint as a CAR v1 file, a .safetensors file, "
             "a folder, or a Hugging Face model folder", json_flag)
    p.add_argument("target", metavar="TARGET", help="ref or CID")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("-o", "--output", metavar="OUT",
                     help="FILE.car ('-' for stdout), FILE.safetensors, or a folder")
    out.add_argument("--hf", metavar="OUT", help="a Hugging Face model folder: the tensors only "
                     "(a DCP checkpoint's whole tensors), other values skipped")
    p.add_argument("--path", metavar="PATH", help="safetensors: only the tensors below this path")
    p.add_argument("--max-shard-size", metavar="SIZE", type=_size,
                   help="safetensors: shards of at most SIZE (5GB, 500MiB) and an index")
    p.add_argument("--tied", action="store_true",
                   help="safetensors: write identical tensors once, as save_model does")
    p = _add(sub, "import", cmd_import, "store a CAR v1 file (all or nothing), a .safetensors file "
             "or a model folder", json_flag)
    p.add_argument("file", metavar="FILE", help="FILE.car ('-' for stdin), FILE.safetensors or a folder")
    p.add_argument("--ref", metavar="NAME",
                   help="point this ref at the import (safetensors: default main)")
    p.add_argument("--prefix", metavar="KEY", help="safetensors: the state key of the tensors "
                   "(default model)")


def _register_ref(sub: Any, json_flag: Any) -> None:
    ref = _add(sub, "ref", lambda args: args.ref_run(args), "create, move, delete, rename and list refs")
    verbs = ref.add_subparsers(dest="verb", metavar="VERB", required=True)

    def verb(name: str, run: Callable[[argparse.Namespace], int], help: str,
             *parents: Any) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = verbs.add_parser(name, help=help, description=help,
                                                      parents=[_REPO_AFTER_COMMAND, *parents])
        p.set_defaults(ref_run=run)
        return p

    p = verb("set", cmd_ref_set, "point NAME at TARGET (create or move)")
    p.add_argument("name", metavar="NAME")
    p.add_argument("target", metavar="TARGET")
    p.add_argument("--expect", metavar="CID", help="move only if NAME still holds this")
    p = verb("delete", cmd_ref_delete, "delete NAME (its reflog stays: ref restore brings it back)")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--expect", metavar="CID", help="delete only if NAME still holds this")
    p.add_argument("-r", "--recursive", action="store_true",
                   help="also the refs below NAME and its NAME.steps/ and NAME.files/ refs (a run)")
    p.add_argument("-y", "--yes", action="store_true", help="with --recursive: do not ask")
    p.add_argument("-n", "--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    p = verb("restore", cmd_ref_restore, "create deleted NAME again at what it held (its reflog says)")
    p.add_argument("name", metavar="NAME")
    p = verb("rename", cmd_ref_rename, "rename OLD to NEW (NEW must not exist)")
    p.add_argument("old", metavar="OLD")
    p.add_argument("new", metavar="NEW")
    p = verb("list", cmd_refs, "list refs and the CIDs they hold", json_flag)
    p.add_argument("prefix", nargs="?", default="", help="only refs starting with this")


def _register_replication(sub: Any, json_flag: Any) -> None:
    for name, run, help in (
        ("push", cmd_push, "send a ref's checkpoint and history to REMOTE (only missing blocks)"),
        ("pull", cmd_pull, "fetch a ref's checkpoint and history from REMOTE (only missing blocks)"),
    ):
        p = _add(sub, name, run, help, json_flag)
        p.add_argument("remote", metavar="REMOTE", help="repository directory or s3://bucket/prefix "
                       "(pull: also http://HOST:PORT of cas-ckpt serve)")
        p.add_argument("ref", nargs="?", default="main", metavar="REF", help="ref (default main)")
        p.add_argument("--remote-ref", metavar="NAME", help="the ref's name in REMOTE (default REF)")
        p.add_argument("--force", action="store_true",
                       help="move the ref even if that drops history it holds")
        p.add_argument("--head-only", action="store_true",
                       help="move REF only, not the step refs (REF.steps/N) its checkpoint manager keeps")
        _verbose_flag(p)
    p = _add(sub, "clone", cmd_clone, "copy every ref and pin of SRC into a new repository DST",
             json_flag)
    p.add_argument("src", metavar="SRC", help="repository directory, s3://bucket/prefix or "
                   "http://HOST:PORT (cas-ckpt serve)")
    p.add_argument("dst", metavar="DST", help="new repository directory or s3://bucket/prefix")
    _verbose_flag(p)


def _verbose_flag(p: Any) -> None:
    p.add_argument("-v", "--verbose", action="store_true",
                   help=f"list every ref moved, one a line (default: name up to {SHOWN_REFS}, count more)")


def _register_http(sub: Any, json_flag: Any) -> None:
    p = _add(sub, "serve", cmd_serve, "serve the repository read-only over HTTP: an IPFS trustless "
             "gateway for blocks and CARs, and a JSON API for refs")
    p.add_argument("path", nargs="?", metavar="REPO",
                   help="repository directory or s3://bucket/prefix (default: --repo, $CAS_CKPT_REPO or .)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every "
                        "interface)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="PORT",
                   help=f"port (default {DEFAULT_PORT}; 0: any free one, printed)")
    p.add_argument("--token", metavar="TOKEN",
                   help=f"require Authorization: Bearer TOKEN on every request (default: ${ENV_TOKEN})")
    p.add_argument("--max-streams", type=_positive_int, default=MAX_STREAMS, metavar="N",
                   help=f"block and CAR bodies sent at once (default {MAX_STREAMS}); a request over "
                        f"the cap waits up to {STREAM_WAIT:.0f} s, then gets 503 with Retry-After")
    p.add_argument("--write-token", metavar="TOKEN",
                   help=f"accept pushes from requests carrying Authorization: Bearer TOKEN (default: "
                        f"${ENV_WRITE_TOKEN}; without one the server is read-only)")
    p.add_argument("--max-upload", type=_size, default=MAX_UPLOAD, metavar="SIZE",
                   help="bytes one push may send (default 64GiB; 500MiB, 10GB...); over it: 413")
    p = _add(sub, "fetch", cmd_fetch, "fetch a checkpoint by CID from an IPFS trustless gateway, "
             "verifying every block", json_flag)
    p.add_argument("cid", metavar="CID", help="root CID of the checkpoint")
    p.add_argument("--gateway", required=True, metavar="URL",
                   help="http(s) URL of the gateway (cas-ckpt serve is one)")
    p.add_argument("--ref", metavar="NAME", help="point this ref at it")
    p.add_argument("--pin", action="store_true", help="pin it")
    p.add_argument("--force", action="store_true", help="move --ref even if that drops history it holds")
    _verbose_flag(p)



def _register_history(sub: Any, json_flag: Any) -> None:
    p = _add(sub, "commit-graph", cmd_commit_graph, "bring the commit graph up to date: history "
             "then reads a few files, not a block per commit", json_flag)
    p.add_argument("--consolidate", action="store_true",
                   help="merge every layer into one, leaving out commits gc removed")



_COMMANDS = (_register_init, _register_reading, _register_ref, _register_maintenance, _register_car,
             _register_replication, _register_http, _register_history)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError("must be a number of seconds >= 0")
    return value


def _size(text: str) -> int:
    try:
        return hf.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError("must be in (0, 1]")
    return value


# --------------------------------------------------------------------------------------------
# Repository, output, progress
# --------------------------------------------------------------------------------------------
def repo_path(args: argparse.Namespace) -> Path | str | None:
    """--repo, else $CAS_CKPT_REPO, else None (a URL such as s3://bucket/prefix stays a string)."""
    given = args.repo or os.environ.get(ENV_REPO)
    return _location(given) if given else None


def _location(given: str) -> Path | str:
    return given if "://" in given else Path(given)


@contextmanager
def open_repo(args: argparse.Namespace, *, write: bool = False) -> Iterator[Repository]:
    """Open the existing repository (never create one); read-only unless ``write``."""
    given = repo_path(args)
    try:
        repo = cas_ckpt.open(given or Path.cwd(), create=False, read_only=not write)
    except RepositoryError:
        if given is not None:
            raise
        raise RepositoryError(
            f"no repository given: pass --repo PATH or set {ENV_REPO} (or run inside a repository)"
        ) from None
    with repo:
        yield repo


def _print(text: str = "") -> None:
    print(text, file=sys.stdout)


def _print_json(value: Any) -> None:
    print(json.dumps(jsonable(value), indent=2, allow_nan=False), file=sys.stdout)


def human(size: float) -> str:
    """Bytes for people: 512 B, 1.5 KiB, 3.0 MiB..."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


class Progress:
    """One self-rewriting status line (``\\r``) on a terminal; silent when the stream is not one."""

    def __init__(self, label: str, stream: TextIO | None = None, *, interval: float = 0.1) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval
        self._last = -math.inf
        self._width = 0

    def update(self, text: str) -> None:
        now = time.monotonic()
        if not self.enabled or now - self._last < self.interval:
            return
        self._last = now
        line = f"{self.label}: {text}"
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = max(self._width, len(line))

    def close(self) -> None:
        if self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Rendering blocks and values
# --------------------------------------------------------------------------------------------
def _ls_line(row: dict[str, Any]) -> str:
    if row["type"] == "array":
        shape = "x".join(map(str, row["shape"])) if row["shape"] else "scalar"
        detail = f"{row['dtype']} {shape} {human(row['nbytes'] or 0)}"
        if row["kind"] != "numpy":
            detail += f" ({row['kind']})"
    elif row["type"] in ("bytes", "str") and "value" not in row:
        detail = human(row["nbytes"] or 0)
    elif row["type"] == "scalar":
        detail = f"{row['dtype']} {row['value']!r}"
    elif "items" in row:
        detail = f"… {row['items']} {row['of']}s"
    else:
        detail = json.dumps(row.get("value"))
    return f"{row['path'] or '<root>'}\t{row['type']}\t{detail}"


# --------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------
def resolve(repo: Repository, target: str) -> bytes:
    """A target (ref, CID, unique CID prefix, ``REF~N``) as a binary CID."""
    return bytes(repo.resolve(target))


def resolve_live(repo: Repository, target: str) -> bytes:
    """Like :func:`resolve`, but a commit whose data GC removed is CheckpointExpired, not damage."""
    cid = resolve(repo, target)
    if cidlib.is_node(cid) and repo.blocks.has(cid) and is_commit(_node(repo, cid)):
        commit = repo.commit(cid)
        if repo.expired(commit):
            raise CheckpointExpired(cidlib.to_str(cid), commit.tree)
    return cid


def _node(repo: Repository, cid: bytes) -> Any:
    if not cidlib.is_node(cid):
        raise CommandError(f"{cidlib.to_str(cid)} is a raw chunk, not a node", EXIT_USAGE)
    return codec.decode(repo.blocks.get(cid), cid=cid)


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------
def cmd_init(args: argparse.Namespace) -> int:
    path = _location(args.path) if args.path else (repo_path(args) or Path.cwd())
    try:
        with cas_ckpt.open(path, create=False, read_only=True) as repo:
            existing = repo.config
    except RepositoryError:
        existing = None
    if existing is not None:
        if args.compression is None or args.compression == existing.compression:
            _print(f"existing repository at {path} (hash {existing.hash}, compression "
                   f"{existing.compression}), left as it is")
            return EXIT_OK
        with cas_ckpt.open(path, create=False, compression=args.compression):
            _print(f"existing repository at {path}: new blocks are now stored with compression "
                   f"{args.compression} (stored blocks keep theirs)")
        return EXIT_OK
    if not 4096 <= args.chunk_size <= MAX_CHUNK:
        raise CommandError(f"--chunk-size must be 4096..{MAX_CHUNK}", EXIT_USAGE)
    with cas_ckpt.open(path, hash=args.hash, chunk_size=args.chunk_size,
                       compression=args.compression) as repo:
        _print(f"initialised repository at {path} (hash {repo.config.hash}, "
               f"chunk size {repo.config.chunk_size}, compression {repo.config.compression})")
    return EXIT_OK


def _commit_json(commit: cas_ckpt.Commit) -> dict[str, Any]:
    return {"cid": _text(commit.cid), "tree": _text(commit.tree), "parents": list(map(_text, commit.parents)),
            "step": commit.step, "time": commit.time, "metadata": jsonable(commit.metadata),
            "message": commit.message}


def cmd_log(args: argparse.Namespace) -> int:
    if args.graph:
        return _log_graph(args)
    with open_repo(args) as repo:
        root = _log_root(repo, args.target)
        if not is_commit(_node(repo, root)):
            raise CommandError(f"{cidlib.to_str(root)} is not a commit", EXIT_USAGE)
        commits = list(repo.log(root, limit=args.limit))
        expired = {c.cid for c in commits if repo.expired(c)}
        forks = repo.forks(commits)
    if args.json:
        _print_json([{**_commit_json(c), "expired": c.cid in expired,
                      "forks": forks.get(c.cid, [])} for c in commits])
        return EXIT_OK
    for c in commits:
        step = f"step {c.step}" if c.step is not None else "step -"
        parts = [_text(c.cid), _stamp(c.time), step]
        parts += ["[expired]"] if c.cid in expired else []
        parts += [f"[fork: {', '.join(forks[c.cid])}]"] if c.cid in forks else []
        parts += [text for text in (_metrics_text(c.metadata), c.message) if text]
        _print("  ".join(parts))
    return EXIT_OK


def _text(cid: cas_ckpt.CID) -> str:
    """``str(cid)``, without multiformats' generic encoder (2 ms a CID: most of a long log)."""
    return cidlib.to_str(bytes(cid))


def _log_graph(args: argparse.Namespace) -> int:
    with open_repo(args) as repo:
        if args.target is None:
            names = None
        else:
            if not is_commit(_node(repo, resolve(repo, args.target))):
                raise CommandError(f"{args.target} is not a commit", EXIT_USAGE)
            related = repo.forks(list(repo.log(args.target)))
            names = [args.target, *sorted({n for found in related.values() for n in found
                                           if run_of(n) == n and n != args.target})]
        rows = repo.graph(names, limit=args.limit)
        labels: dict[CID, list[str]] = {}
        for name, cid in sorted(repo.refs().items()):
            if run_of(name) == name:
                labels.setdefault(cid, []).append(name)
        expired = {row.commit.cid for row in rows if repo.expired(row.commit)}
    if args.json:
        _print_json([{**_commit_json(row.commit), "expired": row.commit.cid in expired,
                      "refs": labels.get(row.commit.cid, []), "column": row.column, "color": row.color,
                      "edges": [list(edge) for edge in row.edges], "children": row.children}
                     for row in rows])
        return EXIT_OK
    for line in graph_lines(rows, lambda row: _graph_text(row, labels, expired)):
        _print(line)
    return EXIT_OK


def _graph_text(row: GraphRow, labels: dict[CID, list[str]], expired: set[CID]) -> str:
    c = row.commit
    parts = [_text(c.cid)[:16], _stamp(c.time), f"step {c.step}" if c.step is not None else "step -"]
    parts += [f"({', '.join(labels[c.cid])})"] if c.cid in labels else []
    parts += ["[expired]"] if c.cid in expired else []
    parts += [text for text in (_metrics_text(c.metadata), c.message) if text]
    return "  ".join(parts)


def graph_lines(rows: Sequence[GraphRow], text: Callable[[GraphRow], str]) -> Iterator[str]:
    """``rows`` as ``git log --graph`` prints them: ``*`` for a commit, ``|`` for a lane going
    past, and ``/`` or ``\\`` lines where lanes join (a fork) or part (a merge)."""
    for i, row in enumerate(rows):
        cells = _cells(row.edges, passing(rows, i), row.column)
        yield f"{''.join(cells).rstrip():<{2 * _width(row) - 1}}  {text(row)}".rstrip()
        if i + 1 == len(rows):
            break
        moves = max((abs(end - start) for start, end, _ in row.edges), default=0)
        for k in range(1, moves + 1):
            line = [" "] * (2 * _width(row) + 2)
            for start, end, _ in row.edges:
                step = (end > start) - (end < start)
                before = start + step * min(k - 1, abs(end - start))
                after = start + step * min(k, abs(end - start))
                if before == after:
                    line[2 * after] = "|"
                elif after < before:
                    line[2 * after + 1] = "/"
                else:
                    line[2 * before + 1] = "\\"
            yield "".join(line).rstrip()


def _width(row: GraphRow) -> int:
    return max([row.column, *(max(s, e) for s, e, _ in row.edges)]) + 1


def _cells(edges: Sequence[tuple[int, int, int]], going_past: list[int], column: int) -> list[str]:
    cells = [" "] * (2 * max([column, *going_past, *(s for s, _, _ in edges)]) + 1)
    for x in going_past:
        cells[2 * x] = "|"
    cells[2 * column] = "*"
    return cells


def _log_root(repo: Repository, target: str | None) -> bytes:
    """The commit to start at; a missing default ref names the refs there are."""
    try:
        return resolve(repo, target or "main")
    except RefNotFound:
        if target is not None:
            raise
        names = sorted(repo.refs())
        there = f"refs here: {', '.join(names)}" if names else "the repository has no refs"
        raise CommandError(f"ref 'main' not found; give a REF ({there})", EXIT_NOT_FOUND) from None


def _metrics_text(metadata: dict[str, Any]) -> str:
    """A commit's metrics (``{"metrics": {...}}`` from the manager) or other metadata, as k=v."""
    values = metadata.get("metrics") if isinstance(metadata.get("metrics"), dict) else metadata
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={json.dumps(jsonable(v))}"
                    for k, v in values.items())


def cmd_show(args: argparse.Namespace) -> int:
    with open_repo(args) as repo:
        cid = resolve(repo, args.target)
        if cidlib.is_node(cid):
            value = jsonable(codec.decode(repo.blocks.get(cid), cid=cid))
        else:
            value = {"raw": {"cid": cidlib.to_str(cid), "size": len(repo.blocks.get(cid))}}
    text = json.dumps(value, indent=None if args.json else 2, allow_nan=False)
    _print(text)
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    with open_repo(args) as repo:
        root = resolve_live(repo, args.target)
        reader = TreeReader(repo.blocks, repo.pool)
        start: Any = Link(bytes(repo.tree(root)))
        where = ""
        if args.path:
            selection = select(reader, start, args.path, cidlib.to_str(root))
            start, where = selection.value, selection.path
        found = leaves(reader, start, where)
    rows = [describe_leaf(path, leaf) for path, leaf in found.items()]
    if args.json:
        _print_json(rows)
    else:
        for row in rows:
            _print(_ls_line(row))
    return EXIT_OK


def cmd_cat(args: argparse.Namespace) -> int:
    if sys.stdout.isatty():
        raise CommandError("refusing to write binary to a terminal; redirect or pipe stdout", EXIT_USAGE)
    with open_repo(args) as repo:
        data = repo.blocks.get(resolve(repo, args.target))
    sys.stdout.flush()
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
    return EXIT_OK


def cmd_refs(args: argparse.Namespace) -> int:
    with open_repo(args) as repo:
        refs = repo.refs(args.prefix)
    if args.json:
        _print_json({name: str(cid) for name, cid in sorted(refs.items())})
    else:
        for name, cid in sorted(refs.items()):
            # A name an older cas_ckpt stored with a bidi or C1 control is shown escaped.
            _print(f"{cid}  {shown_name(name)}")
    return EXIT_OK


def cmd_reflog(args: argparse.Namespace) -> int:
    if args.drop:
        with open_repo(args, write=True) as repo:
            repo.drop_reflog(args.name)
        _print(f"dropped the reflog of {args.name}")
        return EXIT_OK
    with open_repo(args) as repo:
        entries = list(reversed(repo.reflog(args.name)))
    rows = [{"old": cidlib.to_str(e.old) if e.old else None,
             "new": cidlib.to_str(e.new) if e.new else None,
             "time": e.time, "message": e.message} for e in entries]
    if args.json:
        _print_json(rows)
        return EXIT_OK
    for back, row in enumerate(rows):
        _print(f"{args.name}@{{{back}}}  {row['new'] or '(deleted)'}  {_stamp(row['time'])}  "
               f"{row['message']}  (was {row['old'] or 'absent'})")
    return EXIT_OK


def cmd_ref_set(args: argparse.Namespace) -> int:
    with open_repo(args, write=True) as repo:
        cid = repo.set_ref(args.name, args.target, expected=args.expect)
    _print(f"{args.name} -> {cid}")
    return EXIT_OK


def cmd_ref_delete(args: argparse.Namespace) -> int:
    if args.recursive:
        return _delete_run(args)
    with open_repo(args, write=not args.dry_run) as repo:
        held = repo.resolve(args.expect) if args.expect else repo.refs(args.name).get(args.name)
        if held is None:
            raise RefNotFound(args.name)
        if args.dry_run:
            _print(f"{held}  {args.name}")
            _print("dry run: nothing deleted")
            return EXIT_OK
        repo.delete_ref(args.name, expected=args.expect)
    _print(f"deleted {args.name} (its reflog is kept: cas-ckpt ref restore {args.name})")
    return EXIT_OK


def _delete_run(args: argparse.Namespace) -> int:
    """``ref delete --recursive``: list the refs, then delete them if --yes or confirmed."""
    if args.expect:
        raise CommandError("--expect applies to one ref, not with --recursive", EXIT_USAGE)
    with open_repo(args, write=not args.dry_run) as repo:
        found = repo.run_refs(args.name)
        if not found:
            raise RefNotFound(args.name)
        for name, cid in sorted(found.items()):
            _print(f"{cid}  {name}")
        if args.dry_run:
            _print(f"dry run: would delete {len(found)} ref(s), nothing deleted")
            return EXIT_OK
        if not args.yes:
            _confirm(f"delete these {len(found)} ref(s)?")
        repo.delete_run(args.name)
    _print(f"deleted {len(found)} ref(s) (their reflogs are kept: cas-ckpt ref restore NAME)")
    return EXIT_OK


def _confirm(question: str) -> None:
    """Ask on the terminal; :class:`CommandError` (exit 2) unless answered yes. Without a
    terminal on stdin nothing is asked, and nothing is confirmed."""
    if sys.stdin is None or not sys.stdin.isatty():
        raise CommandError("not deleting without confirmation: no terminal to ask on; pass --yes "
                           "(or --dry-run to list only)", EXIT_USAGE)
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    if sys.stdin.readline().strip().lower() not in ("y", "yes"):
        raise CommandError("not confirmed: nothing deleted", EXIT_USAGE)


def cmd_ref_restore(args: argparse.Namespace) -> int:
    with open_repo(args, write=True) as repo:
        cid = repo.restore_ref(args.name)
    _print(f"restored {args.name} -> {cid}")
    return EXIT_OK


def cmd_ref_rename(args: argparse.Namespace) -> int:
    with open_repo(args, write=True) as repo:
        cid = repo.rename_ref(args.old, args.new)
    _print(f"renamed {args.old} to {args.new} ({cid})")
    return EXIT_OK


def _stamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def cmd_pin(args: argparse.Namespace) -> int:
    with open_repo(args, write=bool(args.targets)) as repo:
        if not args.targets:
            pins = [str(c) for c in repo.pins()]
            if args.json:
                _print_json(pins)
            else:
                for cid in pins:
                    _print(cid)
            return EXIT_OK
        pinned = [str(repo.pin(resolve(repo, t))) for t in args.targets]
    if args.json:
        _print_json(pinned)
    else:
        for cid in pinned:
            _print(f"pinned {cid}")
    return EXIT_OK


def cmd_unpin(args: argparse.Namespace) -> int:
    code = EXIT_OK
    with open_repo(args, write=True) as repo:
        for target in args.targets:
            cid = resolve(repo, target)
            if repo.unpin(cid):
                _print(f"unpinned {cidlib.to_str(cid)}")
            else:
                print(f"{PROG}: {cidlib.to_str(cid)} was not pinned", file=sys.stderr)
                code = EXIT_NOT_FOUND
    return code


def cmd_gc(args: argparse.Namespace) -> int:
    with open_repo(args, write=not args.dry_run) as repo, Progress("gc") as bar:
        report = repo.gc(
            grace=args.grace, reflog_expiry=args.reflog_expiry, dry_run=args.dry_run,
            progress=lambda phase, n: bar.update(f"{phase} {n} blocks"),
        )
    if args.json:
        _print_json(report)
        return EXIT_OK
    _print(f"live {report.live_blocks} blocks, history-only {report.lineage_blocks}, "
           f"unreachable {report.unreachable_blocks} ({human(report.unreachable_bytes)})")
    if report.held_packs:
        _print(f"kept {_count(report.held_packs, 'pack')} younger than the medium's minimum grace "
               f"({report.min_grace:g} s) that gc would otherwise merge or free: "
               f"{report.held_blocks} unreachable blocks ({human(report.held_bytes)}) in them wait for "
               "a later gc")
    if report.dry_run:
        for cid in report.unreachable:
            _print(f"would remove {cid}")
        _print("dry run: nothing removed")
    else:
        _print(f"removed {report.blocks_freed} blocks, freed {human(report.bytes_freed)}"
               + (f", {report.temp_files_removed} stale temp files" if report.temp_files_removed else "")
               + (f", {report.reflogs_dropped} expired reflogs of deleted refs"
                  if report.reflogs_dropped else ""))
    return EXIT_OK


def cmd_commit_graph(args: argparse.Namespace) -> int:
    with open_repo(args, write=True) as repo:
        report = repo.update_commit_graph(consolidate=args.consolidate)
    if args.json:
        _print_json(report)
        return EXIT_OK
    for name, why in sorted(report.damaged.items()):
        _print(f"rebuilt around damaged layer {name}: {why}")
    layers = "layer" if report.layers == 1 else "layers"
    _print(f"commit graph: {report.commits} commits in {report.layers} {layers}; "
           f"{report.commits_added} added, {report.layers_merged} merged, "
           f"{human(report.bytes_written)} written")
    return EXIT_OK


def cmd_upkeep(args: argparse.Namespace) -> int:
    with open_repo(args, write=not args.dry_run) as repo:
        before = repo.upkeep_status()
        report = None if args.dry_run else repo.upkeep(force=args.force)
        after = repo.upkeep_status() if report is not None else before
    if args.json:
        _print_json({"before": before, "report": report, "after": after})
        return EXIT_OK
    if before is None:
        _print("this repository's store keeps no packs: nothing to do")
        return EXIT_OK
    _print(f"before: {_layout_line(before)}")
    if report is None:
        _print("dry run: nothing changed")
    elif report.skipped:
        _print(f"skipped: {report.skipped}")
    else:
        done = ", ".join(report.ran) or "nothing was due"
        _print(f"ran: {done}; merged {report.packs_merged} packs into {report.packs_written} "
               f"({human(report.bytes_copied)} copied), {report.commits_added} commits into the "
               f"commit graph in {report.seconds:.2f} s")
        for where, aside in report.set_aside.items():
            _print(f"set aside: {where} (no readable file) moved to {aside}")
        if after is not None:
            _print(f"after: {_layout_line(after)}")
    return EXIT_OK


def _layout_line(status: UpkeepStatus) -> str:
    """Packs, the index snapshot, what an open reads besides it, and what upkeep would do."""
    snapshot = "no index snapshot" if status.snapshot is None else f"index snapshot {status.snapshot}"
    damaged = f", {status.damaged_indexes} damaged index file(s)" if status.damaged_indexes else ""
    due = ", ".join(status.due) or "nothing"
    return (f"{status.packs} packs ({status.small_packs} small, {human(status.pack_bytes)}); {snapshot}"
            f" + {status.uncovered} not in it{damaged}; upkeep due: {due}"
            f" ({'automatic' if status.auto else 'by hand only'})")


def cmd_fsck(args: argparse.Namespace) -> int:
    with open_repo(args) as repo, Progress("fsck") as bar:
        report = repo.fsck(
            sample=args.sample,
            progress=lambda phase, i, n: bar.update(f"{phase} {i}/{n} blocks"),
        )
    if args.json:
        _print_json({"ok": report.ok, **jsonable(report)})
    else:
        for problem in report.problems:
            needed = ", ".join(map(str, problem.needed_by)) or "nothing"
            _print(f"{problem.kind} {problem.cid}: {problem.detail} (needed by {needed})")
        for text in report.store_problems:
            _print(f"store: {text}")
        status = "ok" if report.ok else f"{len(report.problems) + len(report.store_problems)} problem(s)"
        # Reachable counts what the refs need, stored or not: say how many of those are missing.
        missing = sum(1 for p in report.problems if p.kind == "missing")
        _print(f"checked {report.blocks_checked} of {report.blocks_total} stored blocks; "
               f"{report.reachable_blocks} blocks reachable from {report.refs_checked} refs, "
               f"{missing} of them missing: {status}")
    return EXIT_OK if report.ok else EXIT_CHECK


def cmd_du(args: argparse.Namespace) -> int:
    with open_repo(args) as repo:
        usage = repo.stats(reflog_expiry=args.reflog_expiry)
    if args.json:
        _print_json({**jsonable(usage), "unreachable_blocks": usage.unreachable_blocks,
                     "unreachable_bytes": usage.unreachable_bytes, "dedup_ratio": usage.dedup_ratio,
                     "gc_would_free_bytes": usage.freeable_bytes})
        return EXIT_OK
    if args.by_ref:
        _table(["REF", "LOGICAL", "STORED", "BLOCKS"],
               [[r.ref, human(r.logical_bytes), human(r.stored_bytes), str(r.blocks)] for r in usage.refs])
    elif usage.runs:
        _table(["RUN", "REFS", "CHECKPOINTS", "LOGICAL", "STORED", "SHARED", "EXCLUSIVE"],
               [[r.run, str(r.refs), str(r.checkpoints), human(r.logical_bytes), human(r.stored_bytes),
                 human(r.shared_bytes), human(r.exclusive_bytes)] for r in usage.runs])
    held = f"; {human(usage.held_bytes)} more once young packs age" if usage.held_bytes else ""
    _print(f"total: logical {human(usage.logical_bytes)}, stored {human(usage.stored_bytes)} "
           f"(dedup {usage.dedup_ratio:.2f}x); all blocks {human(usage.total_bytes)} in "
           f"{usage.total_blocks} blocks: live {human(usage.live_bytes)}, unreachable "
           f"{human(usage.unreachable_bytes)} (gc would free {human(usage.freeable_bytes)}{held})")
    if usage.upkeep is not None:
        _print(f"storage: {_layout_line(usage.upkeep)}")
    return EXIT_OK


def _table(header: list[str], rows: list[list[str]]) -> None:
    """Columns: the first left-aligned, the others right-aligned, two spaces apart."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        rest = (cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True))
        cells = [row[0].ljust(widths[0]), *rest]
        _print("  ".join(cells).rstrip())


def cmd_diff(args: argparse.Namespace) -> int:
    with open_repo(args) as repo:
        report = repo.diff(resolve_live(repo, args.a), resolve_live(repo, args.b), path=args.path)
    if args.model_only:
        report = report.model_only()
    if args.by_tensor:
        return _diff_by_tensor(args, report)
    if args.json:
        _print_json({"identical": report.identical, **jsonable(report)})
    elif args.stat:
        _print(f"{len(report.changed)} changed, {len(report.added)} added, "
               f"{len(report.removed)} removed, {report.unchanged} unchanged")
    else:
        for path in report.removed:
            _print(f"- {path}")
        for path in report.added:
            _print(f"+ {path}")
        for change in report.changed:
            extra = ""
            if change.max_abs is not None:
                extra = f" (max |diff| {change.max_abs:g}, L2 {change.l2:g}, relative {change.relative:.3g})"
            _print(f"~ {change.path}: {change.detail}{extra}")
        _print(f"{report.unchanged} unchanged; {human(report.shared_bytes)} shared "
               f"({human(report.a_bytes)} in A, {human(report.b_bytes)} in B)")
    return EXIT_OK if report.identical else EXIT_CHECK


def _diff_by_tensor(args: argparse.Namespace, report: DiffReport) -> int:
    tensors = report.by_tensor()
    others = len(report.changed) - len(tensors)
    if args.json:
        _print_json({"identical": report.identical, "tensors": [
            {"path": c.path, "group": value_group(c.path), "relative": c.relative, "l2": c.l2,
             "a_norm": c.a_norm, "max_abs": c.max_abs}
            for c in tensors], "added": report.added, "removed": report.removed,
            "other_changes": others, "unchanged": report.unchanged})
    else:
        width = max([len("PATH"), *(len(c.path) for c in tensors)])
        _print(f"{'RELATIVE':>10}  {'PATH':<{width}}  {'||A-B||':>10}  {'||A||':>10}  {'MAX |A-B|':>10}")
        shown = None
        for c in tensors:
            group = value_group(c.path)
            if group != shown:  # model weights, then optimizer state, then the rest
                _print(f"{_GROUP_TITLES[group]}:")
                shown = group
            _print(f"{_number(c.relative):>10}  {c.path:<{width}}  {_number(c.l2):>10}  "
                   f"{_number(c.a_norm):>10}  {_number(c.max_abs):>10}")
        _print(f"{_count(len(tensors), 'tensor')} changed, {others} other values changed, "
               f"{len(report.added)} added, {len(report.removed)} removed, {report.unchanged} unchanged")
    return EXIT_OK if report.identical else EXIT_CHECK


_GROUP_TITLES = {"model": "model weights", "optimizer": "optimizer state", "other": "other values"}


def _number(value: float | int | None) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def cmd_stats(args: argparse.Namespace) -> int:
    if args.find_nonfinite:
        return _find_nonfinite(args)
    with open_repo(args) as repo:
        rows = repo.stats(resolve_live(repo, args.target), args.path)
    if args.json:
        _print_json(rows)
        return EXIT_OK
    _print_stats(rows)
    return EXIT_OK


def _print_stats(rows: Sequence[TensorStats]) -> None:
    width = max([len("PATH"), *(len(r.path) for r in rows)])
    _print(f"{'PATH':<{width}}  {'DTYPE':<9} {'SHAPE':<12} {'MIN':>10} {'MAX':>10} {'MEAN':>10} "
           f"{'STD':>10} {'L2':>10} {'NAN':>6} {'INF':>6}")
    for r in rows:
        shape = "x".join(map(str, r.shape)) or "scalar"
        _print(f"{r.path:<{width}}  {r.dtype:<9} {shape:<12} {_number(r.min):>10} {_number(r.max):>10} "
               f"{_number(r.mean):>10} {_number(r.std):>10} {_number(r.l2):>10} {r.nan:>6} {r.inf:>6}")


def _find_nonfinite(args: argparse.Namespace) -> int:
    with open_repo(args) as repo:
        report = repo.find_nonfinite(args.target, path=args.path)
    if args.json:
        _print_json({"found": report.found, "message": report.message(), **jsonable(report)})
    elif report.found:
        _print(f"{report.message()}:")
        _print_stats(report.tensors)
    else:
        _print(report.message())
    return EXIT_CHECK if report.found else EXIT_OK


def _car_progress(bar: Progress, total: int | None) -> car.Progress:
    def update(blocks: int, nbytes: int) -> None:
        share = f" of {human(total)} ({100 * nbytes // max(total, 1)}%)" if total else ""
        bar.update(f"{blocks} blocks, {human(nbytes)}{share}")

    return update


def _car_summary(verb: str, report: car.CarReport, where: str) -> str:
    roots = ", ".join(map(str, report.roots))
    new = f" ({report.blocks_new} new, {human(report.bytes_new)})" if verb == "imported" else ""
    return (f"{verb} {report.blocks} blocks{new}, {human(report.car_bytes)} CAR, "
            f"root {roots} {where}")


def _is_car(output: str) -> bool:
    return output == "-" or output.endswith(".car")


def cmd_export(args: argparse.Namespace) -> int:
    if args.hf is not None:
        return _export_model(args)
    if not _is_car(args.output):
        return _export_safetensors(args)
    if args.path is not None or args.max_shard_size is not None or args.tied:
        raise CommandError("--path, --max-shard-size and --tied apply to safetensors exports, not CAR",
                           EXIT_USAGE)
    to_stdout = args.output == "-"
    if to_stdout and sys.stdout.isatty():
        raise CommandError("refusing to write a binary CAR to a terminal; use -o FILE.car", EXIT_USAGE)
    with open_repo(args) as repo, Progress("export") as bar:
        out: BinaryIO | str = sys.stdout.buffer if to_stdout else args.output
        report = repo.export_car(resolve_live(repo, args.target), out, progress=_car_progress(bar, None))
    if to_stdout:
        sys.stdout.buffer.flush()
    if args.json:
        print(json.dumps(jsonable(report), indent=2), file=sys.stderr if to_stdout else sys.stdout)
    elif not to_stdout:
        _print(_car_summary("exported", report, f"to {args.output}"))
    return EXIT_OK


def _export_safetensors(args: argparse.Namespace) -> int:
    with open_repo(args) as repo:
        report = repo.export_safetensors(resolve_live(repo, args.target), args.output, path=args.path,
                                         max_shard_size=args.max_shard_size, tied=args.tied)
    if args.json:
        _print_json(report)
    else:
        how = "re-created" if report.exact else "wrote"
        _print(f"{how} {_count(len(report.files), 'file')}, {report.tensors} tensors, {human(report.bytes)} "
               f"to {args.output}")
    return EXIT_OK


def _export_model(args: argparse.Namespace) -> int:
    with open_repo(args) as repo:
        report = repo.export_safetensors(resolve_live(repo, args.target), args.hf, path=args.path,
                                         max_shard_size=args.max_shard_size, tied=args.tied, model=True)
    if args.json:
        _print_json(report)
        return EXIT_OK
    how = "re-created" if report.exact else "wrote"
    _print(f"{how} {_count(len(report.files), 'file')}, {report.tensors} tensors, {human(report.bytes)} "
           f"to {args.hf}")
    if report.skipped:
        shown = ", ".join(report.skipped[:6]) + (f" and {len(report.skipped) - 6} more"
                                                 if len(report.skipped) > 6 else "")
        print(f"{PROG}: note: left out {_count(len(report.skipped), 'value')} holding no tensor: "
              f"{shown}", file=sys.stderr)
    return EXIT_OK


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _import_safetensors(args: argparse.Namespace) -> int:
    ref = args.ref or "main"
    with open_repo(args, write=True) as repo:
        cid = repo.import_safetensors(args.file, ref=ref, prefix=args.prefix or "model")
        report = repo.last_save
    assert report is not None
    if args.json:
        _print_json(report)
    else:
        _print(f"imported {args.file} as {ref}: {human(report.logical_bytes)} of tensors and files, "
               f"{human(report.bytes_written)} new ({report.blocks_written} blocks), root {cid}")
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    if args.file != "-" and hf.looks_like_safetensors(args.file):  # a CAR is told by its content
        return _import_safetensors(args)
    if args.prefix is not None:
        raise CommandError(f"{args.file} is not a safetensors file or folder; --prefix applies "
                           "to those only", EXIT_USAGE)
    from_stdin = args.file == "-"
    if from_stdin and sys.stdin.isatty():
        raise CommandError("refusing to read a binary CAR from a terminal; pipe one in", EXIT_USAGE)
    total = None if from_stdin else os.path.getsize(args.file)
    with open_repo(args, write=True) as repo, Progress("import") as bar:
        src: BinaryIO | str = sys.stdin.buffer if from_stdin else args.file
        report = repo.import_car(src, ref=args.ref, progress=_car_progress(bar, total))
    if args.json:
        _print_json(report)
    else:
        _print(_car_summary("imported", report, f"as {args.ref}" if args.ref else "(no ref)"))
    if not args.ref:
        print(f"{PROG}: note: no ref points at the imported root; use --ref NAME or pin it, "
              "or the next gc removes it", file=sys.stderr)
    return EXIT_OK


def _transfer_progress(bar: Progress) -> Callable[[int, int, int, int], None]:
    def update(blocks: int, nbytes: int, total_blocks: int, total_bytes: int) -> None:
        share = 100 * nbytes // max(total_bytes, 1)
        bar.update(f"{blocks}/{total_blocks} blocks, {human(nbytes)} of {human(total_bytes)} ({share}%)")

    return update


SHOWN_REFS = 3  # refs a transfer's summary names inline; more are counted (--verbose lists them)


def _transfer_summary(verb: str, report: TransferReport, *, verbose: bool = False) -> str:
    moved = [f"{ref} {report.previous.get(ref) or '(new)'} -> {cid}" for ref, cid in report.refs.items()
             if report.previous.get(ref) != cid]
    if moved and (verbose or len(moved) > SHOWN_REFS):
        new = sum(1 for ref in report.refs if report.previous.get(ref) is None)
        refs = (f"{len(moved)} refs moved ({new} new), {len(report.refs) - len(moved)} up to date"
                + ("" if verbose else " (--verbose lists them)"))
    else:
        refs = "; ".join(moved) if moved else f"{', '.join(report.refs) or 'nothing'} up to date"
    line = (f"{verb} {report.source} -> {report.destination}: {refs}; sent {report.blocks_sent} "
            f"blocks ({human(report.bytes_sent)}, {report.commits_sent} history), skipped "
            f"{report.blocks_skipped} already there ({human(report.bytes_skipped)}) in "
            f"{report.seconds:.2f} s")
    return "\n".join([line, *(f"  {entry}" for entry in moved)]) if verbose and moved else line


def _print_transfer(args: argparse.Namespace, verb: str, report: TransferReport) -> int:
    if args.json:
        _print_json({**dataclasses.asdict(report), "refs": report.refs, "previous": report.previous,
                     "up_to_date": report.up_to_date})
    else:
        _print(_transfer_summary(verb, report, verbose=args.verbose))
    return EXIT_OK


def _remote(text: str) -> str:
    return text if "://" in text else os.path.expanduser(text)


def cmd_push(args: argparse.Namespace) -> int:
    with open_repo(args) as repo, Progress("push") as bar:
        report = repo.push(_remote(args.remote), args.ref, remote_ref=args.remote_ref, force=args.force,
                           head_only=args.head_only, progress=_transfer_progress(bar))
    return _print_transfer(args, "pushed", report)


def cmd_pull(args: argparse.Namespace) -> int:
    with open_repo(args, write=True) as repo, Progress("pull") as bar:
        report = repo.pull(_remote(args.remote), args.ref, remote_ref=args.remote_ref, force=args.force,
                           head_only=args.head_only, progress=_transfer_progress(bar))
    return _print_transfer(args, "pulled", report)


def cmd_clone(args: argparse.Namespace) -> int:
    with Progress("clone") as bar:
        repo = cas_ckpt.clone(_remote(args.src), _remote(args.dst), progress=_transfer_progress(bar))
    with repo:
        report = repo.last_transfer
    assert report is not None
    return _print_transfer(args, "cloned", report)


def cmd_serve(args: argparse.Namespace) -> int:
    location = _location(args.path) if args.path else (repo_path(args) or Path.cwd())
    token = args.token if args.token is not None else os.environ.get(ENV_TOKEN) or None
    write_token = args.write_token if args.write_token is not None else (
        os.environ.get(ENV_WRITE_TOKEN) or None)
    if write_token is not None and write_token == token:
        raise CommandError("--write-token must differ from --token: the read token may not push", EXIT_USAGE)
    with cas_ckpt.open(location, create=False, read_only=write_token is None) as repo:

        def ready(url: str) -> None:
            how = "read-only" if write_token is None else (
                f"taking pushes (up to {human(args.max_upload)} each)")
            _print(f"serving {repo.location} {how} at {url} (Ctrl-C stops)")
            _print(f"browse it at {url}/" + ("?token=<token> (once: a session cookie keeps the page open)"
                                             if token else ""))
            sys.stdout.flush()
            if not token and args.host not in ("127.0.0.1", "localhost", "::1"):
                print(f"{PROG}: note: no --token: anyone who can reach {url} can read every checkpoint",
                      file=sys.stderr)

        cas_ckpt.serve(repo, args.host, args.port, token=token, max_streams=args.max_streams, ready=ready,
                       write_token=write_token, max_upload=args.max_upload)
    return EXIT_OK


def cmd_fetch(args: argparse.Namespace) -> int:
    with open_repo(args, write=True) as repo, Progress("fetch") as bar:
        report = repo.fetch(args.cid, gateway=args.gateway, ref=args.ref, pin=args.pin, force=args.force,
                            progress=_transfer_progress(bar))
    if not args.ref and not args.pin:
        print(f"{PROG}: note: no ref or pin holds {args.cid}; use --ref NAME or --pin, or the next gc "
              "removes it", file=sys.stderr)
    return _print_transfer(args, "fetched", report)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
