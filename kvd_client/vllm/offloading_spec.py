"""KvdOffloadingSpec: what vLLM loads through `spec_module_path: kvd_client.vllm`."""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvd_client.client import KvdClient
from kvd_client.dataplane.options import CopyOptions
from kvd_client.offload.admission import admission_options
from kvd_client.offload.session import DEFAULT_RESERVE, OffloadSession
from kvd_client.vllm.manager import ANSWERS, KvdOffloadingManager
from kvd_client.vllm.offload_stats import metric_definitions
from kvd_client.vllm.sharing import DEFAULT_KEY_BYTES, is_replicated, layout_of, salt_of
from kvd_proto.paths import default_socket_path

log = logging.getLogger(__name__)


class KvdOffloadingSpec(OffloadingSpec):
    """Offload vLLM's KV cache to the node's kvd daemon.

    kv_connector_extra_config keys: `kvd_socket` (default: $KVD_SOCKET, else the daemon's
    default path), `kvd_deadline_ms` (per background call, default 500), `kvd_reserve` (the
    fewest slots held granted for stores; default 0: sized from the store rate, starting at
    256, twice what vLLM's default step budget of 2048 tokens stores in 16-token chunks),
    `kvd_keep_evicted` (default true: blocks evicted into the reserve's slots stay this
    engine's hits until it stores into them), `kvd_key_bytes` (longest offload key, default
    40: a 32-byte block hash and its group), the GPU data plane's `kvd_copy_backend`,
    `kvd_copy_blocks`, `kvd_pin_chunk_mib` (dataplane/options.py), plus vLLM's own
    (`block_size` / `blocks_per_chunk`, `offload_prompt_only`, `store_threshold` /
    `max_tracker_size`). All in docs/vllm.md.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]
                                 ) -> dict[str, OffloadingMetricMetadata]:
        """vLLM's CPU-tier series, which the manager's get_stats fills (vLLM's frontend
        exports only declared series, and rejects a payload naming any other)."""
        return metric_definitions(extra_config)

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        extra: dict[str, Any] = dict(self.extra_config)
        self.socket_path = str(extra.get("kvd_socket") or default_socket_path())
        self.deadline_s = float(extra.get("kvd_deadline_ms", 500)) / 1000.0
        self.reserve = int(extra.get("kvd_reserve", DEFAULT_RESERVE))
        self.keep_evicted = _flag(extra.get("kvd_keep_evicted", True), "kvd_keep_evicted")
        self.key_bytes = int(extra.get("kvd_key_bytes", DEFAULT_KEY_BYTES))
        # vLLM's admission filter, read as its CPU spec reads it (0, 64000: no filter)
        self.store_threshold, self.max_tracker_size = admission_options(extra)
        self.copy_options = CopyOptions.from_config(extra)
        # vLLM gates stores to rank 0 when this is set (its worker connector reads it).
        self.replicated_layout = is_replicated(config)
        self._manager: KvdOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            import vllm

            client = KvdClient(
                self.socket_path, model=self.config.model.name,
                layout=layout_of(self.config, self.key_bytes), salt=salt_of(self.config),
                engine_id=self.config.engine_id, engine_kind="vllm",
                engine_version=getattr(vllm, "__version__", ""), deadline_s=self.deadline_s)
            session = OffloadSession(
                client, reserve=self.reserve, keep_evicted=self.keep_evicted,
                enable_events=self.kv_events_config.enable_kv_cache_events, answers=ANSWERS)
            self._manager = KvdOffloadingManager(session, store_threshold=self.store_threshold,
                                                 max_tracker_size=self.max_tracker_size)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from kvd_client.vllm.worker import KvdOffloadingWorker

            parallel = self.config.parallel
            self._worker = KvdOffloadingWorker(
                self.socket_path, kv_caches, blocks_per_chunk=self.blocks_per_chunk,
                rank=parallel.rank, world_size=parallel.world_size,
                expected_shard_bytes=self.config.worker_kv_bytes_per_block
                * self.blocks_per_chunk, replicated=self.replicated_layout,
                options=self.copy_options, engine_id=self.config.engine_id)
        return self._worker


def _flag(value: Any, name: str) -> bool:
    """A boolean extra-config key (JSON true/false, or the strings vLLM's CLI may pass)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be true or false, not {value!r}")
