"""LocalStack's S3, the tests' second S3 server (beside moto, ``tests/s3_server.py``).

LocalStack runs from a virtual environment of its own, ``.venv-localstack/`` at the repository root
(its pins clash with the project's: boto3, moto-ext), made by ``scripts/test.sh`` from
``tests/localstack-requirements.txt`` (``scripts/_localstack.sh``). Only S3 is started, in the
foreground, its runtime (``localstack.runtime.main``) run by this file's ``--serve`` under that
venv's Python, with everything it writes (objects over 512 KiB spill to disk, its state folders) in
a temporary folder removed when it stops.

Its conditional requests are used as they are, nothing serialised in front of them, with one fix.
A PUT checks ``If-Match`` / ``If-None-Match`` and writes under a lock of the key's stored file, but
the first PUT of a key (or the first after a DELETE) makes that file, and its lock, without a lock:
two PUTs racing to create a key can each make one, each find no object and both succeed with
``If-None-Match: *`` (``tests/test_s3_server.py`` measured it: a few keys in 300). ``--serve`` makes
that file's creation one step, as S3's create is; ``--plain`` leaves LocalStack as it is.

``python tests/localstack_server.py`` starts one and prints its endpoint until interrupted.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-localstack"
PYTHON = VENV / "bin" / "python"
START_TIMEOUT = 90.0  # seconds; it is ready in 1-3 s on an idle machine
# Its address space (RLIMIT_AS; it peaks near 0.7 GiB here): a runaway server fails alone, not the
# machine. Its CPU is one Python process's (the GIL: about one core); objects over 512 KiB on disk.
MEMORY_LIMIT = 4 * 2**30


class Unavailable(RuntimeError):
    """LocalStack is not installed here (no ``.venv-localstack``)."""


def installed() -> bool:
    return PYTHON.is_file() and os.access(PYTHON, os.X_OK)


def missing() -> str | None:
    """Why LocalStack cannot be started here, or None. The tests skip on it, or fail where
    CAS_CKPT_REQUIRE_LOCALSTACK=1 (CI)."""
    if installed():
        return None
    return (f"LocalStack is not installed (no {PYTHON}): scripts/test.sh installs it "
            "(scripts/_localstack.sh, tests/localstack-requirements.txt)")


def required() -> bool:
    return os.environ.get("CAS_CKPT_REQUIRE_LOCALSTACK") == "1"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an HTTP proxy


def _s3_ready(endpoint: str) -> bool:
    """LocalStack's health check says S3 is up."""
    try:
        with _DIRECT.open(f"{endpoint}/_localstack/health", timeout=2) as answer:
            health = json.load(answer)
    except (OSError, ValueError):
        return False
    return health.get("services", {}).get("s3") in ("running", "available")


def environment(port: int, root: str) -> dict[str, str]:
    """The environment LocalStack runs in: S3 alone, on loopback, nothing kept, nothing fetched."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("AWS_", "LOCALSTACK_", "PYTHON"))}
    env.update(
        SERVICES="s3",
        EAGER_SERVICE_LOADING="1",  # S3 up before the health check says so, not at the first request
        GATEWAY_LISTEN=f"127.0.0.1:{port}",
        PERSISTENCE="0",
        OVERRIDE_IN_DOCKER="0",  # host mode: every folder below FILESYSTEM_ROOT, not /var/lib/localstack
        FILESYSTEM_ROOT=root,
        TMPDIR=root,
        DNS_ADDRESS="0",  # no DNS server (it would want port 53)
        SKIP_SSL_CERT_DOWNLOAD="1",  # no request to api.localstack.cloud
        DISABLE_EVENTS="1",  # no analytics
        LOCALSTACK_TELEMETRY="0",
        MALLOC_ARENA_MAX="2",  # many request threads, few malloc arenas: a smaller address space
    )
    return env


@contextlib.contextmanager
def running(timeout: float = START_TIMEOUT, switch_interval: float | None = None,
            plain: bool = False) -> Iterator[str]:
    """LocalStack's S3 in a process of its own on a free loopback port; yields its endpoint URL.

    ``switch_interval``: Python's thread switch interval in the server process, for
    ``tests/test_s3_server.py`` (a tiny one interleaves its request threads often); ``plain``:
    without the fix of its creates (the module's docstring). Raises
    ``Unavailable`` where ``.venv-localstack`` is missing, ``RuntimeError`` (its log included)
    where it does not become healthy within ``timeout`` seconds.
    """
    why = missing()
    if why:
        raise Unavailable(why)
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    root = tempfile.mkdtemp(prefix="cas-ckpt-localstack-")
    log = open(os.path.join(root, "localstack.log"), "w+b")  # noqa: SIM115 (closed below)
    command = [str(PYTHON), str(Path(__file__).resolve()), "--serve"]
    if switch_interval is not None:
        command += ["--switch-interval", repr(switch_interval)]
    if plain:
        command.append("--plain")
    proc = subprocess.Popen(command, cwd=root,
                            env=environment(port, root), stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with contextlib.suppress(OSError, ValueError):
            resource.prlimit(proc.pid, resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        deadline = time.monotonic() + timeout
        while not _s3_ready(endpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                log.seek(0)
                text = log.read().decode(errors="replace")[-6000:]
                why = f"exited with {proc.returncode}" if proc.poll() is not None else \
                    f"not healthy after {timeout:.0f} s"
                raise RuntimeError(f"LocalStack's S3 did not start ({why}); its log:\n{text}")
            time.sleep(0.1)
        yield endpoint
    finally:
        _stop(proc)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL to its process group (nothing of it is kept: no graceful shutdown, which takes
    seconds), then reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _make_creates_atomic() -> None:
    """The get-or-create of a key's stored file (and so of the lock its conditional PUTs take)
    under one lock: two first PUTs of a key meet at the same lock (localstack-core 4.4.0)."""
    import threading

    from localstack.services.s3.storage import ephemeral

    store = ephemeral.EphemeralS3ObjectStore
    original = store.open
    creating = threading.Lock()

    def open_(self: Any, bucket: str, s3_object: Any, mode: str = "r") -> Any:
        key = self._key_from_s3_object(s3_object)
        with creating:
            if self._get_object_file(bucket, key) is None:  # as LocalStack's own open makes it
                self._filesystem[bucket]["keys"][key] = ephemeral.LockedSpooledTemporaryFile(
                    dir=os.path.join(self.root_directory, bucket), max_size=ephemeral.S3_MAX_FILE_SIZE_BYTES)
        return original(self, bucket, s3_object, mode)  # finds that file; waits for its lock

    store.open = open_


def serve(argv: list[str]) -> None:
    """Run LocalStack's runtime in this process (under .venv-localstack's Python), configured by
    the environment ``running`` gives it."""
    import argparse
    import runpy

    parser = argparse.ArgumentParser(description="LocalStack's S3 for the tests")
    parser.add_argument("--switch-interval", type=float, default=None)
    parser.add_argument("--plain", action="store_true", help="LocalStack as it is, creates unfixed")
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parent  # sys.path[0]: no module of the tests shadows one of LocalStack's
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != here]
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if not args.plain:
        _make_creates_atomic()
    sys.argv = [sys.argv[0]]
    runpy.run_module("localstack.runtime.main", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2:])
    else:
        with running() as url:
            print(url, flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
