"""Blocks from an HTTP server that speaks the IPFS trustless gateway protocol, each verified.

A block is ``GET /ipfs/{cid}?format=raw`` with ``Accept: application/vnd.ipld.raw`` (the spec's
block request; ``cas-ckpt serve`` and any public trustless gateway answer it), and its size a
``HEAD`` of the same. Nothing from the network is used before it hashes to its CID, whatever
``verify`` says: an answer that does not (wrong bytes, a body cut short, the wrong content type)
is asked for again a bounded number of times, then refused with a :class:`RemoteError` naming the
CID and the URL. Reads of many blocks run in parallel on the remote's own threads, each block
read straight into its place in the caller's buffer.

With a ``cache`` (a local block store), verified blocks are kept there, gathered into packs, so
a second load of the same checkpoint reads the local disk only.

Opened for writing (``read_only=False``), a batch of blocks is pushed to a ``cas-ckpt serve
--write-token`` server (:class:`HttpBlockWriter`): the server is asked which blocks it lacks,
a few thousand CIDs a request, and the batch streams to it as one CAR v1 upload that the server
hashes and makes durable before it answers (``docs/format.md``, "Pushing over HTTP").
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from typing import Any

from cas_ckpt import cid as cidlib
from cas_ckpt.backends.http import BadAnswer, HttpRemote, OtherSize
from cas_ckpt.blocks.base import BlockStore, BlockWriter, Stored
from cas_ckpt.carv1 import car_header, section_prefix
from cas_ckpt.errors import BlockNotFound, CorruptBlock, RemoteError, RepositoryError

RAW = "application/vnd.ipld.raw"
MAX_BLOCK = 2 * 1024 * 1024  # the trustless gateway spec's block limit; cas_ckpt's are 1 MiB
CACHE_FLUSH = 32 * 1024 * 1024  # cached blocks are committed (as one pack) past this many bytes
CAR = "application/vnd.ipld.car"
MAX_QUERY = 16384  # CIDs one "which are missing" request asks about (the server's bound)
UPLOAD_QUEUE = 32  # blocks waiting for the upload's socket (at most ~32 MiB held)


def block_path(cid: bytes) -> str:
    return f"/ipfs/{cidlib.to_str(cid)}?format=raw"


class HttpBlockStore(BlockStore):
    """Read-only blocks of a trustless gateway at ``remote`` (see the module docstring).

    ``cache``: a local block store that keeps what was fetched; ``verify`` applies to reads from
    it (the network's answers are always verified).
    """

    sizes_known = False  # a HEAD each: loads take an array's chunk sizes from its node

    def __init__(self, remote: HttpRemote, *, verify: bool = True, cache: BlockStore | None = None,
                 read_only: bool = True) -> None:
        super().__init__(verify=verify, read_only=read_only)
        self.remote = remote
        self.cache = cache
        self._sizes: dict[bytes, int] = {}
        self._cache_lock = threading.Lock()
        self._cache_writer: BlockWriter | None = None
        self._cache_bytes = 0

    def __repr__(self) -> str:
        return f"<HttpBlockStore {self.remote.url}>"

    # -- reads ---------------------------------------------------------------------------------
    def _fetch(self, cid: bytes, out: memoryview | None = None) -> bytes | memoryview | None:
        """The block from the network, verified; None if the server does not have it."""

        def check(body: Any) -> None:
            if not cidlib.matches(cid, body):
                raise BadAnswer("the bytes do not hash to the CID")

        try:
            data = self.remote.get(block_path(cid), accept=RAW, expect_type=RAW, into=out,
                                   limit=MAX_BLOCK, check=check, cid=cidlib.to_str(cid))
        except OtherSize as exc:  # the right block, not the size its parent said
            assert out is not None
            self._sizes[cid] = exc.size
            raise CorruptBlock(cidlib.to_str(cid), f"size {exc.size} != expected {out.nbytes}") from None
        if data is not None:
            self._sizes[cid] = memoryview(data).nbytes
            self._keep(cid, data)
        return data

    def _cached(self, cid: bytes, out: memoryview | None, verify: bool) -> bytes | memoryview | None:
        """The block from the cache (checked if ``verify``), or None."""
        if self.cache is None or not self.cache.has(cid):
            return None
        try:
            if out is None:
                return self.cache.get(cid, verify=verify)
            self.cache.get_into(cid, out, verify=verify)
            return out
        except (BlockNotFound, CorruptBlock):
            return None  # a damaged cached copy is fetched again

    def _read(self, cid: bytes) -> bytes | None:
        data = self._cached(cid, None, self.verify)
        data = data if data is not None else self._fetch(cid)
        return None if data is None else bytes(data)

    def get(self, cid: cidlib.CIDLike, *, verify: bool | None = None) -> bytes:
        key = cidlib.to_bytes(cid)
        data = self._cached(key, None, self.verify if verify is None else verify)
        if data is None:
            data = self._fetch(key)
        if data is None:
            raise BlockNotFound(cidlib.to_str(key), f" at {self.remote.url}")
        return bytes(data)

    def get_into(self, cid: bytes, out: memoryview, *, verify: bool | None = None) -> None:
        if self._cached(cid, out, self.verify if verify is None else verify) is not None:
            return
        known = self._sizes.get(cid)
        if known is not None and known != out.nbytes:
            raise CorruptBlock(cidlib.to_str(cid), f"size {known} != expected {out.nbytes}")
        if self._fetch(cid, out) is None:
            raise BlockNotFound(cidlib.to_str(cid), f" at {self.remote.url}")

    def get_many_into(
        self, cids: list[bytes], sizes: list[int], out: memoryview, pool: Executor, *,
        verify: bool | None = None,
    ) -> None:
        """Fetch in parallel on the remote's threads (``pool`` is the caller's CPU pool)."""
        offsets = [0, *itertools.accumulate(sizes)]

        def read(i: int) -> None:
            self.get_into(cids[i], out[offsets[i] : offsets[i + 1]], verify=verify)

        try:
            if len(cids) == 1:
                read(0)
            else:
                for future in [self.remote.pool.submit(read, i) for i in range(len(cids))]:
                    future.result()
        finally:
            self.flush_cache()

    def _has(self, cid: bytes) -> bool:
        if cid in self._sizes or (self.cache is not None and self.cache.has(cid)):
            return True
        return self._head(cid) is not None

    def _head(self, cid: bytes) -> int | None:
        """The block's size from a HEAD request (None: absent); a GET where no length is given."""
        headers = self.remote.head(block_path(cid), accept=RAW, cid=cidlib.to_str(cid))
        if headers is None:
            return None
        length = headers.get("content-length", "")
        if length.isdigit():
            self._sizes[cid] = int(length)
            return int(length)
        data = self._fetch(cid)
        return None if data is None else memoryview(data).nbytes

    def _size(self, cid: bytes) -> int:
        size = self._sizes.get(cid)
        if size is None and self.cache is not None and self.cache.has(cid):
            size = self.cache.size(cid)
        if size is None:
            size = self._head(cid)
        if size is None:
            raise BlockNotFound(cidlib.to_str(cid), f" at {self.remote.url}")
        return size

    def sizes(self, cids: list[bytes]) -> list[int]:
        """Sizes of many blocks, the unknown ones asked for in parallel."""
        unknown = [c for c in dict.fromkeys(cids) if c not in self._sizes]
        if len(unknown) > 1:
            list(self.remote.pool.map(self._size, unknown))
        return [self._size(c) for c in cids]

    def keys(self) -> Iterator[bytes]:
        raise RepositoryError(
            f"{self.remote.url} serves blocks by CID and cannot list them: give a full CID or a ref"
        )

    # -- the cache -----------------------------------------------------------------------------
    def _keep(self, cid: bytes, data: bytes | memoryview) -> None:
        """Add a verified block to the cache's pending pack."""
        if self.cache is None:
            return
        with self._cache_lock:
            if self._cache_writer is None:
                self._cache_writer = self.cache.writer()
            self._cache_writer.put(cid, data)
            self._cache_bytes += memoryview(data).nbytes
            full = self._cache_bytes >= CACHE_FLUSH
        if full:
            self.flush_cache()

    def flush_cache(self) -> None:
        """Commit the blocks fetched since the last flush into the cache (one pack)."""
        with self._cache_lock:
            writer, self._cache_writer, self._cache_bytes = self._cache_writer, None, 0
            if writer is not None:
                try:
                    writer.commit()
                except OSError:
                    writer.abort()  # a full or unwritable cache never fails a read

    # -- writes: pushes ------------------------------------------------------------------------
    def writer(
        self, *, verify_existing: bool = False, verify_incoming: bool = False, compression: str = "none"
    ) -> BlockWriter:
        if self.read_only:
            raise RepositoryError(f"{self.remote.url} was opened read-only: blocks cannot be written")
        return HttpBlockWriter(self, verify_incoming=verify_incoming)

    def delete(
        self, cids: set[bytes], *, min_age: float = 0.0, before_unlink: Callable[[], None] | None = None
    ) -> tuple[int, int]:
        raise RepositoryError(f"blocks of {self.remote.url} cannot be deleted over HTTP: run gc on the "
                              "server's repository")

    def close(self) -> None:
        self.flush_cache()
        if self.cache is not None:
            self.cache.close()
        self.remote.close()



