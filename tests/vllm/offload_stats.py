"""vLLM's offloading manager driven by key, and its offload metrics read as vLLM's frontend
reads them: offload keys, the empty schedule end, vLLM's Prometheus exporter of connector
metrics on a registry of its own, the scheduler's per-step stats payloads, and one exported
sample. Shared by this directory's manager-stats and store-threshold tests."""

from __future__ import annotations

import functools
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from vllm.v1.kv_offload.base import OffloadKey, ScheduleEndContext, make_offload_key

from .harness import Engine

END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def key(i: int) -> OffloadKey:
    return make_offload_key(f"block-{i}".encode().ljust(32, b"."), 0)


def keys(ids: list[int]) -> list[OffloadKey]:
    return [key(i) for i in ids]


def prometheus(engine: Engine) -> tuple[KVConnectorProm, CollectorRegistry]:
    """vLLM's frontend exporter of connector metrics (what serves /metrics), on a registry of
    its own, as PrometheusStatLogger builds it for engine 0."""
    registry = CollectorRegistry()

    class Prom(KVConnectorProm):
        _gauge_cls = functools.partial(Gauge, registry=registry)
        _counter_cls = functools.partial(Counter, registry=registry)
        _histogram_cls = functools.partial(Histogram, registry=registry)

    return Prom(engine.config, ["model_name", "engine"], {0: ["m", "0"]}), registry


def capture(engine: Engine) -> list[dict[str, Any]]:
    """Every step's `SchedulerStats.kv_connector_stats` payload (what the engine core sends
    to the frontend's stat loggers), appended as the engine steps."""
    payloads: list[dict[str, Any]] = []
    update = engine.scheduler.update_from_output

    def update_and_keep(*args: Any, **kwargs: Any) -> Any:
        outputs = update(*args, **kwargs)
        for out in outputs.values():
            stats = out.scheduler_stats
            if stats is not None and stats.kv_connector_stats is not None:
                payloads.append(stats.kv_connector_stats)
        return outputs

    engine.scheduler.update_from_output = update_and_keep  # type: ignore[method-assign]
    return payloads


def sample(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name, {"model_name": "m", "engine": "0"})
    assert value is not None, f"{name} is not exported"
    return value
