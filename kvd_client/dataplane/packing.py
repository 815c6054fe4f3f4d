"""A CopyPlan made ready for the gather/scatter kernel (kernel.py), and the kernel's arithmetic.

Pure numpy, so the CPU tests cover everything the kernel is told and how it splits a run:
- long runs are cut into pieces of at most `max_piece` bytes (a multiple of 16, so a piece
  keeps its run's alignment) and the grid-stride loop spreads pieces over the thread blocks;
- the plan travels as one int64 table [src..., dst..., len...], written straight into a
  pinned staging buffer (one upload per transfer);
- each run is copied as a byte head up to the first aligned address, a body of `width`-byte
  words (16 when source and destination agree modulo 16, else 8, 4 or 1), and a byte tail.
  `run_parts` computes exactly what the kernel computes for a run.
"""

from __future__ import annotations

import numpy as np

from .planner import CopyPlan

WIDTHS = (16, 8, 4, 1)        # the kernel's word sizes, widest first
MAX_PIECE = 1 << 20           # bytes one block copies before the next piece goes to another
THREADS = 256                 # threads per block
MIN_TABLE = 3 * 1024          # smallest table buffer (int64s), so small plans reuse buffers


def split_long_runs(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray,
                    max_piece: int = MAX_PIECE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut runs longer than `max_piece` into consecutive pieces (vectorised)."""
    if max_piece <= 0 or max_piece % WIDTHS[0]:
        raise ValueError(f"max_piece must be a positive multiple of {WIDTHS[0]}")
    pieces = np.maximum(1, -(-lengths // max_piece))
    if lengths.size == 0 or int(pieces.max()) == 1:
        return src, dst, lengths
    run = np.repeat(np.arange(lengths.size), pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    offset = (np.arange(run.size) - first) * max_piece
    length = np.minimum(lengths[run] - offset, max_piece)
    return src[run] + offset, dst[run] + offset, length


def kernel_runs(plan: CopyPlan, max_piece: int = MAX_PIECE
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs the kernel gets: the plan's, with runs longer than `max_piece` split."""
    if plan.lengths.size == 0 or int(plan.lengths.max()) <= max_piece:
        return plan.src, plan.dst, plan.lengths
    return split_long_runs(plan.src, plan.dst, plan.lengths, max_piece)


def write_table(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray,
                out: np.ndarray) -> int:
    """Lay the runs out as the kernel's int64 table [src..., dst..., len...] at the start of
    `out` (the pinned staging buffer, so no intermediate copy); the number of runs."""
    n = int(lengths.size)
    if out.size < 3 * n:
        raise ValueError(f"table needs {3 * n} entries, the buffer has {out.size}")
    out[:n] = src
    out[n:2 * n] = dst
    out[2 * n:3 * n] = lengths
    return n


def grid_size(runs: int, max_blocks: int) -> int:
    """Thread blocks for one launch: never more than there are runs, at least one."""
    if max_blocks < 1:
        raise ValueError("max_blocks must be >= 1")
    return max(1, min(max_blocks, runs))


def table_capacity(entries: int) -> int:
    """Size (int64s) of the staging and device buffers for a table of `entries`: a power of
    two, so a handful of buffers serve every transfer size."""
    return 1 << max(MIN_TABLE, entries - 1).bit_length()


def run_parts(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per run, as the kernel splits it: (width, head bytes, body words, tail bytes)."""
    diff = np.bitwise_xor(src, dst)
    width = np.ones_like(lengths)
    for w in reversed(WIDTHS[:-1]):        # 4, then 8, then 16 overwrite where they fit
        width = np.where(diff % w == 0, w, width)
    head = np.minimum(lengths, (width - src % width) % width)
    body = (lengths - head) // width
    tail = lengths - head - body * width
    return width, head, body, tail
