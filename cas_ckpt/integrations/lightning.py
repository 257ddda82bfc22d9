"""PyTorch Lightning: every checkpoint the Trainer saves goes into a cas_ckpt repository.

One line in the Trainer's configuration::

    from cas_ckpt.integrations.lightning import CasCheckpointIO
    trainer = Trainer(plugins=[CasCheckpointIO("checkpoints", ref="runs/exp-7")])

Works with ``pytorch_lightning`` (2.6) and with ``lightning.pytorch``, whichever is installed (both
at once too). What goes where:

* the checkpoint dict goes into the repository as an ordinary checkpoint on ``ref`` (so
  ``repo.log(ref)`` lists every save, with ``step`` = ``global_step``); tensors, optimizer and
  scheduler states are stored by content, shared with earlier saves;
* at the path Lightning asked for, a small JSON *stub* names the checkpoint's root CID (format in
  ``docs/format.md``); ``ModelCheckpoint``'s listing, ``exists``, ``"last"`` links, ``save_top_k``
  and ``ckpt_path=...`` all see an ordinary file;
* each stub's checkpoint is held by the ref ``<ref>.files/<file name>-<hash of its path>``, so
  :meth:`CasCheckpointIO.remove_checkpoint` (``save_top_k`` dropping one) deletes that ref and runs
  GC, which frees the blocks no other checkpoint uses.

Lightning's ``hyper_parameters`` (``AttributeDict``, ``argparse.Namespace``), callback states and
loop progress are converted to plain data (dicts, lists, numbers); a value that only pickle could
store raises :class:`~cas_ckpt.errors.StateTypeError` naming its key, e.g.
``hyper_parameters.activation``. Loading never runs code.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import re
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from multiformats import CID

from cas_ckpt._fs import atomic_write, fsync_dir
from cas_ckpt.errors import CheckpointFileError, SaveFailed
from cas_ckpt.integrations._common import RepoOrPath, open_repo, plain
from cas_ckpt.manager import snapshot
from cas_ckpt.refs import check_ref_name
from cas_ckpt.repository import Repository

__all__ = ["STUB_FORMAT", "CasCheckpointIO", "read_stub"]

STUB_FORMAT = "cas_ckpt/lightning-checkpoint"
STUB_VERSION = 1
_STUB_LIMIT = 64 * 1024  # a stub is ~300 bytes; anything larger is some other file


def _checkpoint_io_bases() -> list[type]:
    """Lightning's ``CheckpointIO`` class of each Lightning package installed."""
    bases = []
    for name in ("lightning_fabric.plugins.io.checkpoint_io", "lightning.fabric.plugins.io.checkpoint_io"):
        try:
            bases.append(importlib.import_module(name).CheckpointIO)
        except ImportError:
            continue
    if not bases:
        raise ImportError(
            "cas_ckpt.integrations.lightning needs pytorch-lightning or lightning: "
            "pip install 'cas_ckpt[lightning]'"
        )
    return bases


_BASES = _checkpoint_io_bases()


