"""The exception hierarchy. Every error cas_ckpt raises on purpose derives from CasCkptError.

Errors carry the CID, ref, file or state path they concern as attributes, and name it in the message.
Lookup failures also subclass KeyError and parse failures ValueError, so generic handlers still work.
"""

from __future__ import annotations

import difflib
from typing import Any, Self

__all__ = [
    "AmbiguousCID",
    "AmbiguousPath",
    "AncestorNotFound",
    "BlockNotFound",
    "BlockTooLarge",
    "CarError",
    "CasCkptError",
    "CheckpointExists",
    "CheckpointExpired",
    "CheckpointFileError",
    "CorruptBlock",
    "CorruptStore",
    "DecodeError",
    "ExpansionLimit",
    "GraphCycleError",
    "InvalidCID",
    "InvalidRefName",
    "LeaseHeld",
    "MapLocationError",
    "MediumError",
    "OutOfMemory",
    "PathNotFound",
    "RefConflict",
    "RefDiverged",
    "RefError",
    "RefLocked",
    "RefNotFound",
    "RemoteError",
    "ReplicationFailed",
    "RepositoryError",
    "SafetensorsError",
    "SaveFailed",
    "StateTypeError",
    "StepNotFound",
    "StepTargetNotFound",
    "UnknownMetric",
]


class CasCkptError(Exception):
    """Base of every cas_ckpt error."""

    def __str__(self) -> str:
        # KeyError.__str__ quotes its argument; the messages here are sentences.
        return str(self.args[0]) if self.args else self.__class__.__name__


class InvalidCID(CasCkptError, ValueError):
    """A CID failed strict parsing (wrong version, codec, hash, digest length, trailing bytes)."""


class AmbiguousCID(InvalidCID):
    """A CID prefix matches more than one stored node; the message lists the candidates."""

    def __init__(self, prefix: str, candidates: list[str]) -> None:
        shown = ", ".join(candidates[:10]) + (", ..." if len(candidates) > 10 else "")
        super().__init__(f"CID prefix {prefix!r} is ambiguous: {len(candidates)} candidates: {shown}")
        self.prefix = prefix
        self.candidates = candidates


class _PathInState:
    """An error a load names the place of inside the state (``path``), one level at a time."""

    path: str

    def inside(self, key: object) -> Self:
        """Put ``key`` in front of the path (the reader adds each level on the way out)."""
        self.path = f"{key}.{self.path}" if self.path else str(key)
        return self


