"""The compiled parts, both optional: cas_ckpt._hashpool (SHA-256 of many small blocks, and a
load's copies out of pack mappings, no GIL; 16 chunks of one length at once where the CPU has
AVX-512, in _sha256_x16.c; see cas_ckpt/cid.py) and cas_ckpt._headers (the small
maps of array headers decoded without a Python hook, see cas_ckpt/codec.py; a container's usual
small arrays made, for a load, through numpy's C API in buffers they share, or encoded with their
links, for a save, in one loop, see cas_ckpt/tree.py and cas_ckpt/_small.py). Where they cannot
be built (no C compiler, no OpenSSL or numpy headers), the install goes on: cas_ckpt then hashes with hashlib, copies with numpy, and decodes
and encodes with msgpack, to the same CIDs, values and bytes."""

from setuptools import Extension, setup


def _headers() -> list[Extension]:
    """_headers makes a load's small arrays through numpy's C API (numpy is among
    pyproject.toml's build requirements); without numpy's headers it is left out, as if its
    build had failed."""
    try:
        import numpy
    except ImportError:
        return []
    return [Extension("cas_ckpt._headers", sources=["cas_ckpt/_headers.c"],
                      include_dirs=[numpy.get_include()], optional=True)]


setup(
    ext_modules=[
        Extension(
            "cas_ckpt._hashpool",
            sources=["cas_ckpt/_hashpool.c", "cas_ckpt/_sha256_x16.c"],
            depends=["cas_ckpt/_sha256_x16.h"],
            libraries=["crypto"],  # OpenSSL's libcrypto: the SHA-256 hashlib itself uses
            optional=True,
        ),
        *_headers(),
    ]
)