_END = object()  # the upload's last block was queued
_ABORT = object()  # the batch was aborted: cut the upload short


class _Aborted(Exception):
    pass


class HttpBlockWriter(BlockWriter):
    """A batch of blocks pushed to ``cas-ckpt serve --write-token``.

    ``has``/``has_many`` ask the server (answers kept for the batch); each new block joins a
    CAR v1 stream sent as one request on a thread of its own, at most :data:`UPLOAD_QUEUE` blocks
    ahead of the socket. ``commit`` ends the stream and returns once the server answered that
    every block is durable; ``abort`` cuts it, and the server publishes nothing of it.
    """

    def __init__(self, store: HttpBlockStore, *, verify_incoming: bool = False) -> None:
        super().__init__(store, verify_incoming=verify_incoming)
        self.remote = store.remote
        self._known: dict[bytes, bool] = {}  # the server's answers: True where it has the block
        self._queue: queue.Queue[Any] = queue.Queue(UPLOAD_QUEUE)
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self.max_upload: int | None = None  # the server's bound on one push, once it said
        self._sent = 0  # bytes of the CAR stream queued so far

    # -- what the server has ---------------------------------------------------------------------
    def _ask(self, cids: Sequence[bytes]) -> None:
        unknown = [c for c in dict.fromkeys(cids) if c not in self._known]
        for start in range(0, len(unknown), MAX_QUERY):
            batch = unknown[start : start + MAX_QUERY]
            status, answer = self.remote.post_json("/api/v0/blocks/missing",
                                                   {"cids": [cidlib.to_str(c) for c in batch]})
            if status == 404:
                raise RemoteError(self.remote.url, "this server takes no pushes (cas-ckpt serve of "
                                  "cas_ckpt 0.3 or later, started with --write-token, does)")
            if not isinstance(answer, dict) or not isinstance(answer.get("missing"), list):
                raise RemoteError(self.remote.url, f"answered {answer!r} to a missing-blocks query")
            missing = set(answer["missing"])
            limit = answer.get("max_upload")
            self.max_upload = limit if isinstance(limit, int) else self.max_upload
            self._known.update((c, cidlib.to_str(c) not in missing) for c in batch)

    def _stored(self, cid: bytes) -> bool:
        if cid not in self._known:
            self._ask([cid])
        return self._known[cid]

    def _stored_many(self, cids: list[bytes]) -> list[bool]:
        self._ask(cids)
        return [self._known[c] for c in cids]

    def _all_stored(self, cids: list[bytes]) -> bool:
        return all(self._stored_many(cids))

    # -- the upload ------------------------------------------------------------------------------
    def _append(self, cid: bytes, stored: Stored, size: int, keep: bool = False) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._upload, args=(cid,), name="cas_ckpt-push",
                                            daemon=True)
            self._thread.start()
        data = bytes(stored.data)  # the caller's buffer is its own again when put returns
        section = section_prefix(cid, data) + data
        self._sent += len(section)
        if self.max_upload is not None and self._sent > self.max_upload:
            raise RemoteError(self.remote.url, f"this push would send over {self.max_upload} bytes, the "
                              "most the server takes at once (cas-ckpt serve --max-upload); nothing moved")
        self._put(section)
        self._known[cid] = False  # on its way: not the server's until the commit

    def _put(self, item: Any) -> None:
        while True:
            if self._failure is not None:
                raise RemoteError(self.remote.url, f"the push failed: {self._failure}")
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def _upload(self, root: bytes) -> None:
        def body() -> Iterator[bytes]:
            yield car_header([root])  # the roots say nothing: the server checks what refs need
            while (item := self._queue.get()) is not _END:
                if item is _ABORT:
                    raise _Aborted
                yield item

        try:
            status, answer = self.remote.post_stream("/api/v0/blocks", body(), content_type=CAR)
            if status == 404:
                raise RemoteError(self.remote.url, "this server takes no pushes")
            if not isinstance(answer, dict) or "blocks" not in answer:
                raise RemoteError(self.remote.url, f"answered {answer!r} to an upload")
        except BaseException as exc:  # handed to the writer's thread
            self._failure = exc
            while True:  # whatever was queued is dropped: nothing waits on a full queue
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break

    def commit(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        if self._thread is not None:
            self._put(_END)
            self._thread.join()
            if self._failure is not None:
                raise RemoteError(self.remote.url, f"the push failed: {self._failure}") \
                    if not isinstance(self._failure, RemoteError) else self._failure

    def abort(self) -> None:
        with self._lock:
            self.closed = True
        if self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(RemoteError):  # it failed already: nothing to cut
                self._put(_ABORT)
            self._thread.join()