class DecodeError(_PathInState, CasCkptError, ValueError):
    """A stored node could not be decoded: malformed msgpack, unknown type, or over a limit.

    Names the node (``cid``) and, from a load, the path of the malformed value inside the state
    (``path``, added one level at a time on the way out, like :class:`MapLocationError`'s).
    """

    def __init__(self, message: str, *, cid: str | None = None, path: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.cid = cid
        self.path = path

    def __str__(self) -> str:
        text = f"{self.path}: {self.message}" if self.path else self.message
        return f"{text} (block {self.cid})" if self.cid else text

    def __reduce__(self) -> tuple[Any, ...]:  # a copy from another process keeps every field
        return (_decode_error, (self.message, self.cid, self.path))


def _decode_error(message: str, cid: str | None, path: str) -> DecodeError:
    return DecodeError(message, cid=cid, path=path)


class ExpansionLimit(DecodeError):
    """A tree expands to far more than it is stored in: its nodes or pages are linked so many
    times that reading would multiply them (a decompression bomb; ``docs/format.md``, "Reading a
    tree"). Names the node (``cid``) and the path inside the state; ``expanded`` and ``stored``
    are the bytes of nodes used and read, ``floor`` the limit's floor."""

    def __init__(self, expanded: int, stored: int, floor: int, cid: str | None, path: str = "") -> None:
        super().__init__(
            f"the tree expands to over {expanded} bytes of nodes from {stored} bytes stored (a node "
            f"or page linked that many times; at most max({floor}, 4 x stored) is read): set "
            "CAS_CKPT_MAX_EXPANSION to a byte count to read more", cid=cid, path=path)
        self.expanded = expanded
        self.stored = stored
        self.floor = floor

    def __reduce__(self) -> tuple[Any, ...]:
        return (_expansion_limit, (self.expanded, self.stored, self.floor, self.cid, self.path))


def _expansion_limit(expanded: int, stored: int, floor: int, cid: str | None, path: str) -> ExpansionLimit:
    return ExpansionLimit(expanded, stored, floor, cid, path)


class OutOfMemory(CasCkptError, MemoryError):
    """Loading needs more memory than the process can get; names the size and what needed it.

    Chunks are deduplicated, so a small node can rightly declare a huge value (a zero tensor is one
    chunk repeated), and a hostile one can declare terabytes. Reads check every declared size
    against the stored sizes, then allocate; a failed allocation is this error (also a MemoryError).
    """


class BlockNotFound(CasCkptError, KeyError):
    """No block with this CID is in the store."""

    def __init__(self, cid: object, hint: str = "") -> None:
        super().__init__(f"block {cid} not found{hint}")
        self.cid = str(cid)


class BlockTooLarge(CasCkptError, ValueError):
    """A block is larger than any reader accepts (``docs/format.md``, "Block sizes"): refused
    before it is stored. ``cid``, ``size`` and ``limit`` say which, how large, and the bound."""

    def __init__(self, cid: object, kind: str, size: int, limit: int) -> None:
        super().__init__(f"block {cid} is a {kind} of {size} bytes; a {kind} holds at most {limit} "
                         "(docs/format.md, \"Block sizes\")")
        self.cid = str(cid)
        self.size = size
        self.limit = limit


class CorruptBlock(CasCkptError):
    """A block's bytes do not hash to its CID."""

    def __init__(self, cid: object, detail: str = "content does not match its hash") -> None:
        super().__init__(f"corrupt block {cid}: {detail}")
        self.cid = str(cid)


class CorruptStore(CasCkptError):
    """A store file (pack, index, ref, reflog, config) is damaged."""

    def __init__(self, path: object, detail: str) -> None:
        super().__init__(f"corrupt {path}: {detail}")
        self.path = str(path)


class RepositoryError(CasCkptError):
    """The repository cannot be opened or used as asked (missing, newer format, read-only...)."""


class MediumError(RepositoryError, OSError):
    """The medium refused or failed an operation: permission denied, disk full, I/O error...

    An :class:`OSError` too, with ``errno`` and ``filename`` of the failure, so handlers of either
    kind catch it; the message names the repository and the file.
    """

    def __init__(self, where: object, exc: OSError) -> None:
        OSError.__init__(self, exc.errno, exc.strerror or str(exc), exc.filename)
        self.message = f"{where}: {exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")

    def __str__(self) -> str:
        return self.message


class RemoteError(RepositoryError):
    """A remote server (an HTTP gateway) failed, or answered with something other than what was
    asked for (bytes that do not hash to the CID, a body cut short, the wrong content type), after
    bounded retries. Names the CID (when a block was asked for) and the URL."""

    def __init__(self, url: str, detail: str, *, cid: str | None = None) -> None:
        what = f"block {cid} from {url}" if cid else url
        super().__init__(f"{what}: {detail}")
        self.url = url
        self.cid = cid


class RefError(CasCkptError):
    """Base of ref errors."""


class InvalidRefName(RefError, ValueError):
    """A ref name is not acceptable (empty segment, '..', absolute, control characters...)."""

    def __init__(self, name: object, reason: str) -> None:
        super().__init__(f"invalid ref name {name!r}: {reason}")
        self.ref = name


class RefNotFound(RefError, KeyError):
    """The ref does not exist (nor a reflog of it). Given the refs that do exist (``existing``),
    the message names them: the nearest to ``name`` first (a typo?), at most ten."""

    SHOWN = 10

    def __init__(self, name: str, existing: list[str] | None = None) -> None:
        super().__init__(f"ref {name!r} not found{_refs_hint(name, existing)}")
        self.ref = name
        self.existing = existing


def _refs_hint(name: str, existing: list[str] | None) -> str:
    if existing is None:
        return ""
    if not existing:
        return "; the repository has no refs"
    close = difflib.get_close_matches(name, existing, n=3, cutoff=0.7)
    if len(existing) <= 1000:  # the nearest first; past that, by name (a ratio each costs)
        ordered = sorted(existing, key=lambda ref: (-difflib.SequenceMatcher(None, name, ref).ratio(), ref))
    else:
        ordered = [*close, *sorted(set(existing) - set(close))]
    shown = ordered[: RefNotFound.SHOWN]
    more = len(ordered) - len(shown)
    listed = ", ".join(shown) + (f" and {more} more" if more else "")
    guess = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return f"{guess} (refs here: {listed})"


class AncestorNotFound(RefNotFound):
    """``REF~N`` names an ancestor older than the first-parent history that is stored."""

    def __init__(self, target: str, depth: int) -> None:
        RefError.__init__(self, f"{target!r} not found: its first-parent history stops after "
                                f"{depth} ancestor(s)")
        self.ref = target