class CasCheckpointIO(_BASES[0]):  # type: ignore[misc,valid-type]
    """A Lightning ``CheckpointIO`` plugin that stores checkpoints in a cas_ckpt repository.

    ``repo_or_path``: a :class:`~cas_ckpt.Repository` or a path (``cas_ckpt.open`` opens it; a
    path is reopened after :meth:`teardown`). ``ref``: the ref every save moves. ``async_save``:
    ``save_checkpoint`` returns once the state is copied to host memory and a background thread
    writes it; removals queue behind the saves, so ``save_top_k`` never removes a checkpoint before
    it is written. (Lightning's own ``AsyncCheckpointIO`` wrapped around this plugin works too.)
    ``gc_after_remove``: run ``repo.gc()`` after each removal, and after a save that replaced the
    checkpoint at its path (``last.ckpt``), so the blocks only those held are freed at once.
    """

    def __init__(
        self,
        repo_or_path: RepoOrPath,
        *,
        ref: str = "lightning",
        async_save: bool = False,
        gc_after_remove: bool = True,
    ) -> None:
        self._repo: Repository | None
        self._repo, self._owned = open_repo(repo_or_path)
        self._path = repo_or_path if self._owned else None
        self.ref = check_ref_name(ref)
        self.files_prefix = check_ref_name(f"{ref}.files") + "/"
        self.async_save = async_save
        self.gc_after_remove = gc_after_remove
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[tuple[Future[None], int | None]] = []  # (job, step of a save)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<CasCheckpointIO {self.ref!r} in {self.repo!r}>"

    @property
    def repo(self) -> Repository:
        """The repository (reopened from its path after :meth:`teardown` closed it)."""
        if self._repo is None:
            self._repo, _ = open_repo(self._path)  # type: ignore[arg-type]
        return self._repo

    # -- CheckpointIO --------------------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        """Store ``checkpoint`` and write the stub at ``path`` once it is durable."""
        if storage_options is not None:
            raise TypeError(
                "CasCheckpointIO.save_checkpoint does not take storage_options; "
                f"got {storage_options!r}"
            )
        self._raise_failures()
        state = plain(checkpoint)  # in the caller's thread: a bad value fails the call itself
        target = _local(path)
        if not self.async_save:
            self._write(state, target)
            return
        step = state.get("global_step")
        self._submit(self._write, snapshot(state), target, step=step if type(step) is int else 0)

    def load_checkpoint(
        self, path: str | os.PathLike[str], map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint the stub at ``path`` names (``map_location`` as for ``torch.load``).

        ``weights_only`` is accepted for Lightning's sake and changes nothing: loading from
        cas_ckpt never runs code.
        """
        self.wait()
        stub = read_stub(path)
        state = self.repo.load(stub["cid"], map_location=map_location)
        if not isinstance(state, dict):
            raise CheckpointFileError(path, f"names {stub['cid']}, which is not a Lightning checkpoint")
        return state

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the stub (or any other file or folder) at ``path``; a stub's checkpoint loses its
        ref and, with ``gc_after_remove``, its blocks that no other checkpoint uses."""
        self._raise_failures()
        target = _local(path)
        if self.async_save:
            self._submit(self._remove, target, step=None)
        else:
            self._remove(target)

    def teardown(self) -> None:
        """Wait for background saves (raising a failure), then close a repository opened here."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._owned and self._repo is not None:
                self._repo.close()
                self._repo = None

    # -- beyond CheckpointIO -------------------------------------------------------------------
    def wait(self) -> None:
        """Block until every queued save and removal is done; raise the first failure."""
        with self._lock:
            pending = list(self._pending)
        for future, _ in pending:
            with contextlib.suppress(BaseException):
                future.result()
        self._raise_failures()

    def file_ref(self, path: str | os.PathLike[str]) -> str:
        """The ref that holds the checkpoint whose stub is at ``path``."""
        target = _local(path)
        name = re.sub(r"[^A-Za-z0-9._=+-]", "_", target.name).lstrip(".")[:100] or "checkpoint"
        digest = hashlib.sha256(os.fsencode(target)).hexdigest()[:12]
        return check_ref_name(f"{self.files_prefix}{name}-{digest}")

    # -- internals -----------------------------------------------------------------------------
    def _write(self, state: dict[str, Any], target: Path) -> None:
        step = state.get("global_step")
        step = step if type(step) is int and step >= 0 else None
        metadata = {"file": str(target), "epoch": state.get("epoch"), "global_step": step}
        cid = self.repo.save(state, ref=self.ref, step=step, metadata=plain(metadata))
        ref = self.file_ref(target)
        replaced = self.repo.refs_store.get(ref)
        self.repo.set_ref(ref, cid)  # blocks, then the ref, then the stub that names it
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, _stub_bytes(cid, ref, self.repo))
        if replaced not in (None, bytes(cid)):  # "last.ckpt" saved again: the old one is removed
            self._collect()

    def _remove(self, target: Path) -> None:
        if target.is_symlink():  # a "last" link: the checkpoint it points at stays
            target.unlink()
            return
        if not target.exists():
            return
        try:
            stub = read_stub(target)
        except CheckpointFileError:  # not ours: removed as Lightning's own CheckpointIO would
            shutil.rmtree(target) if target.is_dir() else target.unlink()
            return
        target.unlink()  # the stub first: a crash then leaks a ref, never leaves a dangling stub
        fsync_dir(target.parent)
        ref = stub["ref"]
        if ref.startswith(self.files_prefix) and self.repo.refs_store.get(ref) == bytes(stub["cid"]):
            self.repo.delete_ref(ref, expected=stub["cid"])
            self._collect()

    def _collect(self) -> None:
        """Free what removed checkpoints held; this plugin's refs' reflogs keep nothing."""
        if self.gc_after_remove:
            self.repo.gc(expire_reflogs=(self.ref, self.files_prefix))

    def _submit(self, fn: Any, *args: Any, step: int | None) -> None:
        """Queue a save (``step``) or a removal (None) behind the ones already queued."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="cas_ckpt-lightning")
            self._pending.append((self._executor.submit(fn, *args), step))

    def _raise_failures(self) -> None:
        """Raise (once) the first failure of a finished background save (as :class:`SaveFailed`)
        or removal (as it was raised)."""
        with self._lock:
            done = [p for p in self._pending if p[0].done()]
            self._pending = [p for p in self._pending if not p[0].done()]
        for future, step in done:
            error = future.exception()
            if error is not None:
                raise SaveFailed(self.ref, step, error) if step is not None else error


def _local(path: str | os.PathLike[str]) -> Path:
    text = os.fspath(path)
    if "://" in str(text):
        raise CheckpointFileError(text, "CasCheckpointIO writes its stubs to local paths only; "
                                        "put the repository itself on S3 instead")
    return Path(os.path.abspath(text))


def _stub_bytes(cid: CID, ref: str, repo: Repository) -> bytes:
    stub = {"format": STUB_FORMAT, "version": STUB_VERSION, "cid": str(cid), "ref": ref,
            "repository": repo.location}
    return (json.dumps(stub, indent=1) + "\n").encode()


def read_stub(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The stub at ``path`` (a link is followed): ``cid`` (a CID), ``ref``, ``repository``.

    Raises :class:`CheckpointFileError` naming the file if it is missing or not a stub.
    """
    target = Path(os.path.realpath(os.fspath(path)))
    try:
        with open(target, "rb") as f:
            data = f.read(_STUB_LIMIT + 1)
    except FileNotFoundError:
        raise CheckpointFileError(path, "no such checkpoint file") from None
    except IsADirectoryError:
        raise CheckpointFileError(path, "is a folder, not a cas_ckpt checkpoint stub") from None
    hint = " (a torch checkpoint? load it without CasCheckpointIO)" if data[:2] == b"PK" else ""
    try:
        stub = json.loads(data) if len(data) <= _STUB_LIMIT else None
    except ValueError:
        stub = None
    if not isinstance(stub, dict) or stub.get("format") != STUB_FORMAT:
        raise CheckpointFileError(path, f"is not a cas_ckpt checkpoint stub{hint}")
    if stub.get("version") != STUB_VERSION:
        raise CheckpointFileError(path, f"is a stub of version {stub.get('version')!r}; this "
                                        f"cas_ckpt reads version {STUB_VERSION}")
    try:
        stub["cid"] = CID.decode(stub["cid"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointFileError(path, f"holds no valid CID: {exc}") from None
    if not isinstance(stub.get("ref"), str):
        raise CheckpointFileError(path, "names no ref")
    return stub


for _other in _BASES[1:]:  # lightning.pytorch's Trainer checks isinstance against its own class
    _other.register(CasCheckpointIO)
