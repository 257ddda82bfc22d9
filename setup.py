"""The compiled parts, both optional: cas_ckpt._hashpool (SHA-256 and BLAKE3 of many small
blocks, and a load's copies out of pack mappings, no GIL; 16 chunks of one length at once where
the CPU has AVX-512, in _sha256_x16.c; BLAKE3 from its official C code, vendored in
vendor/blake3; see cas_ckpt/cid.py) and cas_ckpt._headers (the small
maps of array headers decoded without a Python hook, see cas_ckpt/codec.py; a container's usual
small arrays made, for a load, through numpy's C API in buffers they share, or encoded with their
links, for a save, in one loop, see cas_ckpt/tree.py and cas_ckpt/_small.py). Where they cannot
be built (no C compiler, no OpenSSL or numpy headers), the install goes on: cas_ckpt then hashes
with hashlib and the blake3 package, copies with numpy, and decodes and encodes with msgpack, to
the same CIDs, values and bytes."""

import platform
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

BLAKE3 = "vendor/blake3"


def _blake3() -> tuple[list[str], list[tuple[str, str | None]]]:
    """BLAKE3's sources and macros for this platform: its assembly for SSE2, SSE4.1, AVX2 and
    AVX-512 on x86-64 (the widest the CPU has is picked at run time by blake3_dispatch.c), NEON
    on AArch64, the portable code alone elsewhere (vendor/blake3/README.md)."""
    sources = [f"{BLAKE3}/{name}.c" for name in ("blake3", "blake3_dispatch", "blake3_portable")]
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64") and sys.platform != "win32":
        return sources + [f"{BLAKE3}/blake3_{isa}_x86-64_unix.S"
                          for isa in ("sse2", "sse41", "avx2", "avx512")], []
    if machine in ("aarch64", "arm64"):
        return [*sources, f"{BLAKE3}/blake3_neon.c"], [("BLAKE3_USE_NEON", "1")]
    return sources, [(f"BLAKE3_NO_{isa}", None) for isa in ("SSE2", "SSE41", "AVX2", "AVX512")]


class BuildExt(build_ext):
    """build_ext that hands BLAKE3's ``.S`` files to the C compiler (gcc and clang assemble
    them, running the preprocessor first), which distutils does not list as a source type."""

    def build_extensions(self) -> None:
        if ".S" not in self.compiler.src_extensions:
            self.compiler.src_extensions.append(".S")
        super().build_extensions()


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


blake3_sources, blake3_macros = _blake3()
setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "cas_ckpt._hashpool",
            sources=["cas_ckpt/_hashpool.c", "cas_ckpt/_sha256_x16.c", *blake3_sources],
            depends=["cas_ckpt/_sha256_x16.h", f"{BLAKE3}/blake3.h", f"{BLAKE3}/blake3_impl.h"],
            include_dirs=[BLAKE3],
            define_macros=blake3_macros,
            # BLAKE3's functions bound inside this module, whatever else a process loads that
            # exports the same names (the blake3 package's Rust build assembles the same files)
            extra_link_args=["-Wl,-Bsymbolic"] if sys.platform.startswith("linux") else [],
            libraries=["crypto"],  # OpenSSL's libcrypto: the SHA-256 hashlib itself uses
            optional=True,
        ),
        *_headers(),
    ]
)
