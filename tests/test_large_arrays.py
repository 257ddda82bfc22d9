"""Arrays of any size map: an array's chunks stay in one pack (which grows past the pack size to
hold it), so ``load(mmap=True)`` maps it whole instead of copying it into anonymous memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import cas_ckpt
from cas_ckpt.blocks import LocalStore

MiB = 1024 * 1024
CHUNK = MiB

LOADER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import cas_ckpt

    def rss_anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    repo = cas_ckpt.open(sys.argv[1], create=False, read_only=True)
    before = rss_anon()
    loaded = repo.load(mmap=True)
    big = loaded["big"]
    step = int(sys.argv[2]) // big.itemsize
    firsts = [int(x) for x in big[::step][:4]] + [int(big[::step][-1])]
    after = rss_anon()
    print(json.dumps({"grew": after - before, "owndata": bool(big.flags.owndata),
                      "writeable": bool(big.flags.writeable), "shape": list(big.shape),
                      "firsts": firsts}))
""")


def source(path: Path, nbytes: int) -> np.memmap:
    """A sparse file of ``nbytes`` whose every 1 MiB chunk starts with its own number (so no two
    chunks deduplicate), as a uint64 array mapping it: the test process holds no copy."""
    with open(path, "wb") as f:
        f.truncate(nbytes)
        for i in range(nbytes // CHUNK):
            f.seek(i * CHUNK)
            f.write(np.uint64(i + 1).tobytes())
    return np.memmap(path, np.uint64, "r", shape=(nbytes // 8,))


def save_and_map(tmp_path: Path, nbytes: int) -> dict[str, object]:
    repo_path = tmp_path / "repo"
    with cas_ckpt.open(repo_path) as repo:
        big = source(tmp_path / "source.bin", nbytes)
        repo.save({"big": big, "step": 1})
        del big
        store = repo.blocks
        assert isinstance(store, LocalStore)
        packs = store.packs()
        holding = [name for name, entries in packs.items() if sum(e.length for e in entries) >= nbytes]
        assert len(holding) == 1  # every chunk of the array in one pack
    (tmp_path / "source.bin").unlink()
    done = subprocess.run([sys.executable, "-c", LOADER, str(repo_path), str(CHUNK)],
                          capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout)


@pytest.mark.parametrize("size_mib", [256, 1024])
def test_a_large_array_loads_mapped_with_no_anonymous_memory(tmp_path: Path, size_mib: int) -> None:
    """256 MiB exceeds the 256 MiB pack size once its node and header are counted: the chunks
    used to be cut across two packs, and the load copied them."""
    found = save_and_map(tmp_path, size_mib * MiB)
    assert not found["owndata"] and not found["writeable"]  # a view of the pack's mapping
    assert found["shape"] == [size_mib * MiB // 8]
    assert found["firsts"] == [1, 2, 3, 4, size_mib]
    assert found["grew"] < 16 * MiB, found


@pytest.mark.slow
def test_a_4_gib_array_loads_mapped(tmp_path: Path) -> None:
    found = save_and_map(tmp_path, 4096 * MiB)
    assert not found["owndata"] and found["firsts"] == [1, 2, 3, 4, 4096]
    assert found["grew"] < 16 * MiB, found


def test_an_array_starts_a_new_pack_when_it_does_not_fit_and_small_blocks_still_roll_over(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(5)
    state = {"a": rng.random(3 * MiB // 8), "b": rng.random(5 * MiB // 8), "c": rng.random(2 * MiB // 8)}
    store = LocalStore(tmp_path / "store", pack_size=4 * MiB)
    with cas_ckpt.Repository(store, cas_ckpt.refs.MemoryRefStore()) as repo:
        repo.save(state)
        for key, array in state.items():
            data = memoryview(array).cast("B")
            cids = [repo.hasher.raw(data[i : i + CHUNK]) for i in range(0, data.nbytes, CHUNK)]
            assert len({store.locate(c)[0] for c in cids}) == 1, key
        sizes = sorted(info.size for info in store.backend.list())
        assert len(sizes) == 3 and sizes[-1] > 5 * MiB  # "b" alone past the pack size
        loaded = repo.load(mmap=True)
        assert all(not loaded[k].flags.owndata and np.array_equal(loaded[k], v) for k, v in state.items())
