"""A CPU engine harness around vLLM 0.33's real Scheduler and OffloadingConnector.

It follows the pattern of vLLM's own connector test harness (a real scheduler, both connector
roles, CPU KV tensors, the spec loaded through `spec_module_path`), written for kvd: the spec is
KvdOffloadingSpec against a real `kvd serve`, and the "model" writes a recognisable pattern
into every KV block it computes so tests can check the bytes that come back from the pool.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

MODEL = "facebook/opt-125m"
EOS = 50256


@contextlib.contextmanager
def mla_model(on: bool) -> Iterator[None]:
    """Make the (OPT) model look like an MLA model to vLLM while the connectors are built:
    that, with TP > 1 over "mp" workers, is when vLLM declares the KV replicated."""
    if not on:
        yield
        return
    with mock.patch.object(ModelConfig, "use_mla", new_callable=mock.PropertyMock,
                           return_value=True):
        yield


@dataclass
class Rank:
    """One tensor-parallel worker: its connector and its own KV tensors."""

    rank: int
    worker: OffloadingConnector
    kv: torch.Tensor
    kv_window: torch.Tensor | None


@dataclass
class EngineStats:
    steps: int = 0
    round_trips: list[int] = field(default_factory=list)
    hit_tokens: dict[str, int] = field(default_factory=dict)


class Engine:
    """One engine instance: scheduler + worker connector + CPU KV cache."""

    def __init__(self, socket_path: str, *, block_size: int = 16, num_gpu_blocks: int = 64,
                 blocks_per_chunk: int = 1, head_size: int = 8,
                 extra: dict[str, Any] | None = None,
                 sliding_window: int | None = None, mla: bool = False,
                 world_size: int = 1, compute: bool = True, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512) -> None:
        """`sliding_window` (tokens) adds a second KV group, a sliding-window layer, as hybrid
        models (Gemma, gpt-oss) have. `mla` makes the layer an MLA latent cache (one vector
        per token, no V). `world_size` > 1 runs that many tensor-parallel workers in this
        process, each with its own KV tensors; the scheduler completes a job when all of
        them reported it, as vLLM's executor does. Sharded ranks hold different bytes (the
        pattern depends on the rank); MLA ranks hold the same. `compute=False` skips the
        pattern writes (benchmarks that time only the scheduler side). `max_num_seqs` and
        `max_num_batched_tokens` are the scheduler's (vLLM's defaults are 128 and 2048)."""
        self.compute = compute
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        extra_config: dict[str, Any] = {
            "spec_name": "KvdOffloadingSpec",
            "spec_module_path": "kvd_client.vllm",
            "kvd_socket": socket_path,
            "offload_prompt_only": False,
        }
        if blocks_per_chunk > 1:
            extra_config["block_size"] = block_size * blocks_per_chunk
        extra_config.update(extra or {})
        model_config = ModelConfig(model=MODEL, dtype="float16", seed=42)
        config = VllmConfig(
            model_config=model_config,
            parallel_config=ParallelConfig(tensor_parallel_size=world_size,
                                           distributed_executor_backend="mp"),
            scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                             max_num_batched_tokens=max_num_batched_tokens,
                                             max_model_len=4096, enable_chunked_prefill=True,
                                             is_encoder_decoder=False),
            # GPU prefix caching off: every prefix hit must come from kvd.
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=False),
            kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector",
                                                kv_role="kv_both",
                                                kv_connector_extra_config=extra_config),
            device_config=DeviceConfig("cpu"),
        )
        config.cache_config.num_gpu_blocks = num_gpu_blocks
        kind = MLAAttentionSpec if mla else FullAttentionSpec
        spec = kind(block_size=block_size, num_kv_heads=1, head_size=head_size,
                    dtype=torch.float32)
        groups = [KVCacheGroupSpec(["layer0"], spec)]
        if sliding_window is not None:
            config.scheduler_config.disable_hybrid_kv_cache_manager = False
            groups.append(KVCacheGroupSpec(["layer1"], SlidingWindowSpec(
                block_size=block_size, num_kv_heads=1, head_size=head_size,
                dtype=torch.float32, sliding_window=sliding_window)))
        kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks,
            kv_cache_tensors=[KVCacheTensor(size=g.kv_cache_spec.page_size_bytes * num_gpu_blocks,
                                            layers=list(g.layer_names),
                                            layer_stride=g.kv_cache_spec.page_size_bytes
                                            * num_gpu_blocks,
                                            block_stride=g.kv_cache_spec.page_size_bytes)
                              for g in groups],
            kv_cache_groups=groups)
        if mla:
            kv_cache_config.kv_tp_replicas = world_size   # every rank holds the whole latent
        sched_block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, config)
        self.config = config
        self.replicated = mla and world_size > 1
        shape = ((num_gpu_blocks, block_size, head_size) if mla
                 else (num_gpu_blocks, 2, block_size, 1, head_size))
        self.ranks: list[Rank] = []
        with mla_model(mla):
            self.scheduler = Scheduler(
                vllm_config=config, kv_cache_config=kv_cache_config, log_stats=True,
                structured_output_manager=StructuredOutputManager(config),
                block_size=sched_block, hash_block_size=hash_block)
            for rank in range(world_size):
                rank_config = config
                if rank:
                    rank_config = copy.deepcopy(config)
                    rank_config.parallel_config.rank = rank
                worker = OffloadingConnector(rank_config, KVConnectorRole.WORKER,
                                             kv_cache_config)
                kv = torch.zeros(shape, dtype=torch.float32)
                caches = {"layer0": kv}
                kv_window = None
                if sliding_window is not None:
                    kv_window = caches["layer1"] = torch.zeros_like(kv)
                with set_current_vllm_config(rank_config):
                    worker.register_kv_caches(caches)
                self.ranks.append(Rank(rank, worker, kv, kv_window))
        self.worker = self.ranks[0].worker
        self.kv = self.ranks[0].kv
        self.kv_window = self.ranks[0].kv_window
        self._recv_counts: Counter[str] = Counter()   # finished loads, reported per rank
        self.connector = self.scheduler.connector
        self.manager = self.connector.connector_scheduler.manager
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(block_size, sha256)
        self._ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self.stats = EngineStats()
        self.blocks_seen: dict[str, list[int]] = {}
        self.window_blocks_seen: dict[str, list[int]] = {}     # the sliding-window group's
        self.poison = False   # write -1 instead of the pattern: loaded blocks must not look so

    # ------------------------------------------------------------------ requests
    def add(self, req_id: str, tokens: list[int], max_tokens: int = 2,
            kv_transfer_params: dict | None = None) -> Request:
        """A request, as the OpenAI server makes one: its `kv_transfer_params` (a request
        body's field) ride in the sampling parameters' extra_args."""
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        params = SamplingParams(max_tokens=max_tokens, extra_args=extra)
        params.update_from_generation_config({}, EOS)
        req = Request(request_id=req_id, prompt_token_ids=tokens, sampling_params=params,
                      pooling_params=None, block_hasher=self._hasher)
        self.scheduler.add_request(req)
        return req

    def block_ids(self, req_id: str, group: int = 0) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[group])

    def expected_block(self, tokens: list[int], i: int, rank: int = 0) -> torch.Tensor:
        """The bytes the 'model' would have written into logical block i of a prompt."""
        return self.pattern(tokens[: (i + 1) * self.block_size], i, self.kv[0].shape,
                            rank=self.shard_of(rank))

    def shard_of(self, rank: int) -> int:
        """Whose bytes a rank holds: its own, or (replicated KV) everyone's the same."""
        return 0 if self.replicated else rank

    @staticmethod
    def pattern(token_ids: list[int], block_index: int, shape: torch.Size,
                group: int = 0, rank: int = 0) -> torch.Tensor:
        """What the 'model' writes into a block: a function of its tokens' prefix (and of the
        KV group and the rank's shard, so no slot can pass for another's)."""
        seed = hash((tuple(token_ids), block_index, group, rank)) & 0x7FFFFFFF
        g = torch.Generator().manual_seed(seed)
        return torch.rand(shape, generator=g)

    def _compute(self, out: Any) -> None:
        """Fill every block this step computes with its pattern (the model's KV writes)."""
        for req_id, num in out.num_scheduled_tokens.items():
            req = self.scheduler.requests.get(req_id)
            if req is None or num == 0:
                continue
            ids = self.block_ids(req_id)
            # schedule() has already advanced num_computed_tokens past this step's tokens.
            done = req.num_computed_tokens
            before = done - num
            for i in range(min(len(ids), done // self.block_size)):
                if (i + 1) * self.block_size <= before:
                    continue  # computed earlier (or loaded): leave it alone
                start = i * self.block_size
                tokens = req.all_token_ids[: start + self.block_size]
                for r in self.ranks:
                    shard = self.shard_of(r.rank)
                    r.kv[ids[i]] = -1.0 if self.poison else self.pattern(
                        tokens, i, r.kv[0].shape, rank=shard)
                    if r.kv_window is not None:
                        window_ids = self.block_ids(req_id, 1)
                        if i < len(window_ids) and window_ids[i] != 0:  # 0: outside window
                            r.kv_window[window_ids[i]] = -1.0 if self.poison else \
                                self.pattern(tokens, i, r.kv_window[0].shape, group=1,
                                             rank=shard)

    # -------------------------------------------------------------------- steps
    def step(self) -> Any:
        client = getattr(self.manager, "client", None)   # None for vLLM's own managers
        trips = client.round_trips if client is not None else 0
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        for r in self.ranks:
            r.worker.handle_preemptions(meta)
            r.worker.bind_connector_metadata(meta)
            r.worker.start_load_kv(self._ctx)
        if self.compute:
            self._compute(out)
        sending: set[str] = set()
        worker_meta = OffloadingWorkerMetadata()
        for r in self.ranks:
            r.worker.wait_for_save()
            rank_sending, rank_recving = r.worker.get_finished(out.finished_req_ids)
            sending |= rank_sending
            self._recv_counts.update(rank_recving)
            rank_meta = r.worker.build_connector_worker_meta()
            if rank_meta is not None:
                worker_meta = worker_meta.aggregate(rank_meta)
            r.worker.clear_connector_metadata()
        # A load is finished for the scheduler once every rank finished it.
        recving = {rid for rid, n in self._recv_counts.items() if n == len(self.ranks)}
        for rid in recving:
            del self._recv_counts[rid]
        running = self.scheduler.running
        ids = [r.request_id for r in running]
        for new in out.scheduled_new_reqs:
            self.stats.hit_tokens.setdefault(new.req_id, new.num_computed_tokens)
        for rid in out.num_scheduled_tokens:
            self.blocks_seen[rid] = self.block_ids(rid)
            if self.kv_window is not None:
                self.window_blocks_seen[rid] = self.block_ids(rid, 1)
        runner_out = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids], logprobs=None, prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(finished_sending=sending,
                                                  finished_recving=recving,
                                                  invalid_block_ids=set(),
                                                  kv_connector_worker_meta=worker_meta))
        self.scheduler.update_from_output(out, runner_out)
        self.stats.steps += 1
        if client is not None:
            self.stats.round_trips.append(client.round_trips - trips)
        return out

    def busy(self) -> bool:
        cs = self.connector.connector_scheduler
        return bool(self.scheduler.requests or cs._jobs or self.scheduler.finished_req_ids
                    or self.manager.has_pending_work())

    def run(self, max_steps: int = 200) -> int:
        """Step until every request finished and every transfer completed."""
        for n in range(max_steps):
            if not self.busy():
                return n
            self.step()
        raise AssertionError(f"engine still busy after {max_steps} steps")

    def close(self) -> None:
        if hasattr(self.manager, "client"):
            self.manager.shutdown()
        for r in self.ranks:
            worker = r.worker.connector_worker
            if worker is not None and getattr(worker, "worker", None) is not None:
                worker.worker.shutdown()

    def offload_worker(self, rank: int = 0) -> Any:
        """The OffloadingWorker (kvd's KvdOffloadingWorker) of a rank."""
        return self.ranks[rank].worker.connector_worker.worker
