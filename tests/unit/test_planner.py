"""The fragment planner against a naive byte-by-byte reference, over random layouts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd_client.dataplane import (
    SKIP,
    EngineTensor,
    GroupRef,
    chunks_for_group,
    make_layout,
    plan_transfer,
)
from kvd_client.dataplane.cpu import CpuBackend


def build(rng, n_tensors, pages, nblocks, pad):
    bufs, tensors = [], []
    for t in range(n_tensors):
        row = pages[t] + pad
        buf = rng.integers(0, 256, size=nblocks * row, dtype=np.uint8)
        bufs.append(buf)
        tensors.append(EngineTensor(buf.ctypes.data, row, pages[t], nblocks))
    return bufs, tensors


@settings(max_examples=120, deadline=None)
@given(
    n_tensors=st.integers(1, 3),
    bpc=st.integers(1, 4),
    ranks=st.integers(1, 3),
    n_groups=st.integers(1, 2),
    pad=st.sampled_from([0, 8]),
    seed=st.integers(0, 2**32 - 1),
)
def test_store_then_load_roundtrip_matches_reference(n_tensors, bpc, ranks, n_groups, pad, seed):
    rng = np.random.default_rng(seed)
    pages = [int(rng.integers(1, 5)) * 16 for _ in range(n_tensors)]
    nblocks = 24
    bufs, tensors = build(rng, n_tensors, pages, nblocks, pad)
    refs = [tuple(GroupRef(t, pages[t] - int(rng.integers(0, 2)) * 8)
                  for t in sorted(rng.choice(n_tensors, size=int(rng.integers(1, n_tensors + 1)),
                                             replace=False)))
            for _ in range(n_groups)]
    layout = make_layout(tensors, refs, bpc, ranks)
    rank = int(rng.integers(0, ranks))
    sizes = [int(rng.integers(0, 6)) for _ in range(n_groups)]
    indices = [int(rng.integers(0, 9)) for _ in range(n_groups)]
    ids = rng.choice(nblocks, size=sum(sizes), replace=False).tolist()
    n_chunks = sum(chunks_for_group(n, b, bpc) for n, b in zip(sizes, indices))
    pool = np.zeros((n_chunks + 2) * layout.slot_bytes, dtype=np.uint8)
    slots = rng.permutation(n_chunks + 2)[:n_chunks] * layout.slot_bytes
    offsets = [int(s) if rng.random() > 0.2 else SKIP for s in slots]
    plan = plan_transfer(layout, tensors, pool_base=pool.ctypes.data, rank=rank,
                         slot_offsets=offsets, block_ids=ids, group_sizes=sizes,
                         block_indices=indices, to_pool=True)
    CpuBackend().submit(1, plan, is_store=True)

    # reference: byte by byte where each block's pages must land
    expect = np.zeros_like(pool)
    b = c = 0
    goff = layout.group_offsets
    for g, (n, b0) in enumerate(zip(sizes, indices)):
        for i in range(n):
            pos = b0 % bpc + i
            off = offsets[c + pos // bpc]
            if off != SKIP:
                for k, ref in enumerate(refs[g]):
                    t = ref.tensor_idx
                    row = pages[t] + pad
                    src = bufs[t][ids[b + i] * row: ids[b + i] * row + ref.copy_bytes]
                    at = off + rank * layout.shard_bytes + goff[g][k] + (pos % bpc) * pages[t]
                    expect[at: at + ref.copy_bytes] = src
        b += n
        c += chunks_for_group(n, b0, bpc)
    assert np.array_equal(pool, expect)
    assert plan.total_bytes == sum(
        ref.copy_bytes for g, (n, b0) in enumerate(zip(sizes, indices)) for ref in refs[g]
        for i in range(n) if offsets[sum(chunks_for_group(sizes[h], indices[h], bpc)
                                         for h in range(g)) + (b0 % bpc + i) // bpc] != SKIP)

    # load back into zeroed engine tensors: the copied bytes come back exactly
    saved = [buf.copy() for buf in bufs]
    for buf in bufs:
        buf[:] = 0
    load = plan_transfer(layout, tensors, pool_base=pool.ctypes.data, rank=rank,
                         slot_offsets=offsets, block_ids=ids, group_sizes=sizes,
                         block_indices=indices, to_pool=False)
    CpuBackend().submit(2, load, is_store=False)
    for t, buf in enumerate(bufs):
        row = pages[t] + pad
        for blk in range(nblocks):
            got = buf[blk * row: blk * row + pages[t]]
            if got.any():
                copied = int(np.count_nonzero(got != 0))
                assert np.array_equal(got[got != 0], saved[t][blk * row: blk * row + pages[t]][
                    got != 0]), copied


def test_contiguous_blocks_coalesce_into_one_run_per_slot():
    nblocks, page = 16, 4096
    buf = np.zeros(nblocks * page, dtype=np.uint8)
    layout = make_layout([EngineTensor(buf.ctypes.data, page, page, nblocks)],
                         [(GroupRef(0, page),)], 4)
    plan = plan_transfer(layout, [EngineTensor(buf.ctypes.data, page, page, nblocks)],
                         pool_base=1 << 30, rank=0, slot_offsets=[0, 1 << 20],
                         block_ids=list(range(8)), group_sizes=[8], block_indices=[0],
                         to_pool=True)
    assert len(plan) == 2 and plan.lengths.tolist() == [4 * page, 4 * page]


def test_skip_leading_blocks_of_first_chunk():
    buf = np.zeros(8 * 16, dtype=np.uint8)
    t = EngineTensor(buf.ctypes.data, 16, 16, 8)
    layout = make_layout([t], [(GroupRef(0, 16),)], 4)
    plan = plan_transfer(layout, [t], pool_base=0, rank=0, slot_offsets=[4096, 8192],
                         block_ids=[5, 6, 7], group_sizes=[3], block_indices=[3],
                         to_pool=True)
    # logical block 3 -> chunk 0 page 3; blocks 4, 5 -> chunk 1 pages 0, 1
    assert plan.dst.tolist() == [4096 + 48, 8192]
    assert plan.lengths.tolist() == [16, 32]


def test_bad_inputs():
    t = EngineTensor(0, 16, 16, 4)
    layout = make_layout([t], [(GroupRef(0, 16),)], 1)
    with pytest.raises(ValueError, match="out of range"):
        plan_transfer(layout, [t], pool_base=0, rank=0, slot_offsets=[0], block_ids=[9],
                      group_sizes=[1], block_indices=[0], to_pool=True)
    with pytest.raises(ValueError, match="chunk slots"):
        plan_transfer(layout, [t], pool_base=0, rank=0, slot_offsets=[0, 4096], block_ids=[1],
                      group_sizes=[1], block_indices=[0], to_pool=True)
    with pytest.raises(ValueError, match="rank"):
        plan_transfer(layout, [t], pool_base=0, rank=3, slot_offsets=[0], block_ids=[1],
                      group_sizes=[1], block_indices=[0], to_pool=True)
