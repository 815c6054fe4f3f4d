"""Where an SGLang host-pool page's bytes are, and the copies between pages and kvd's slots.

A slot holds a page as SGLang's own flat data page (`get_data_page(index, flat=True)`: the
bytes its file backend writes and its non-zero-copy `batch_get`/`batch_set` pass), so the
zero-copy calls (`batch_get_v1`/`batch_set_v1`) and the flat ones read and write the same
bytes. Where those bytes lie in the host pool is read from the pool's own page view
(`get_data_page(index, flat=False)`: a strided view of its buffer, for `layer_first`,
`page_first` and `page_first_direct`, MHA and MLA): its innermost contiguous dimensions make
one run, the outer ones enumerate the runs in the flat page's order. The runs' addresses are
an affine function of the page's first token index (a base per run plus the index times a
per-token stride), which `PageGeometry.probe` measures once at three pages and checks; a pool
whose pages are not laid out that way is refused at start. Every later call computes its
addresses with numpy from that geometry and copies with the data plane's CPU path
(kvd_client/dataplane: runs that continue each other on both sides merge into one memmove;
ctypes releases the GIL while it copies, so SGLang's other threads run meanwhile). One copy
each way, no staging buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvd_client.dataplane.cpu import execute
from kvd_client.dataplane.planner import coalesce


class LayoutError(ValueError):
    """A host pool kvd cannot copy pages of (the message says which and why)."""


def _runs_of(view: Any) -> tuple[int, np.ndarray, int]:
    """(address of the view's first byte, each run's offset from it, run bytes) of a strided
    tensor view, runs in the view's logical (flat) order."""
    shape, strides = list(view.shape), list(view.stride())
    item = int(view.element_size())
    inner = 1
    k = len(shape)
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == inner):
        inner *= shape[k - 1]
        k -= 1
    outer_shape, outer_strides = shape[:k], strides[:k]
    if outer_shape:
        grid = np.indices(outer_shape, dtype=np.int64).reshape(len(outer_shape), -1)
        offsets = (grid * np.asarray(outer_strides, dtype=np.int64)[:, None]).sum(axis=0)
    else:
        offsets = np.zeros(1, dtype=np.int64)
    return int(view.data_ptr()), offsets * item, inner * item


@dataclass(frozen=True, slots=True)
class PageGeometry:
    page_size: int              # tokens a page
    bases: np.ndarray           # int64: each run's address at token index 0
    token_stride: int           # bytes the runs move per token index
    run_bytes: int
    page_bytes: int
    last_first: int             # the first token index of the pool's last page
    copy_threads: int = 1       # threads a large batch's copy is shared among

    @classmethod
    def probe(cls, pool: Any, copy_threads: int = 1) -> PageGeometry:
        """Measure the pool's page geometry from its own page views."""
        page_size = int(pool.page_size)
        size = int(pool.size)
        pages = size // page_size
        kind = f"{type(pool).__name__} layout {getattr(pool, 'layout', '?')!r}"
        if page_size < 1 or pages < 2:
            raise LayoutError(f"{kind}: {size} tokens in pages of {page_size}: too small")
        try:
            at = [_runs_of(pool.get_data_page(p * page_size, flat=False))
                  for p in (0, 1, pages - 1)]
            flat = pool.get_data_page(0, flat=True)
            flat_bytes = int(flat.numel()) * int(flat.element_size())
        except (NotImplementedError, ValueError, AssertionError, AttributeError,
                TypeError) as exc:
            raise LayoutError(f"{kind}: no page view ({exc})") from None
        (p0, off, run), (p1, off1, run1), (pn, offn, runn) = at
        if not (run == run1 == runn and (off == off1).all() and (off == offn).all()):
            raise LayoutError(f"{kind}: pages are not made of the same runs")
        if run * off.size != flat_bytes:
            raise LayoutError(f"{kind}: the page view's runs are not its flat page")
        step = p1 - p0
        if step <= 0 or step % page_size or pn - p0 != step * (pages - 1):
            raise LayoutError(f"{kind}: pages do not move by one stride")
        return cls(page_size, p0 + off, step // page_size, run, flat_bytes,
                   (pages - 1) * page_size, copy_threads)

    def firsts(self, host_indices: Any, pages: int) -> np.ndarray:
        """The first token index of each of the first `pages` pages (SGLang's v1 calls pass
        `len(keys) * page_size` token indices; page i starts at index i * page_size)."""
        flat = host_indices.numpy() if hasattr(host_indices, "numpy") else \
            np.asarray(host_indices)
        firsts = np.asarray(flat[: pages * self.page_size: self.page_size], dtype=np.int64)
        if firsts.size != pages:
            raise ValueError(f"{flat.size} host indices for {pages} pages of "
                             f"{self.page_size} tokens")
        if pages and (firsts.min() < 0 or firsts.max() > self.last_first
                      or (firsts % self.page_size).any()):
            raise ValueError("host indices that are not pages of the host pool")
        return firsts

    def _runs(self, firsts: np.ndarray, pool_base: int, offsets: Sequence[int]
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        host = (self.bases[None, :] + firsts[:, None] * self.token_stride).ravel()
        runs = self.bases.size
        slot = (np.asarray(offsets, dtype=np.int64)[:, None] + pool_base
                + np.arange(runs, dtype=np.int64)[None, :] * self.run_bytes).ravel()
        return host, slot, np.full(host.size, self.run_bytes, dtype=np.int64)

    def load(self, firsts: np.ndarray, pool_base: int, offsets: Sequence[int]) -> int:
        """Copy slots into the host pages starting at `firsts`; the bytes copied."""
        host, slot, lengths = self._runs(firsts, pool_base, offsets)
        plan = coalesce(slot, host, lengths)
        execute(plan, self.copy_threads)
        return plan.total_bytes

    def copy_flat(self, sources: Sequence[int], targets: Sequence[int]) -> int:
        """Copy whole flat pages (`page_bytes` each) from each source address to the target
        beside it, as the v1 calls copy (one compiled call, shared among `copy_threads`);
        the bytes copied."""
        n = min(len(sources), len(targets))
        if not n:
            return 0
        plan = coalesce(np.asarray(sources[:n], dtype=np.int64),
                        np.asarray(targets[:n], dtype=np.int64),
                        np.full(n, self.page_bytes, dtype=np.int64))
        execute(plan, self.copy_threads)
        return plan.total_bytes

    def store(self, firsts: np.ndarray, pool_base: int, offsets: Sequence[int]) -> int:
        """Copy the host pages starting at `firsts` into slots; the bytes copied."""
        host, slot, lengths = self._runs(firsts, pool_base, offsets)
        plan = coalesce(host, slot, lengths)
        execute(plan, self.copy_threads)
        return plan.total_bytes
