"""S3 and S3-compatible object stores: one bucket and key prefix, and the backend on top of it.

:class:`S3Bucket` is the client: retries, clear errors, conditional requests.
:class:`S3Backend` keeps packs as ``<prefix>packs/<name>`` objects (see ``docs/scale-out.md``).

boto3 is imported only when a bucket is opened (``pip install cas_ckpt[s3]``), never by ``import
cas_ckpt``. It honours the standard AWS variables (``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``,
``AWS_REGION``, ``AWS_ENDPOINT_URL``, ``AWS_MAX_ATTEMPTS``...). Transient failures (5xx, throttling,
timeouts, reset connections) are retried with bounded exponential backoff: botocore's "standard" mode
for requests, and here for response bodies cut short. Credential, permission and missing-bucket
errors become a :class:`RepositoryError` that says which. Conditional PUTs (``If-None-Match: *``
to create, ``If-Match`` to replace; on ``PutObject`` and ``CompleteMultipartUpload``) are what refs,
locks and packs rely on; a server that ignores them is refused unless the user opts into
``unsafe_no_conditional_writes``. No conditional DELETE is ever sent: many servers that honour
conditional PUTs ignore it (MinIO, LocalStack), so every delete here is one a race cannot undo.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import random
import shutil
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from cas_ckpt import _fs
from cas_ckpt.backends.base import Backend, ObjectInfo, Read, Sink
from cas_ckpt.backends.descriptors import OpenFiles
from cas_ckpt.errors import CorruptStore, RepositoryError

SCHEME = "s3://"
PART_SIZE = 32 * 1024 * 1024  # multipart part size; objects up to this size are one PUT
WORKERS = 16  # parallel requests per bucket (uploads, downloads, index reads)
MAX_ATTEMPTS = 6  # boto3 "standard" retries (5xx, throttling, connection errors), backoff <= 20 s
STREAM_ATTEMPTS = 4  # a response body cut short (reset, timeout) is fetched again this often
_CONFLICT = ("PreconditionFailed", "ConditionalRequestConflict")
CREATE_ATTEMPTS = 4  # creates refused while nothing holds the key, before put_file gives up
_ALIASES = {"404": "NoSuchKey", "NotFound": "NoSuchKey", "412": "PreconditionFailed"}


class Unsupported(RepositoryError):
    """The server does not implement a request cas_ckpt needs (e.g. conditional writes)."""


class Meta(NamedTuple):
    """One object: key (below the prefix), ETag, size and age (seconds, by the server's clock)."""

    key: str
    etag: str
    size: int
    age: float


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix/")`` (``""`` for the bucket's root)."""
    if not url.startswith(SCHEME):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, path = url[len(SCHEME) :].partition("/")
    if not bucket:
        raise RepositoryError(f"{url}: no bucket name (expected s3://BUCKET/PREFIX)")
    prefix = "/".join(part for part in path.split("/") if part)
    return bucket, prefix + "/" if prefix else ""


@functools.cache
def _loader() -> Any:
    """botocore's service-model loader, shared by every client: parsing the S3 model takes 0.1 s."""
    import botocore.loaders

    return botocore.loaders.create_loader()


def _make_client(endpoint_url: str | None, workers: int) -> Any:
    """A client with a fresh session (so credentials and settings are read from the environment now)."""
    import boto3
    import botocore
    import botocore.session
    from botocore.config import Config

    # Explicit retry settings would override AWS_MAX_ATTEMPTS / AWS_RETRY_MODE: leave those to the user.
    tuned = "AWS_MAX_ATTEMPTS" in os.environ or "AWS_RETRY_MODE" in os.environ
    retries = {} if tuned else {"retries": {"mode": "standard", "max_attempts": MAX_ATTEMPTS}}
    config = Config(
        connect_timeout=10, read_timeout=60, max_pool_connections=workers + 4, **retries
    )
    core = botocore.session.get_session()
    core.register_component("data_loader", _loader())
    session = boto3.session.Session(botocore_session=core)
    client = session.client("s3", endpoint_url=endpoint_url, config=config)
    complete = client.meta.service_model.operation_model("CompleteMultipartUpload").input_shape.members
    if "IfNoneMatch" not in complete:
        raise RepositoryError(
            f"botocore {botocore.__version__} cannot send conditional writes: pip install -U boto3"
        )
    return client


def _check_endpoint(endpoint: str, allow_http: bool) -> None:
    """Refuse plain http beyond this machine: credentials and data would cross the network in clear."""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme != "http" or allow_http:
        return
    host = parts.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise RepositoryError(
            f"refusing plain http to {endpoint}: use https, or pass allow_http=True to accept "
            "sending credentials and data unencrypted"
        )


def _code(exc: Any) -> str:
    error = exc.response.get("Error", {})
    code = str(error.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return _ALIASES.get(code, code)


def _server_now(response: dict[str, Any]) -> float:
    """The server's clock (its Date header): ages are judged on it, so local clock skew does not matter."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return parsedate_to_datetime(date).timestamp() if date else time.time()
    except (TypeError, ValueError):
        return time.time()


def _meta(key: str, response: dict[str, Any]) -> Meta:
    age = _server_now(response) - response["LastModified"].timestamp()
    return Meta(key, response["ETag"], response["ContentLength"], age)


def backoff(attempt: int) -> float:
    """Seconds to wait before attempt ``attempt + 1``: exponential, jittered, at most 2."""
    return min(2.0, 0.05 * 2 ** min(attempt, 6)) * (0.5 + random.random() / 2)


class _ShortRead(Exception):
    """A response body ended early."""


class S3Bucket:
    """One bucket and key prefix: the boto3 client, retries, error messages, conditional requests.

    Keys passed to the methods are relative to the prefix. With ``unsafe_no_conditional_writes`` the
    conditions are checked by a HEAD before the request instead (racy: see ``docs/scale-out.md``).
    """

    def __init__(
        self,
        url: str,
        *,
        client: Any = None,
        endpoint_url: str | None = None,
        allow_http: bool = False,
        unsafe_no_conditional_writes: bool = False,
        workers: int = WORKERS,
    ) -> None:
        self.bucket, self.prefix = parse_url(url)
        self.url = f"{SCHEME}{self.bucket}/{self.prefix}".rstrip("/")
        self.unsafe = unsafe_no_conditional_writes
        self.workers = workers
        self.client = client if client is not None else _make_client(endpoint_url, workers)
        self.endpoint = str(self.client.meta.endpoint_url)
        _check_endpoint(self.endpoint, allow_http)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._probed = False

    @property
    def pool(self) -> ThreadPoolExecutor:
        """Threads for parallel requests (they never wait on each other)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="cas_ckpt-s3")
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def where(self, key: str) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}{key}"

    # -- errors --------------------------------------------------------------------------------
    def _call(self, op: str, key: str, ok: tuple[str, ...] = (), **kwargs: Any) -> Any:
        """Run one client operation; return the error code instead of raising when it is in ``ok``."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, op)(Bucket=self.bucket, **kwargs)
        except ClientError as exc:
            code = _code(exc)
            if code in ok:
                return code
            raise self._client_error(exc, code, op, key) from exc
        except BotoCoreError as exc:
            raise self._transport_error(exc, op) from exc

    def _client_error(self, exc: Any, code: str, op: str, key: str) -> RepositoryError:
        detail = exc.response.get("Error", {}).get("Message") or code
        if code == "NoSuchBucket":
            return RepositoryError(
                f"S3 bucket {self.bucket!r} does not exist (endpoint {self.endpoint}): create it, "
                "or check the URL and AWS_ENDPOINT_URL"
            )
        if code == "InvalidAccessKeyId":
            return RepositoryError(
                f"S3 at {self.endpoint} does not know this access key (InvalidAccessKeyId): check "
                "AWS_ACCESS_KEY_ID or AWS_PROFILE"
            )
        if code == "SignatureDoesNotMatch":
            return RepositoryError(
                f"S3 at {self.endpoint} rejected the request signature (SignatureDoesNotMatch): "
                "check AWS_SECRET_ACCESS_KEY (and this machine's clock)"
            )
        if code in ("ExpiredToken", "InvalidToken", "TokenRefreshRequired", "ExpiredTokenException"):
            return RepositoryError(f"S3 credentials expired or invalid ({code}): refresh them")
        if code in ("AccessDenied", "AllAccessDisabled", "Forbidden", "403"):
            return RepositoryError(
                f"S3 denied {op} on {self.where(key)} ({code}: {detail}): the credentials need "
                "s3:ListBucket, GetObject, PutObject, DeleteObject and AbortMultipartUpload there"
            )
        if code in ("NotImplemented", "501"):
            return Unsupported(f"the S3 server at {self.endpoint} does not implement {op}: {detail}")
        return RepositoryError(f"S3 {op} on {self.where(key)} failed: {code}: {detail}")

    def _transport_error(self, exc: Exception, op: str) -> RepositoryError:
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError

        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return RepositoryError(
                "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                f"AWS_PROFILE ({exc})"
            )
        return RepositoryError(f"S3 {op} at {self.endpoint} failed after retries: {exc}")

    def _streamed(self, op: str, key: str, read: Callable[[], Any]) -> Any:
        """Run a request and read its body, again if the body is cut short (retries are bounded)."""
        from botocore.exceptions import BotoCoreError
        from urllib3.exceptions import HTTPError

        for attempt in range(STREAM_ATTEMPTS):
            try:
                return read()
            except (BotoCoreError, HTTPError, OSError, _ShortRead) as exc:
                if attempt == STREAM_ATTEMPTS - 1:
                    raise RepositoryError(
                        f"S3 {op} of {self.where(key)} kept failing while reading: {exc}"
                    ) from exc
                time.sleep(backoff(attempt))
        raise AssertionError("unreachable")

    # -- reads ---------------------------------------------------------------------------------
    def get(self, key: str) -> tuple[bytes, str] | None:
        """A whole (small) object and its ETag; None if absent."""
        found = self.get_meta(key)
        return None if found is None else (found[0], found[1].etag)

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        """``length`` bytes at ``offset`` (one ranged GET); None if the object is gone."""
        if length == 0:
            return b""

        def read() -> bytes | None:
            r = self._call("get_object", key, ok=("NoSuchKey",), Key=self.prefix + key,
                           Range=f"bytes={offset}-{offset + length - 1}")
            if isinstance(r, str):
                return None
            with contextlib.closing(r["Body"]) as body:  # closed on a short object too
                self._check_length(r, key, offset, length)
                data: bytes = body.read()
            if len(data) != length:
                raise _ShortRead(f"{len(data)} of {length} bytes")
            return data

        data: bytes | None = self._streamed("get_object", key, read)
        return data

    def read_into(self, key: str, offset: int, out: memoryview) -> bool:
        """Fill ``out`` from ``key`` at ``offset`` without an extra copy; False if the object is gone."""
        if out.nbytes == 0:
            return True

        def read() -> bool:
            r = self._call("get_object", key, ok=("NoSuchKey",), Key=self.prefix + key,
                           Range=f"bytes={offset}-{offset + out.nbytes - 1}")
            if isinstance(r, str):
                return False
            with contextlib.closing(r["Body"]) as body:  # closed on a short object too
                self._check_length(r, key, offset, out.nbytes)
                done = 0
                while done < out.nbytes:
                    n = body.readinto(out[done:])
                    if not n:
                        raise _ShortRead(f"{done} of {out.nbytes} bytes")
                    done += n
            return True

        done: bool = self._streamed("get_object", key, read)
        return done

    def _check_length(self, response: dict[str, Any], key: str, offset: int, length: int) -> None:
        if response.get("ContentLength") != length:
            raise CorruptStore(
                self.where(key), f"truncated: it holds fewer bytes than its index says ({length} at {offset})"
            )

    def head(self, key: str) -> Meta | None:
        r = self._call("head_object", key, ok=("NoSuchKey",), Key=self.prefix + key)
        if isinstance(r, str):
            return None
        return _meta(key, r)

    def get_meta(self, key: str) -> tuple[bytes, Meta] | None:
        """A whole (small) object with its ETag, size and age, in one GET; None if absent."""

        def read() -> tuple[bytes, Meta] | None:
            r = self._call("get_object", key, ok=("NoSuchKey",), Key=self.prefix + key)
            if isinstance(r, str):
                return None
            with contextlib.closing(r["Body"]) as body:
                return body.read(), _meta(key, r)

        result: tuple[bytes, Meta] | None = self._streamed("get_object", key, read)
        return result

    def list(
        self, prefix: str, *, delimiter: str | None = None, limit: int | None = None,
        start_after: str | None = None,
    ) -> list[Meta]:
        """Objects below ``prefix`` (direct children only with ``delimiter="/"``; at most ``limit``;
        only keys after ``start_after``, a key below the prefix too), in key order."""
        found = []
        extra: dict[str, Any] = {"Delimiter": delimiter} if delimiter else {}
        if limit is not None:
            extra["MaxKeys"] = limit
        if start_after is not None:
            extra["StartAfter"] = self.prefix + start_after
        token: dict[str, str] = {}
        while True:
            r = self._call("list_objects_v2", prefix, Prefix=self.prefix + prefix, **extra, **token)
            now = _server_now(r)
            for obj in r.get("Contents", []):
                key = obj["Key"][len(self.prefix) :]
                found.append(Meta(key, obj["ETag"], obj["Size"], now - obj["LastModified"].timestamp()))
            if not r.get("IsTruncated") or (limit is not None and len(found) >= limit):
                return found
            token = {"ContinuationToken": r["NextContinuationToken"]}

    def any(self, prefix: str) -> bool:
        """True if some object's key starts with ``prefix``."""
        return bool(self.list(prefix, limit=1))

    # -- writes --------------------------------------------------------------------------------
    def put(
        self, key: str, body: bytes | BinaryIO, *, create: bool = False, match: str | None = None
    ) -> str | None:
        """Write an object: only if absent (``create``) or only if its ETag is ``match``.

        Returns the new ETag, or None when the condition failed.
        """
        if self.unsafe and (create or match):
            current = self.head(key)
            if (create and current is not None) or (match and (current is None or current.etag != match)):
                return None
            create, match = False, None
        condition = {"IfNoneMatch": "*"} if create else {"IfMatch": match} if match else {}
        ok = (*_CONFLICT, "NoSuchKey") if condition else ()
        r = self._call("put_object", key, ok=ok, Key=self.prefix + key, Body=body, **condition)
        return None if isinstance(r, str) else str(r["ETag"])

    def delete(self, key: str) -> None:
        """Delete an object, unconditionally (an absent one counts as deleted): only for objects
        a race cannot bring back to life (garbage past its grace, a key only its deleter writes)."""
        self._call("delete_object", key, ok=("NoSuchKey",), Key=self.prefix + key)

    def delete_many(self, keys: list[str]) -> None:
        """Delete these objects (unconditionally), a thousand per request."""
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self.prefix + k} for k in keys[start : start + 1000]]
            r = self._call("delete_objects", keys[start], Delete={"Objects": batch, "Quiet": True})
            for error in r.get("Errors", []):
                if error.get("Code") != "NoSuchKey":
                    raise RepositoryError(
                        f"S3 could not delete {error.get('Key')}: {error.get('Code')}: "
                        f"{error.get('Message')}"
                    )

    def put_file(self, key: str, path: Path, *, part_size: int = PART_SIZE, create: bool = True) -> bool:
        """Write ``key`` from a file: one PUT, or parallel multipart parts.

        With ``create`` (the default) only if absent: returns False if the object already existed
        (nothing was written). Without it the object is replaced, atomically as S3 does.
        A create S3 refuses although no object is there when asked (a conflict with a concurrent
        writer of the key, or an object deleted since the refusal) is tried again: the key is
        free, as a local ``link`` would find it.
        """
        for _ in range(CREATE_ATTEMPTS):
            created = self._put_file_once(key, path, part_size, create)
            if created is not None:
                return created
        raise RepositoryError(f"S3 refused to create {self.where(key)} {CREATE_ATTEMPTS} times, "
                              "and it does not exist")

    def _put_file_once(self, key: str, path: Path, part_size: int, create: bool) -> bool | None:
        """:meth:`put_file`'s one attempt; None when a create was refused and nothing is there."""
        size = path.stat().st_size
        if size <= part_size:
            with open(path, "rb") as body:  # streamed (and rewound for a retry), not read whole
                return self._created(key, self.put(key, body, create=create))
        upload = self._call("create_multipart_upload", key, Key=self.prefix + key)["UploadId"]
        try:
            count = -(-size // part_size)
            futures = [
                self.pool.submit(self._upload_part, key, upload, n, path, part_size) for n in range(count)
            ]
            parts = [f.result() for f in futures]
            return self._complete(key, upload, parts, create=create)
        except BaseException:
            with contextlib.suppress(RepositoryError):
                self.abort_upload(key, upload)
            raise

    def _created(self, key: str, etag: str | None) -> bool | None:
        """True if written; else False if the object exists, None if it does not."""
        if etag is not None:
            return True
        return False if self.head(key) is not None else None

    def _upload_part(self, key: str, upload: str, n: int, path: Path, part_size: int) -> dict[str, Any]:
        with open(path, "rb") as f:
            f.seek(n * part_size)
            data = f.read(part_size)
        r = self._call("upload_part", key, Key=self.prefix + key, UploadId=upload, PartNumber=n + 1,
                       Body=data)
        return {"PartNumber": n + 1, "ETag": r["ETag"]}

    def _complete(self, key: str, upload: str, parts: list[dict[str, Any]], *, create: bool) -> bool | None:
        condition = {"IfNoneMatch": "*"} if create and not self.unsafe else {}
        if create and self.unsafe and self.head(key) is not None:
            self.abort_upload(key, upload)
            return False
        r = self._call("complete_multipart_upload", key, ok=(*_CONFLICT, "NoSuchUpload"),
                       Key=self.prefix + key, UploadId=upload, MultipartUpload={"Parts": parts},
                       **condition)
        if not isinstance(r, str):
            return True
        if r != "NoSuchUpload":  # it exists (False), or the create was refused with nothing there (None)
            with contextlib.suppress(RepositoryError):
                self.abort_upload(key, upload)
            return self._created(key, None)
        if self.head(key) is None:  # NoSuchUpload after a retry: did the first attempt land?
            raise RepositoryError(f"S3 lost the multipart upload of {self.where(key)}")
        return True

    def abort_upload(self, key: str, upload: str) -> None:
        self._call("abort_multipart_upload", key, ok=("NoSuchUpload",), Key=self.prefix + key,
                   UploadId=upload)

    def uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        """Unfinished multipart uploads below ``prefix``: (key, upload id, age in seconds)."""
        found = []
        token: dict[str, str] = {}
        while True:
            r = self._call("list_multipart_uploads", prefix, Prefix=self.prefix + prefix, **token)
            now = _server_now(r)
            for up in r.get("Uploads", []):
                age = now - up["Initiated"].timestamp()
                found.append((up["Key"][len(self.prefix) :], up["UploadId"], age))
            if not r.get("IsTruncated"):
                return found
            token = {"KeyMarker": r["NextKeyMarker"], "UploadIdMarker": r["NextUploadIdMarker"]}

    # -- conditional writes --------------------------------------------------------------------
    def check_conditional_writes(self) -> None:
        """Refuse to write (:class:`RepositoryError`) unless the server honours what cas_ckpt
        sends: ``If-None-Match: *`` and ``If-Match`` on PUT, and ``If-None-Match: *`` on
        CompleteMultipartUpload (a large pack's create); probed once per bucket object."""
        if self._probed or self.unsafe:
            return
        key = f"locks/probe-{uuid.uuid4().hex}"
        missing = []
        try:
            created = self.put(key, b"1", create=True)
            if created is None or self.put(key, b"2", create=True):
                missing.append("If-None-Match: * on PUT")
            if self.put(key, b"3", match='"00000000000000000000000000000000"'):
                missing.append("If-Match on PUT")
            if created is not None and self.put(key, b"4", match=created) is None:
                missing.append("If-Match on PUT (a matching ETag refused)")
            if self._multipart_creates(key):
                missing.append("If-None-Match: * on CompleteMultipartUpload")
        except Unsupported as exc:
            missing.append(str(exc))
        finally:
            with contextlib.suppress(RepositoryError):
                self.delete(key)  # a key of this probe's own
        if missing:
            raise RepositoryError(
                f"the S3 server at {self.endpoint} ignores conditional requests ({'; '.join(missing)}): "
                "refs and GC would not be safe there. Use a server that supports them, or pass "
                "unsafe_no_conditional_writes=True if only one process ever writes (docs/scale-out.md)"
            )
        self._probed = True

    def _multipart_creates(self, key: str) -> bool:
        """True if a multipart upload completed with ``If-None-Match: *`` over the existing ``key``
        (the server ignored the condition)."""
        upload = self._call("create_multipart_upload", key, Key=self.prefix + key)["UploadId"]
        try:
            r = self._call("upload_part", key, Key=self.prefix + key, UploadId=upload, PartNumber=1,
                           Body=b"5")
            done = self._call("complete_multipart_upload", key, ok=_CONFLICT, Key=self.prefix + key,
                              UploadId=upload, IfNoneMatch="*",
                              MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": r["ETag"]}]})
            return not isinstance(done, str)
        finally:
            with contextlib.suppress(RepositoryError):
                self.abort_upload(key, upload)


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------
# A pack is one PUT, and several upload while the next ones are written: on a moto server that
# saved 256 MiB in half the time 64 MiB packs sent as multipart uploads took (docs/performance.md).
PACK_SIZE = 16 * 1024 * 1024
PUBLISH_WORKERS = 4  # packs uploading at once: each is read into memory whole for its PUT
READ_SIZE = 16 * 1024 * 1024  # the most one ranged GET of neighbouring blocks fetches
DEFAULT_GRACE = 3600.0  # GC never removes a pack younger than this on S3
PACKS = "packs/"
SUFFIX = ".pack"
HAVE_LIMIT = 64 << 20  # a cache's list of held offsets: one short line per cached block


class PackCache:
    """Fetched bytes kept in sparse local copies of their packs: ``<root>/<pack name>``.

    ``<pack>.have`` lists the offsets held, one per line, appended after the bytes are written.
    Packs are named by their content, so one cache may serve several repositories and processes.
    Nothing in the folder is followed if it is a link, and the cache is only a shortcut: every
    block read from it is hash-checked like any other, and a failure there never fails a load.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        _fs.makedirs(self.root)
        self._have: dict[str, set[int]] = {}
        self._files = OpenFiles()  # a bounded number, none closed under a read or write
        self._lock = threading.Lock()

    def _offsets(self, pack: str) -> set[int]:
        have = self._have.get(pack)
        if have is None:
            try:
                text = _fs.read_small(self.root / f"{pack}.have", HAVE_LIMIT).decode("ascii")
            except (OSError, UnicodeDecodeError, CorruptStore):  # absent, or a planted link
                text = ""
            have = self._have[pack] = {int(x) for x in text.split() if x.isdigit()}
        return have

    def _open(self, pack: str, *, create: bool) -> contextlib.AbstractContextManager[int]:
        flags = os.O_RDWR | (os.O_CREAT if create else 0)  # a read never makes a dropped copy again
        return self._files.use(pack, lambda: _fs.open_nofollow(self.root / pack, flags))

    def read_into(self, pack: str, offset: int, out: memoryview, starts: list[int]) -> bool:
        """Fill ``out`` from ``offset`` if every block starting at ``starts`` is held."""
        try:
            with self._lock:
                have = self._offsets(pack)
                if not all(start in have for start in starts):
                    return False
            with self._open(pack, create=False) as fd:
                return _fs.pread_into(fd, out, offset) == out.nbytes
        except (OSError, CorruptStore):
            return False

    def write(self, pack: str, offset: int, data: memoryview, blocks: list[int]) -> None:
        """Keep ``data`` (from ``offset`` in ``pack``), holding the blocks starting at ``blocks``."""
        try:
            view = data.cast("B") if data.format != "B" else data
            with self._open(pack, create=True) as fd:
                while view.nbytes:
                    n = os.pwrite(fd, view, offset)
                    view, offset = view[n:], offset + n
            have = _fs.open_nofollow(self.root / f"{pack}.have", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                _fs.write_all(have, "".join(f"{o}\n" for o in blocks).encode("ascii"))
            finally:
                os.close(have)
        except (OSError, CorruptStore):
            return  # a full disk or a planted link must not fail a load
        with self._lock:
            self._offsets(pack).update(blocks)

    def forget(self, pack: str, offset: int) -> bool:
        """Stop trusting one block (its copy failed its hash); True if it was held."""
        with self._lock:
            have = self._offsets(pack)
            if offset not in have:
                return False
            have.discard(offset)
            return True

    def drop(self, pack: str) -> None:
        """Forget a pack that left the store."""
        with self._lock:
            self._have.pop(pack, None)
            self._files.forget(pack)  # a read or write using it right now keeps it until done
            for name in (pack, f"{pack}.have"):
                with contextlib.suppress(FileNotFoundError):
                    (self.root / name).unlink()

    def close(self) -> None:
        self._files.close()


class S3Sink(Sink):
    """A pack spooled to a private local temp file, uploaded whole when published."""

    def __init__(self, backend: S3Backend) -> None:
        self._backend = backend
        fd, name = tempfile.mkstemp(dir=backend.spool_dir, suffix=".pack.tmp")
        self._file: Any = os.fdopen(fd, "wb", buffering=1024 * 1024)
        self.path: Path | None = Path(name)

    def write(self, data: bytes | memoryview, *, keep: bool = False) -> None:
        self._file.write(data)

    def _sealed(self) -> Path:
        if not self._file.closed:
            self._file.close()
        assert self.path is not None, "sink is closed"
        return self.path

    def publish(self, name: str) -> bool:
        path = self._sealed()
        backend = self._backend
        if not backend.bucket.put_file(backend.folder + name, path, part_size=backend.part_size):
            return False
        self.abort()
        return True

    def replace(self, name: str) -> None:
        backend = self._backend
        backend.bucket.put_file(backend.folder + name, self._sealed(), part_size=backend.part_size,
                                create=False)
        self._backend.forget(name)
        self.abort()

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


class S3Backend(Backend):
    """Packs as ``<prefix>packs/<name>`` objects (a sibling's: ``<prefix><folder><name>``),
    created only if absent (``If-None-Match: *``).

    ``cache_dir`` keeps fetched bytes on local disk. GC never removes a pack younger than
    ``min_grace`` seconds by the server's clock: a writer on another machine cannot be locked out
    the way a local one is, so the grace covers a save that deduplicated against an old pack.
    """

    read_coalesce = READ_SIZE
    publish_in_background = True
    pack_size = PACK_SIZE
    publish_workers = PUBLISH_WORKERS
    cheap_listing = False

    def __init__(
        self,
        bucket: S3Bucket | str,
        *,
        read_only: bool = False,
        part_size: int = PART_SIZE,
        read_size: int = READ_SIZE,
        cache_dir: str | os.PathLike[str] | None = None,
        min_grace: float = DEFAULT_GRACE,
        folder: str = PACKS,
        suffix: str = SUFFIX,
        owner: S3Backend | None = None,
    ) -> None:
        super().__init__(read_only=read_only)
        self.bucket = bucket if isinstance(bucket, S3Bucket) else S3Bucket(bucket)
        self.folder, self.suffix = folder, suffix
        self._owner = owner  # a sibling shares its owner's bucket and spool, and closes neither
        if not read_only:
            self.bucket.check_conditional_writes()
        self.part_size = part_size
        self.read_coalesce = read_size
        self.min_grace = min_grace
        self.cache = PackCache(cache_dir) if cache_dir is not None else None
        self._spool: Path | None = None
        self._lock = threading.Lock()

    @property
    def spool_dir(self) -> Path:
        """A private temp folder for packs on their way up (made on first use, like mkdtemp)."""
        if self._owner is not None:
            return self._owner.spool_dir
        with self._lock:
            if self._spool is None:
                self._spool = Path(tempfile.mkdtemp(prefix="cas_ckpt-s3-"))
            return self._spool

    def describe(self) -> str:
        return self.bucket.url

    def where(self, name: str) -> str:
        return self.bucket.where(self.folder + name)

    def list(self) -> list[ObjectInfo]:
        return self._listed(self.bucket.list(self.folder))

    def list_after(self, start: str) -> list[ObjectInfo]:
        return self._listed(self.bucket.list(self.folder, start_after=self.folder + start))

    def _listed(self, metas: list[Meta]) -> list[ObjectInfo]:
        found = []
        for meta in metas:
            name = meta.key[len(self.folder) :]
            if "/" not in name and name.endswith(self.suffix):
                found.append(ObjectInfo(name, meta.size, meta.age))
        return found

    def read_into(self, name: str, offset: int, out: memoryview) -> bool:
        return self._read_run(Read(name, offset, out, [offset]))

    def read_many(self, reads: list[Read]) -> list[bool | CorruptStore]:
        return list(self.bucket.pool.map(self._read_one, reads))

    def _read_one(self, read: Read) -> bool | CorruptStore:
        try:
            return self._read_run(read)
        except CorruptStore as exc:
            return exc

    def _read_run(self, read: Read) -> bool:
        name, offset, out, starts = read
        cache = self.cache if starts else None  # only blocks are cached (not indexes, headers)
        if cache is not None and cache.read_into(name, offset, out, starts):
            return True
        if not self.bucket.read_into(self.folder + name, offset, out):
            return False
        if cache is not None:
            cache.write(name, offset, out, starts)
        return True

    def discard_cached(self, name: str, offset: int) -> bool:
        return self.cache is not None and self.cache.forget(name, offset)

    def forget(self, name: str) -> None:
        if self.cache is not None:
            self.cache.drop(name)

    def sibling(self, directory: str, suffix: str) -> S3Backend:
        """Objects under ``<prefix><directory>/`` named ``*<suffix>``, through this backend's
        bucket, client and spool folder (not cached: only packs hold blocks)."""
        return S3Backend(self.bucket, read_only=self.read_only, part_size=self.part_size,
                         read_size=self.read_coalesce, min_grace=self.min_grace,
                         folder=f"{directory}/", suffix=suffix, owner=self)

    def create(self) -> S3Sink:
        return S3Sink(self)

    def delete(self, name: str) -> None:
        self.bucket.delete_many([self.folder + name])
        self.forget(name)

    def clean_temp(self, min_age: float) -> int:
        """Abort multipart uploads older than the grace period (left by writers that died)."""
        removed = 0
        for key, upload, age in self.bucket.uploads(self.folder):
            if age >= max(min_age, self.min_grace):
                self.bucket.abort_upload(key, upload)
                removed += 1
        return removed

    def close(self) -> None:
        if self._owner is not None:  # a sibling shares its owner's bucket and spool
            return
        self.bucket.close()
        if self.cache is not None:
            self.cache.close()
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)