class ReflogEntryNotFound(RefNotFound):
    """``REF@{N}`` names a reflog entry the ref does not have, or one that deleted the ref."""

    def __init__(self, target: str, reason: str) -> None:
        RefError.__init__(self, f"{target!r} not found: {reason}")
        self.ref = target


class StepTargetNotFound(RefNotFound):
    """``REF@STEP`` names a step the run holds no checkpoint of: no ``REF.steps/N`` ref, and no
    commit at that step in the stored first-parent history of ``REF``."""

    def __init__(self, target: str, reason: str) -> None:
        RefError.__init__(self, f"{target!r} not found: {reason}")
        self.ref = target


class RefConflict(RefError):
    """A compare-and-swap on a ref lost: the ref no longer holds the expected value."""

    def __init__(self, name: str, expected: object, actual: object) -> None:
        super().__init__(
            f"ref {name!r} changed concurrently: expected {expected or 'no ref'}, "
            f"found {actual or 'no ref'}; nothing was lost, reload and retry"
        )
        self.ref = name
        self.expected = expected
        self.actual = actual


class RefDiverged(RefConflict):
    """A push or pull would lose history: the ref on the other side holds a commit that is not an
    ancestor of the one sent (git's non-fast-forward). Pull (or push) first, or pass ``force``."""

    def __init__(self, name: str, where: str, actual: str, new: str) -> None:
        RefError.__init__(
            self,
            f"ref {name!r} in {where} holds {actual}, which is not an ancestor of {new}: sending "
            "it would drop that history; pull first, or force (nothing was sent)",
        )
        self.ref = name
        self.expected = None
        self.actual = actual
        self.new = new


class RefLocked(RefError):
    """The ref's lock is held by someone else and did not free up in time."""

    def __init__(self, name: str, lock_path: str, holder: str) -> None:
        super().__init__(
            f"ref {name!r} is locked by {holder} (a lock on {lock_path}, which the system "
            "frees when its holder exits: do not delete the file)"
        )
        self.ref = name
        self.lock_path = lock_path


class LeaseHeld(RefError):
    """Another writer holds the lease on this run's ref; ``holder`` says who (host, pid, since)."""

    def __init__(self, name: str, holder: str) -> None:
        super().__init__(
            f"ref {name!r} is being written by {holder}: one writer per run. Close that one first, "
            "or pass takeover=True if it is hung or gone (it then fails at its next save)"
        )
        self.ref = name
        self.holder = holder


class CheckpointExpired(CasCkptError):
    """A commit is still in the history but its data was removed by retention and GC."""

    def __init__(self, cid: object, missing: object = None) -> None:
        super().__init__(
            f"checkpoint {cid} is in the history but its data was garbage collected "
            f"(block {missing} is gone)"
            if missing is not None
            else f"checkpoint {cid} is in the history but retention expired it"
        )
        self.cid = str(cid)
        self.missing = None if missing is None else str(missing)


