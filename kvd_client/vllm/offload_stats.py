"""vLLM's CPU-tier offload metrics for a kvd engine: what `KvdOffloadingManager.get_stats` says.

vLLM's frontend exports the series its own CPU manager fills
(`vllm:kv_offload_cpu_cache_usage_perc`, `..._cpu_cache_write_usage_perc`,
`..._cpu_cache_read_usage_perc`, `..._cpu_allocation_size`, `..._stores_skipped`), so an
operator's vLLM dashboards read the offload tier from them. kvd fills them with vLLM's meaning,
from local state only: vLLM asks every step, on the scheduler thread, and the answer must not
wait for the daemon.

- capacity: the namespace's slots (its shared index's capacity, the blocks it holds with the
  whole pool), as vLLM's is its tier's chunks;
- write usage: this engine's stores in flight (slots handed out, copies not completed) over
  the capacity; read usage: its loads in flight (blocks pinned, copies not completed) over
  it; usage: both, vLLM's "pinned by active transfers", not how full the namespace is (the
  daemon's `kvd_` metrics say that, for every engine);
- allocation sizes: the new blocks of each store offer that had any, one sample per offer,
  the ones answered None included (as vLLM samples before it tries to make room);
- stores skipped: new blocks the store-threshold filter held back (kvd_client/offload/admission.py),
  declared and reported only with store_threshold >= 2, as vLLM's.

The transfer series (`vllm:kv_offload_load_bytes`, `..._store_bytes`, their times and sizes)
need nothing here: vLLM's connector fills them from what kvd's workers report per transfer.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import OffloadingMetricMetadata
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

from kvd_client.offload.admission import OfferCounter, admission_options
from kvd_client.offload.session import OffloadSession

MAX_SAMPLES = 1 << 16       # allocation sizes kept between two reports (vLLM takes them
                            # every step; an engine that never asks loses the excess)


def metric_definitions(extra_config: Mapping[str, Any]) -> dict[str, OffloadingMetricMetadata]:
    """The series get_stats fills, declared for vLLM's frontend (it rejects undeclared ones):
    vLLM's own CPU-tier definitions, so names, help texts and buckets are the same."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    threshold, _ = admission_options(extra_config)
    return CPUOffloadingSpec.build_metric_definitions({"store_threshold": threshold})


class SessionView:
    """Counts read from an `OffloadSession`'s local state: no daemon, no scan."""

    __slots__ = ("_session",)

    def __init__(self, session: OffloadSession) -> None:
        self._session = session

    @property
    def capacity(self) -> int:
        return self._session.capacity

    def stores_in_flight(self) -> int:
        return self._session.stores_in_flight

    def loads_in_flight(self) -> int:
        return self._session.loads_in_flight

    def new_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        return self._session.new_keys(keys)


class OffloadStats:
    """What one manager reports to vLLM's metrics (see the module doc)."""

    def __init__(self, session: OffloadSession, admission: OfferCounter | None) -> None:
        self.view = SessionView(session)
        self._session = session
        self._admission = admission
        self._sizes: list[int] = []
        self._skipped_reported = 0
        self.samples_dropped = 0

    def allocated(self, n: int) -> None:
        """A store offer with `n` new blocks."""
        if n <= 0:
            return
        if len(self._sizes) < MAX_SAMPLES:
            self._sizes.append(n)
        else:
            self.samples_dropped += 1

    def declined(self, keys: Sequence[bytes]) -> None:
        """A store offer answered None (the reserve was short): its new blocks, as vLLM
        samples an allocation it then cannot make room for."""
        self.allocated(len(self.view.new_keys(keys)))

    def _usage(self) -> tuple[float, float]:
        """(write usage, read usage) now, fractions of the capacity (see the module doc)."""
        session = self._session            # read directly: vLLM asks every step
        capacity = session.capacity
        if capacity <= 0:
            return 0.0, 0.0
        write = min(1.0, session.stores_in_flight / capacity)
        return write, min(1.0 - write, session.loads_in_flight / capacity)

    def take(self) -> OffloadingConnectorStats:
        """The stats since the last call: gauges now, the samples and counts taken since.

        The payload is built as vLLM's own set_gauge / observe_histogram / increase_counter
        calls would build it (`_PayloadShape`, learnt once from those calls), in one dict
        literal each: vLLM asks every step, and its calls cost ~10 us a step of a scheduler
        thread's time where these cost ~2 (tests/vllm/test_manager_stats.py compares them)."""
        write, read = self._usage()
        shape = _shape()
        types = shape.types.copy()
        values: dict[str, Any] = {shape.usage: {(): write + read}, shape.write: {(): write},
                                  shape.read: {(): read}}
        sizes, self._sizes = self._sizes, []
        if sizes:
            types[shape.allocation] = shape.histogram
            values[shape.allocation] = {(): sizes}
        if self._admission is not None:
            skipped = self._admission.skipped
            types[shape.skipped] = shape.counter
            values[shape.skipped] = {(): skipped - self._skipped_reported}
            self._skipped_reported = skipped
        return OffloadingConnectorStats({shape.types_key: types, shape.values_key: values,
                                         shape.info_key: None})

    def take_through_calls(self) -> OffloadingConnectorStats:
        """`take` made with vLLM's own payload calls (the reference `take` is tested against;
        same effects on the samples and counts taken)."""
        stats = OffloadingConnectorStats()
        write, read = self._usage()
        gauge = stats.set_gauge
        gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, write + read)
        sizes, self._sizes = self._sizes, []
        for n in sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, n)
        gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write)
        gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, read)
        if self._admission is not None:
            skipped = self._admission.skipped
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED,
                                   skipped - self._skipped_reported)
            self._skipped_reported = skipped
        return stats


class _PayloadShape:
    """Where vLLM's stats payload keeps what `take` fills, read off a payload made with its
    public calls (OffloadingConnectorStats documents the layout: {types: {name: type},
    data: {name: {labels: value}}, info}), so its key and type names are vLLM's own."""

    def __init__(self) -> None:
        usage = CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC
        allocation = CPUOffloadingMetrics.CPU_ALLOCATION_SIZE
        skipped = CPUOffloadingMetrics.STORES_SKIPPED
        probe = OffloadingConnectorStats()
        probe.set_gauge(usage, 0.0)
        probe.observe_histogram(allocation, 1)
        probe.increase_counter(skipped, 1)
        types_section, values_section = probe.metric_sections()
        keys = {id(section): key for key, section in probe.data.items()
                if isinstance(section, dict)}
        self.types_key = keys[id(types_section)]
        self.values_key = keys[id(values_section)]
        (self.info_key,) = set(probe.data) - {self.types_key, self.values_key}
        self.usage, self.allocation, self.skipped = usage, allocation, skipped
        self.write = CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC
        self.read = CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC
        gauge = types_section[usage]
        self.histogram = types_section[allocation]
        self.counter = types_section[skipped]
        # The gauges are always there, in the order vLLM's calls put them.
        self.types = {usage: gauge, self.write: gauge, self.read: gauge}


@functools.cache
def _shape() -> _PayloadShape:
    return _PayloadShape()
