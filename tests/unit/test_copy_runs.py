"""The compiled copy of a plan's runs (kvd_client/dataplane/_copy.c) moves exactly the bytes
its Python twin (`py_execute`, a ctypes.memmove per run) moves: small calls (memmove) and large
ones (non-temporal stores past the cache), runs at every alignment and of every length, the
bytes around each run untouched; and bad plans are refused with an error, nothing copied."""

from __future__ import annotations

import numpy as np
import pytest

from kvd_client.dataplane import cpu
from kvd_client.dataplane.planner import CopyPlan

copy = cpu._copy
compiled = pytest.mark.skipif(cpu._copy is None, reason="kvd_client.dataplane._copy not built")


def plan_over(src: np.ndarray, dst: np.ndarray, runs: list[tuple[int, int, int]]) -> CopyPlan:
    """(source offset, destination offset, length) runs between two byte arrays."""
    s, d = src.ctypes.data, dst.ctypes.data
    return CopyPlan(np.array([s + a for a, _, _ in runs], dtype=np.int64),
                    np.array([d + b for _, b, _ in runs], dtype=np.int64),
                    np.array([n for _, _, n in runs], dtype=np.int64),
                    sum(n for _, _, n in runs))


def random_runs(rng: np.random.Generator, size: int, count: int, longest: int
                ) -> list[tuple[int, int, int]]:
    """Runs whose destinations do not overlap (a plan's never do), at any alignment."""
    runs, at = [], 0
    for _ in range(count):
        n = int(rng.integers(0, longest))
        gap = int(rng.integers(0, 97))
        if at + gap + n > size:
            break
        runs.append((int(rng.integers(0, size - n + 1)), at + gap, n))
        at += gap + n
    return runs


@compiled
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("longest,count", [(300, 200), (70_000, 60), (1 << 20, 6),
                                           (3 << 20, 12)],
                         ids=["small", "streamed-4k-plus", "streamed-megabytes", "shared"])
def test_the_compiled_copy_moves_what_its_twin_moves(longest, count, threads):
    """Shared among threads (the last case: calls of 12 MiB and more, cut into equal shares
    of bytes wherever they fall, runs cut too), the bytes are the same."""
    rng = np.random.default_rng(longest)
    size = 32 << 20
    src = rng.integers(0, 256, size, dtype=np.uint8)
    runs = random_runs(rng, size, count, longest)
    assert runs
    twin = rng.integers(0, 256, size, dtype=np.uint8)
    native = twin.copy()
    cpu.py_execute(plan_over(src, twin, runs), threads)
    cpu.execute(plan_over(src, native, runs), threads)
    assert np.array_equal(native, twin)
    total = sum(n for _, _, n in runs)
    if count < 100:
        assert total >= copy.STREAM_MIN_TOTAL       # the streamed path ran
    if longest > 2 << 20:
        assert total >= 3 * copy.SHARE_MIN          # three shares


def test_the_twin_bound_on_threads_is_the_compiled_one():
    if copy is not None:
        assert cpu.MAX_COPY_THREADS == copy.MAX_THREADS
    assert 1 <= cpu.default_copy_threads() <= 4


@compiled
def test_a_bad_plan_is_refused_and_nothing_is_copied():
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    good = plan_over(src, dst, [(0, 0, 8)])
    with pytest.raises(ValueError, match="differ in length"):
        copy.copy_runs(good.src, np.concatenate([good.dst, good.dst]), good.lengths)
    with pytest.raises(ValueError, match="negative"):
        copy.copy_runs(good.src, good.dst, np.array([-1], dtype=np.int64))
    with pytest.raises(TypeError, match="64-bit"):
        copy.copy_runs(good.src.astype(np.int32), good.dst, good.lengths)
    for threads in (0, copy.MAX_THREADS + 1):
        for run in (copy.copy_runs, None):
            with pytest.raises(ValueError, match="threads must be"):
                if run is None:
                    cpu.py_execute(good, threads)
                else:
                    run(good.src, good.dst, good.lengths, threads)
    assert not dst.any()
    assert copy.copy_runs(good.src, good.dst, good.lengths) == 8
    assert dst[:8].tolist() == list(range(8))