class StateTypeError(CasCkptError, TypeError):
    """A value in the state cannot be saved; names the path inside the state."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path or '<root>'}: {message}")
        self.path = path


class PathNotFound(CasCkptError, KeyError):
    """A sub-tree path given to load() does not exist in the checkpoint.

    ``path``: the path up to the first part that is missing; ``found``: the deepest prefix that
    exists ("" for the root); ``suggestions``: close existing paths (misspellings).
    """

    def __init__(
        self, path: str, cid: object, *, found: str = "", detail: str = "",
        suggestions: list[str] | None = None,
    ) -> None:
        message = f"path {path!r} not found in checkpoint {cid}"
        if detail:
            message += f": {detail}"
        if suggestions:
            message += f"; did you mean {' or '.join(map(repr, suggestions))}?"
        super().__init__(message)
        self.path = path
        self.cid = str(cid)
        self.found = found
        self.suggestions = suggestions or []


class AmbiguousPath(CasCkptError, ValueError):
    """A dotted path reads two ways in a checkpoint (its keys hold dots); ``readings`` lists them.

    A sequence of keys (``path=["model", "layer"]``) names one value; a path ending in ``.``
    (``"model.layer."``) only the keys under that prefix.
    """

    def __init__(self, path: str, cid: object, readings: list[str]) -> None:
        super().__init__(
            f"path {path!r} is ambiguous in checkpoint {cid}: it names {' and '.join(readings)}; "
            f"pass the keys as a list for one value, or end the path with '.' for the keys under "
            "the prefix"
        )
        self.path = path
        self.cid = str(cid)
        self.readings = readings


class CarError(CasCkptError, ValueError):
    """A CAR file is malformed, truncated, or holds corrupt, missing, duplicate or stray blocks."""

    def __init__(self, message: str, *, offset: int | None = None) -> None:
        super().__init__(f"{message} (at byte {offset})" if offset is not None else message)
        self.offset = offset


class SafetensorsError(CasCkptError, ValueError):
    """A safetensors file or model folder is malformed, or a checkpoint does not fit the format."""

    def __init__(self, file: str, message: str, *, tensor: str | None = None) -> None:
        where = f"{file}: tensor {tensor!r}" if tensor is not None else file
        super().__init__(f"{where}: {message}")
        self.file = file
        self.tensor = tensor


class CheckpointExists(CasCkptError):
    """A checkpoint manager already holds this step; pass ``overwrite=True`` to replace it."""

    def __init__(self, ref: str, step: int, *, latest: int | None = None) -> None:
        super().__init__(
            f"{ref!r} already has a checkpoint for step {step}; pass overwrite=True"
            if latest is None or latest == step
            else f"step {step} is not after {ref!r}'s latest checkpoint (step {latest}); "
            "pass overwrite=True to save it anyway"
        )
        self.ref = ref
        self.step = step


class StepNotFound(CasCkptError, KeyError):
    """A checkpoint manager has no checkpoint, retained or expired, for this step.

    ``step`` None: the ref holds no checkpoint at all; the message names the repository and the
    refs it does hold (a misspelt run name?).
    """

    def __init__(
        self, ref: str, step: int | None, *, location: object = None, refs: list[str] | None = None
    ) -> None:
        if step is not None:
            message = f"{ref!r} has no checkpoint for step {step}"
        else:
            there = f"the refs there are {refs}" if refs else "it holds no refs"
            message = f"{ref!r} has no checkpoints in repository {location}; {there}"
        super().__init__(message)
        self.ref = ref
        self.step = step
        self.refs = refs or []


class SaveFailed(CasCkptError):
    """A background (async) save failed; ``__cause__`` is the original error. No ref moved."""

    def __init__(self, ref: str, step: int, error: BaseException) -> None:
        super().__init__(f"async save of step {step} to {ref!r} failed: {type(error).__name__}: {error}")
        self.ref = ref
        self.step = step


class ReplicationFailed(CasCkptError):
    """Checkpoints saved locally are not yet replicated to the remote, and the latest attempts
    failed; ``__cause__`` is the last error. Nothing is dropped: the local copies stay, and the
    manager keeps retrying (or ``cas-ckpt push`` sends them)."""

    def __init__(self, ref: str, remote: str, steps: list[int], error: BaseException) -> None:
        super().__init__(
            f"replication of {ref!r} to {remote} is behind by {len(steps)} checkpoint(s) "
            f"(steps {steps}): {type(error).__name__}: {error}; they are saved locally"
        )
        self.ref = ref
        self.remote = remote
        self.steps = steps


class GraphCycleError(CasCkptError, ValueError):
    """A computation graph has a cycle, so it has no topological order."""

    def __init__(self, nodes: list[str]) -> None:
        super().__init__(f"computation graph has a cycle through nodes {nodes}")
        self.nodes = nodes


class UnknownMetric(CasCkptError, ValueError):
    """A retention rule ranks by a metric that no save of the ref has reported (a misspelling?)."""

    def __init__(self, ref: str, metric: str, reported: list[str]) -> None:
        seen = f"the metrics reported are {reported}" if reported else "no metrics were reported"
        super().__init__(
            f"keep_best ranks {ref!r} by best_metric {metric!r}, but no save of it reported that "
            f"metric ({seen}); nothing was saved or expired"
        )
        self.ref = ref
        self.metric = metric
        self.reported = reported


class MapLocationError(_PathInState, CasCkptError, ValueError):
    """``map_location`` cannot place a loaded tensor: a device this process cannot use, or a
    malformed mapping. Names the path of the tensor inside the state (and ``device`` when known).
    """

    def __init__(self, message: str, *, device: str | None = None, path: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.device = device
        self.path = path

    def __str__(self) -> str:
        return f"{self.path or '<root>'}: {self.message}"


class CheckpointFileError(CasCkptError, ValueError):
    """A file a trainer integration reads (a Lightning stub, a Trainer's checkpoint folder) is
    missing or not what it should be; names the file."""

    def __init__(self, path: object, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = str(path)
