"""The one compiled part: cas_ckpt._hashpool (SHA-256 of many small blocks, no GIL; see
cas_ckpt/cid.py). Optional: where it cannot be built (no C compiler or no OpenSSL headers), the
install goes on and cas_ckpt hashes with hashlib, to the same CIDs."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cas_ckpt._hashpool",
            sources=["cas_ckpt/_hashpool.c"],
            libraries=["crypto"],  # OpenSSL's libcrypto: the SHA-256 hashlib itself uses
            optional=True,
        )
    ]
)
