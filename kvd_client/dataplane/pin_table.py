"""Which chunks of the mapped pool are registered for DMA, and which a transfer needs.

Pure bookkeeping (no CUDA, no threads; pinner.py runs it). A region (one pool mapping) is
cut into fixed-size chunks from its base; each chunk is registered once, by itself, so
registration cost is paid in small steps in the background instead of all before the first
copy, and a transfer can ask for exactly the chunks it touches to go first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

PAGE = 4096


class PinState(IntEnum):
    IDLE = 0      # not registered yet
    BUSY = 1      # being registered now
    PINNED = 2    # registered; the device cannot use its host address (kernel excluded)
    DIRECT = 3    # registered and addressable by the kernel at its host address
    FAILED = 4    # registration failed: transfers touching it take the pageable path
    GONE = 5      # its region was removed


@dataclass(frozen=True, slots=True)
class Registration:
    pinned: bool       # registered for DMA
    direct: bool       # and the device sees the range at its host address


@dataclass(frozen=True, slots=True)
class PinJob:
    chunk: int
    address: int
    size: int


@dataclass(frozen=True, slots=True)
class PinStatus:
    pinned: bool       # every chunk the ranges touch is registered
    direct: bool       # every one of them is DIRECT


@dataclass(slots=True)
class _Region:
    base: int
    size: int
    first: int         # global index of its first chunk
    count: int


class PinTable:
    def __init__(self, chunk_bytes: int) -> None:
        if chunk_bytes <= 0 or chunk_bytes % PAGE:
            raise ValueError(f"chunk size must be a positive multiple of {PAGE}")
        self.chunk_bytes = chunk_bytes
        self._regions: list[_Region] = []      # live regions
        self._state = np.zeros(0, dtype=np.int8)
        self._address: list[int] = []
        self._size: list[int] = []
        self._wanted: deque[int] = deque()
        self._cursor = 0                        # background order: the next chunk to look at

    # ------------------------------------------------------------------ regions
    def add_region(self, base: int, size: int) -> None:
        if base % PAGE or size <= 0:
            raise ValueError("a region starts on a page and is not empty")
        for r in self._regions:
            if base < r.base + r.size and r.base < base + size:
                raise ValueError(f"region [{base:#x}, +{size}) overlaps a registered one")
        first = len(self._address)
        count = -(-size // self.chunk_bytes)
        for k in range(count):
            offset = k * self.chunk_bytes
            self._address.append(base + offset)
            self._size.append(min(self.chunk_bytes, size - offset))
        self._state = np.concatenate((self._state, np.zeros(count, dtype=np.int8)))
        self._regions.append(_Region(base, size, first, count))
        self._regions.sort(key=lambda r: r.base)

    def retire_region(self, base: int) -> None:
        """Start removing the region at `base`: its chunks not registered yet never will be."""
        r = self._region(base)
        states = self._state[r.first:r.first + r.count]
        states[states == PinState.IDLE] = PinState.GONE

    def region_busy(self, base: int) -> bool:
        """A chunk of the region at `base` is being registered right now."""
        r = self._region(base)
        return bool((self._state[r.first:r.first + r.count] == PinState.BUSY).any())

    def remove_region(self, base: int) -> list[PinJob]:
        """Forget the region at `base`; the registered chunks, for the caller to unregister.
        The caller makes sure nothing copies from it any more and no chunk is BUSY."""
        r = self._region(base)
        if self.region_busy(base):
            raise RuntimeError("a chunk of this region is being registered")
        states = self._state[r.first:r.first + r.count]
        out = [self.job(r.first + int(k)) for k in
               np.nonzero((states == PinState.PINNED) | (states == PinState.DIRECT))[0]]
        states[:] = PinState.GONE
        self._regions.remove(r)
        return out

    def _region(self, base: int) -> _Region:
        for r in self._regions:
            if r.base == base:
                return r
        raise KeyError(f"no region at {base:#x}")

    # ------------------------------------------------------------ what a plan needs
    def chunks_for(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The chunks host ranges [start, start + length) touch; ValueError for a range
        outside every live region (a plan against an unmapped pool)."""
        keep = lengths > 0
        starts, lengths = starts[keep].astype(np.int64), lengths[keep].astype(np.int64)
        if starts.size == 0:
            return np.zeros(0, dtype=np.int64)
        if not self._regions:
            raise ValueError("no pool region is mapped")
        bases = np.array([r.base for r in self._regions], dtype=np.int64)
        ends = bases + np.array([r.size for r in self._regions], dtype=np.int64)
        firsts = np.array([r.first for r in self._regions], dtype=np.int64)
        idx = np.searchsorted(bases, starts, side="right") - 1
        inside = (idx >= 0) & (starts + lengths <= ends[np.maximum(idx, 0)])
        if not inside.all():
            bad = int(np.nonzero(~inside)[0][0])
            raise ValueError(f"host range [{int(starts[bad]):#x}, +{int(lengths[bad])}) is "
                             "outside the mapped pool")
        rel = starts - bases[idx]
        c0 = firsts[idx] + rel // self.chunk_bytes
        c1 = firsts[idx] + (rel + lengths - 1) // self.chunk_bytes
        parts = [c0, c1]
        for a, b in zip(c0[c1 - c0 > 1].tolist(), c1[c1 - c0 > 1].tolist(), strict=True):
            parts.append(np.arange(a + 1, b, dtype=np.int64))   # a run over whole chunks
        return np.unique(np.concatenate(parts))

    def span(self, starts: np.ndarray, lengths: np.ndarray) -> tuple[int, int] | None:
        """First and last chunk between the lowest and highest byte of the ranges, when one
        live region holds them all (a superset of the chunks they touch: O(n) and no sort,
        for the steady state where every chunk is DIRECT); None otherwise."""
        if starts.size == 0:
            return None
        lo = int(starts.min())
        hi = max(lo + 1, int((starts + lengths).max()))
        for r in self._regions:
            if r.base <= lo and hi <= r.base + r.size:
                return (r.first + (lo - r.base) // self.chunk_bytes,
                        r.first + (hi - 1 - r.base) // self.chunk_bytes)
        return None

    def span_direct(self, span: tuple[int, int]) -> bool:
        return bool((self._state[span[0]:span[1] + 1] == PinState.DIRECT).all())

    def status(self, chunks: np.ndarray) -> PinStatus:
        states = self._state[chunks]
        direct = states == PinState.DIRECT
        return PinStatus(bool((direct | (states == PinState.PINNED)).all()), bool(direct.all()))

    def want(self, chunks: np.ndarray) -> int:
        """Put the IDLE ones among `chunks` first in line; how many were queued."""
        idle = chunks[self._state[chunks] == PinState.IDLE].tolist()
        queued = set(self._wanted)
        fresh = [c for c in dict.fromkeys(idle) if c not in queued]
        self._wanted.extend(fresh)
        return len(fresh)

    # --------------------------------------------------------------- registration
    def next_job(self) -> PinJob | None:
        """The next chunk to register (wanted ones first, then in order); marks it BUSY."""
        while self._wanted:
            chunk = self._wanted.popleft()
            if self._state[chunk] == PinState.IDLE:
                return self._take(chunk)
        while self._cursor < self._state.size:
            chunk = self._cursor
            self._cursor += 1
            if self._state[chunk] == PinState.IDLE:
                return self._take(chunk)
        return None

    def _take(self, chunk: int) -> PinJob:
        self._state[chunk] = PinState.BUSY
        return self.job(chunk)

    def job(self, chunk: int) -> PinJob:
        return PinJob(chunk, self._address[chunk], self._size[chunk])

    def finish(self, job: PinJob, result: Registration) -> None:
        if self._state[job.chunk] != PinState.BUSY:
            raise RuntimeError(f"chunk {job.chunk} was not being registered")
        self._state[job.chunk] = (PinState.DIRECT if result.pinned and result.direct else
                                  PinState.PINNED if result.pinned else PinState.FAILED)

    # ---------------------------------------------------------------------- facts
    def count(self, state: PinState) -> int:
        return int((self._state == state).sum())

    @property
    def settled(self) -> bool:
        """Every live chunk has been tried (none IDLE or BUSY)."""
        return not bool((self._state <= PinState.BUSY).any())

    def registered(self) -> list[PinJob]:
        """Every chunk currently registered (to unregister at shutdown)."""
        return [self.job(int(c)) for c in
                np.nonzero((self._state == PinState.PINNED)
                           | (self._state == PinState.DIRECT))[0]]
