"""Plan packing for the GPU kernel, and the kernel's own source run on the CPU.

The kernel source (kvd_client/dataplane/kernel.py) is compiled here with the host C++
compiler behind a few definitions that stand in for CUDA's (thread and block indices, uint4,
the streaming load/store intrinsics, which also count accesses a GPU would fault on), and every
(block, thread) pair runs in turn. The kernel's threads share nothing and write disjoint
bytes, so this executes exactly the byte movement the GPU does.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd_client.dataplane import kernel
from kvd_client.dataplane.packing import (
    MAX_PIECE,
    MIN_TABLE,
    THREADS,
    WIDTHS,
    grid_size,
    kernel_runs,
    run_parts,
    split_long_runs,
    table_capacity,
    write_table,
)
from kvd_client.dataplane.planner import CopyPlan, coalesce

HARNESS = r"""
#include <cstdint>
#include <cstring>
struct uint3_ { unsigned x, y, z; };
static uint3_ threadIdx, blockIdx, blockDim, gridDim;
struct __attribute__((aligned(16))) uint4 { unsigned x, y, z, w; };
static long long misaligned = 0;      // word accesses a GPU would fault on
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
template <typename T> inline T __ldcv(const T* p) {
    misaligned += reinterpret_cast<uintptr_t>(p) % sizeof(T) != 0;
    T v; memcpy(&v, p, sizeof(T)); return v;
}
template <typename T> inline void __stwt(T* p, T v) {
    misaligned += reinterpret_cast<uintptr_t>(p) % sizeof(T) != 0;
    memcpy(p, &v, sizeof(T));
}
SOURCE
extern "C" long long emulate(unsigned long long table, long long runs, unsigned grid,
                             unsigned threads) {
    gridDim.x = grid; blockDim.x = threads; misaligned = 0;
    for (unsigned b = 0; b < grid; ++b)
        for (unsigned t = 0; t < threads; ++t) {
            blockIdx.x = b; threadIdx.x = t;
            kvd_copy_runs(table, runs);
        }
    return misaligned;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler to run the kernel source on the CPU")
    d = tmp_path_factory.mktemp("kernel")
    (d / "k.cpp").write_text(HARNESS.replace("SOURCE", kernel.SOURCE))
    subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-o", str(d / "k.so"), str(d / "k.cpp")],
                   check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(d / "k.so"))
    lib.emulate.argtypes = [ctypes.c_ulonglong, ctypes.c_longlong, ctypes.c_uint,
                            ctypes.c_uint]
    lib.emulate.restype = ctypes.c_longlong

    def run(table: np.ndarray, runs: int, grid: int, threads: int) -> None:
        assert lib.emulate(table.ctypes.data, runs, grid, threads) == 0, "misaligned access"

    return run


def random_plan(rng, base: int, span: int, n: int, max_len: int) -> CopyPlan:
    """`n` non-overlapping runs from the first half of [base, base + span) to the second,
    at arbitrary byte offsets (so every width and head/tail case occurs)."""
    half = span // 2
    slots = half // max_len
    n = min(n, slots)

    def starts(at: int) -> np.ndarray:
        return at + rng.permutation(slots)[:n] * max_len + rng.integers(0, 32, size=n)

    lengths = rng.integers(0, max_len - 32, size=n)
    return CopyPlan(starts(base), starts(base + half), lengths, int(lengths.sum()))


def make_table(plan: CopyPlan, max_piece: int = MAX_PIECE) -> tuple[np.ndarray, int]:
    """What the backend uploads: the kernel's runs written into a (staging) buffer."""
    src, dst, lengths = kernel_runs(plan, max_piece)
    table = np.full(table_capacity(3 * lengths.size), -1, dtype=np.int64)
    return table, write_table(src, dst, lengths, table)


def reference(mem: np.ndarray, base: int, plan: CopyPlan) -> np.ndarray:
    out = mem.copy()
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist()):
        out[d - base:d - base + n] = mem[s - base:s - base + n]
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), blocks=st.integers(1, 24),
       max_len=st.sampled_from([64, 4096 + 40, 70_000]))
