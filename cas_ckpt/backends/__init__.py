"""Backends: named, immutable objects on one medium (a directory, memory, an S3 bucket).

:class:`Backend` is the interface, with its contract written per method; the packed block store
(:mod:`cas_ckpt.blocks`) is written once on top of it. A new medium is one subclass here and a run
of :class:`cas_ckpt.testing.BackendTests` against it.
"""

from cas_ckpt.backends.base import Backend, ObjectInfo, Read, Sink
from cas_ckpt.backends.local import LocalBackend
from cas_ckpt.backends.memory import MemoryBackend
from cas_ckpt.backends.s3 import S3Backend, S3Bucket

__all__ = ["Backend", "LocalBackend", "MemoryBackend", "ObjectInfo", "Read", "S3Backend", "S3Bucket", "Sink"]