def test_kernel_source_copies_exactly_what_the_plan_says(emulated, seed, blocks, max_len):
    rng = np.random.default_rng(seed)
    mem = rng.integers(0, 256, size=4 << 20, dtype=np.uint8)
    base = mem.ctypes.data
    plan = random_plan(rng, base, mem.size, int(rng.integers(1, 40)), max_len)
    expect = reference(mem, base, plan)
    table, runs = make_table(plan, max_piece=16 * int(rng.integers(1, 300)))
    emulated(table, runs, grid_size(runs, blocks), 32)
    assert np.array_equal(mem, expect)


def test_kernel_source_with_the_real_block_size_and_a_big_run(emulated):
    mem = np.random.default_rng(1).integers(0, 256, size=8 << 20, dtype=np.uint8)
    base = mem.ctypes.data
    # 3 MiB + 5 bytes, both sides 16-aligned + 3: split into pieces, vector body, byte tail
    plan = CopyPlan(np.array([base + 3 + 4096]), np.array([base + (4 << 20) + 3 + 4096]),
                    np.array([(3 << 20) + 5]), (3 << 20) + 5)
    expect = reference(mem, base, plan)
    table, runs = make_table(plan)
    assert runs == 4
    emulated(table, runs, grid_size(runs, 16), THREADS)
    assert np.array_equal(mem, expect)


@given(lengths=st.lists(st.integers(0, 5 * MAX_PIECE), min_size=0, max_size=20),
       piece=st.sampled_from([16, 4096, MAX_PIECE]))
def test_split_long_runs_covers_every_byte_once_in_order(lengths, piece):
    n = np.array(lengths, dtype=np.int64)
    src = np.cumsum(n + 1) - n            # a gap after every run: nothing merges by accident
    dst = src * 2 + 7
    s, d, k = split_long_runs(src, dst, n, piece)
    assert (k <= piece).all() and int(k.sum()) == int(n.sum())
    merged = coalesce(s, d, k)            # the pieces put back together are the runs
    assert merged.src.tolist() == src.tolist() and merged.lengths.tolist() == n.tolist()
    assert merged.dst.tolist() == dst.tolist()


def test_split_keeps_alignment_and_rejects_odd_pieces():
    s, d, _ = split_long_runs(np.array([3]), np.array([19]), np.array([100]), 32)
    assert ((s - 3) % 16 == 0).all() and ((d - 19) % 16 == 0).all()
    with pytest.raises(ValueError):
        split_long_runs(np.array([0]), np.array([0]), np.array([1]), 24)


def test_the_table_lays_out_sources_destinations_lengths():
    plan = CopyPlan(np.array([10, 20]), np.array([30, 40]), np.array([5, 6]), 11)
    table, runs = make_table(plan)
    assert runs == 2 and table[:6].tolist() == [10, 20, 30, 40, 5, 6]
    with pytest.raises(ValueError, match="needs 6 entries"):
        write_table(plan.src, plan.dst, plan.lengths, np.zeros(5, dtype=np.int64))
    # short runs pass through untouched (no copy); long ones are split
    assert kernel_runs(plan)[0] is plan.src
    assert kernel_runs(CopyPlan(np.array([0]), np.array([0]), np.array([3 * MAX_PIECE]),
                                3 * MAX_PIECE))[2].tolist() == [MAX_PIECE] * 3


def test_grid_size_and_table_capacity():
    assert grid_size(0, 16) == 1 and grid_size(5, 16) == 5 and grid_size(1000, 16) == 16
    with pytest.raises(ValueError):
        grid_size(5, 0)
    assert table_capacity(1) == table_capacity(MIN_TABLE) >= MIN_TABLE
    for n in (MIN_TABLE + 1, 100_000, 3 * 65536):
        cap = table_capacity(n)
        assert cap >= n and cap & (cap - 1) == 0 and cap < 2 * n


def test_run_parts_matches_the_kernels_split():
    rng = np.random.default_rng(3)
    src = rng.integers(0, 1 << 40, size=5000)
    dst = rng.integers(0, 1 << 40, size=5000)
    lengths = rng.integers(0, 100, size=5000)
    width, head, body, tail = run_parts(src, dst, lengths)
    assert set(np.unique(width).tolist()) <= set(WIDTHS)
    assert (head + body * width + tail == lengths).all()
    assert (((src + head) % width == 0) | (body == 0)).all()
    assert (((dst + head) % width == 0) | (body == 0)).all()
    assert ((head < width) & (tail < width)).all()
    same16 = (src - dst) % 16 == 0
    assert (width[same16] == 16).all() and (width[~same16] < 16).all()
