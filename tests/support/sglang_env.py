"""Real SGLang HiCache objects on a CPU-only test machine, for kvd's SGLang storage tests.

kvd's SGLang backend is driven by SGLang's own host pools (`MHATokenToKVPoolHost`,
`MLATokenToKVPoolHost`) and, above them, SGLang's `HiCacheController`. Testing the backend
against hand-made fakes would only test our idea of SGLang; these helpers build the real
objects instead, on device "cpu" with unpinned host memory, so the tests run where no GPU is.

SGLang is installed into the test venv with `--no-deps` beside a CPU torch. Two of its import
chains want torchvision (the InternVL helpers and the DeepSeek-OCR config), whose wheel does not
load beside that torch; `install_stand_ins()` registers inert stand-ins for exactly those names
before anything from SGLang is imported. Nothing here copies SGLang's code: every pool, page
and pointer comes from SGLang's own methods.

The host-pool classes live in `sglang.srt.mem_cache.pool_host.mha` / `.mla` (this SGLang's
`memory_pool_host` module no longer re-exports them), and are imported from there.
"""

from __future__ import annotations

import enum
import importlib.util
import sys
import threading
import time
import types
import weakref
from contextlib import ExitStack
from dataclasses import dataclass, field
from queue import Empty, Queue
from typing import Any

import torch

PAGE_LAYOUTS = ("layer_first", "page_first", "page_first_direct")

_TORCHVISION_MODULES = (
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.functional",
    "torchvision.io",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
)


class _InterpolationMode(enum.Enum):
    """torchvision's enum by name: SGLang's configs read its members at import time."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _stand_in_getattr(name: str) -> type:
    """Any other torchvision name is a class nobody calls on the KV-cache path; dunders raise
    so that import machinery and introspection (`__file__`, `__spec__`...) see a plain module."""
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    return type(name, (), {"__module__": "torchvision stand-in"})


def _real_torchvision_loads() -> bool:
    """Whether an installed torchvision imports cleanly beside this torch; a failed attempt's
    half-imported modules are dropped so the stand-ins replace them whole."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means "use the stand-ins", as documented
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        return False
    return True


def install_stand_ins() -> None:
    """Register the torchvision and InternVL stand-ins SGLang's storage modules need to import.

    Why: SGLang is installed with --no-deps beside the CPU torch, and torchvision's index build
    (the wheel from PyTorch's package index, with its compiled ops) does not load beside that
    torch; yet `sglang.srt.multimodal.internvl_utils` and `sglang.srt.configs.deepseek_ocr`
    import torchvision at module level on the way to `sglang.srt.mem_cache`. HiCache uses
    neither, so inert modules suffice. `transformers.image_utils` is imported first: it probes
    torchvision with `importlib.util.find_spec`, which fails on a spec-less stand-in in
    `sys.modules`, and it caches the answer (absent) so it never asks again.

    Idempotent: an earlier call's stand-ins, or a real torchvision that imports cleanly, are
    left as they are.
    """
    if "sglang.srt.multimodal.internvl_utils" not in sys.modules:
        internvl = types.ModuleType("sglang.srt.multimodal.internvl_utils")
        internvl.IMAGENET_MEAN = (0.485, 0.456, 0.406)  # type: ignore[attr-defined]
        internvl.IMAGENET_STD = (0.229, 0.224, 0.225)  # type: ignore[attr-defined]
        sys.modules[internvl.__name__] = internvl
    if "torchvision" in sys.modules or _real_torchvision_loads():
        return
    import transformers.image_utils  # noqa: F401 - before the stand-ins; see the docstring

    for name in _TORCHVISION_MODULES:
        module = types.ModuleType(name)
        module.__path__ = []  # type: ignore[attr-defined]
        module.InterpolationMode = _InterpolationMode  # type: ignore[attr-defined]
        module.__getattr__ = _stand_in_getattr  # type: ignore[method-assign]
        sys.modules[name] = module
    for name in _TORCHVISION_MODULES[1:]:
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, sys.modules[name])

install_stand_ins()

from sglang.srt.managers.cache_controller import (  # noqa: E402 - after the stand-ins
    HiCacheController,
    PrefetchAck,
    StorageOperation,
)
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

HostPool = MHATokenToKVPoolHost | MLATokenToKVPoolHost
DevicePool = MHATokenToKVPool | MLATokenToKVPool

# Host pool -> the CPU "device" pool its buffer info came from. The host pool already holds the
# device tensors; this keeps the pool object itself for `controller()`, without an attribute
# of ours on SGLang's object.
_DEVICE_POOLS: weakref.WeakKeyDictionary[HostPool, DevicePool] = weakref.WeakKeyDictionary()

# One rank, no attention DP/CP, no pipeline, no decode CP: what `_generate_storage_config` and
# `attach_storage_backend` read from SGLang's parallel context (unpublished in a test process).
SINGLE_RANK = {
    "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1,
    "attn_tp_rank": 0, "attn_tp_size": 1, "attn_cp_rank": 0, "attn_cp_size": 1,
    "attn_dp_rank": 0, "attn_dp_size": 1, "attn_dcp_rank": 0, "attn_dcp_size": 1,
}


def _device_tokens(pages: int, page_size: int) -> int:
    """Device-pool tokens for a host pool of `pages` pages: half of it (a hicache ratio of 2),
    at least one page, so the host pool is the larger tier as SGLang expects."""
    if pages <= 0 or page_size <= 0:
        raise ValueError(f"pages={pages}, page_size={page_size}: both must be positive")
    return max(pages // 2, 1) * page_size


def mha_host_pool(
    layout: str, *, layers: int = 4, heads: int = 2, head_dim: int = 16, page_size: int = 4,
    pages: int = 32, dtype: torch.dtype = torch.bfloat16,
) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool on CPU, unpinned, holding exactly `pages` pages in `layout`.

    Its buffer info comes from a real `MHATokenToKVPool` built on device "cpu"
    (`get_device_pool_infos()`, as SGLang's host-pool assembler does), so the device-side
    geometry, padding page and pointer tables are SGLang's own. `host_token_capacity` makes the
    pool exactly `pages * page_size` tokens (no padding page): page p is tokens
    [p * page_size, (p + 1) * page_size)."""
    device = MHATokenToKVPool(
        size=_device_tokens(pages, page_size), page_size=page_size, dtype=dtype,
        head_num=heads, head_dim=head_dim, layer_num=layers, device="cpu",
        enable_memory_saver=False, enable_alt_stream=False)
    info = device.get_device_pool_infos()[0].buffer_info
    host = MHATokenToKVPoolHost(
        info, host_to_device_ratio=2.0, host_size=0, page_size=page_size, layout=layout,
        pin_memory=False, device="cpu", device_capacity_tokens=device.size,
        start_layer=device.start_layer, end_layer=device.end_layer,
        host_token_capacity=pages * page_size)
    _DEVICE_POOLS[host] = device
    return host


def mla_host_pool(
    layout: str, *, layers: int = 4, kv_lora_rank: int = 32, qk_rope_head_dim: int = 8,
    page_size: int = 4, pages: int = 32, dtype: torch.dtype = torch.bfloat16,
) -> MLATokenToKVPoolHost:
    """SGLang's MLA host pool on CPU, unpinned, holding exactly `pages` pages in `layout`,
    described by a real CPU `MLATokenToKVPool` (see `mha_host_pool`)."""
    device = MLATokenToKVPool(
        size=_device_tokens(pages, page_size), page_size=page_size, dtype=dtype,
        kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, layer_num=layers,
        device="cpu", enable_memory_saver=False)
    info = device.get_device_pool_infos()[0].buffer_info
    host = MLATokenToKVPoolHost(
        info, host_to_device_ratio=2.0, host_size=0, page_size=page_size, layout=layout,
        pin_memory=False, device="cpu", override_kv_cache_dim=device.kv_cache_dim,
        device_capacity_tokens=device.size, start_layer=device.start_layer,
        end_layer=device.end_layer, target_layer_num=device.layer_num,
        host_token_capacity=pages * page_size)
    _DEVICE_POOLS[host] = device
    return host


def device_pool_of(pool: HostPool) -> DevicePool:
    """The CPU device pool a host pool from this module was built over."""
    return _DEVICE_POOLS[pool]


def page_indices(pool: HostPool, pages: list[int]) -> torch.Tensor:
    """The host token indices SGLang hands `batch_get_v1` / `batch_set_v1` for `pages`:
    `page_size` consecutive tokens per page, page i starting at pages[i] * page_size (int64,
    on CPU, as the controller slices `operation.host_indices`)."""
    size = pool.page_size
    for page in pages:
        if not 0 <= page < pool.page_num:
            raise ValueError(f"page {page} is outside the pool's {pool.page_num} pages")
    if not pages:
        return torch.empty(0, dtype=torch.int64)
    starts = torch.tensor(pages, dtype=torch.int64) * size
    return (starts[:, None] + torch.arange(size, dtype=torch.int64)).reshape(-1)


def pages_of(pool: HostPool, host_indices: torch.Tensor) -> list[int]:
    """The page numbers of page-aligned host token indices (the inverse of `page_indices`)."""
    if len(host_indices) % pool.page_size:
        raise ValueError(f"{len(host_indices)} indices are not whole {pool.page_size}-pages")
    return [int(i) // pool.page_size for i in host_indices[:: pool.page_size]]


def _flat_page_bytes(pool: HostPool) -> int:
    """Bytes of one flat page, as SGLang sizes the storage read buffer for it."""
    page = pool.get_dummy_flat_data_page()
    return page.numel() * page.element_size()


def page_pattern(pool: HostPool, page: int, seed: int) -> bytes:
    """The bytes `fill_pages` writes into `page` for `seed`: pseudo-random, so every page (and
    every seed) differs and a misplaced page, layer or K/V half shows as a mismatch."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + page)
    data = torch.randint(0, 256, (_flat_page_bytes(pool),), dtype=torch.uint8,
                         generator=generator)
    return data.numpy().tobytes()


def fill_pages(pool: HostPool, pages: list[int], seed: int) -> dict[int, bytes]:
    """Write `page_pattern(pool, page, seed)` into each of `pages` through SGLang's own
    `set_from_flat_data_page` (the path a storage read takes into the pool); returns the bytes
    written, by page. The bytes are reinterpreted, never converted, as the pool's dtype."""
    written: dict[int, bytes] = {}
    for page in pages:
        data = page_pattern(pool, page, seed)
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(pool.dtype)
        pool.set_from_flat_data_page(page * pool.page_size, flat)
        written[page] = data
    return written


def page_bytes(pool: HostPool, token_index: int) -> bytes:
    """The flat bytes of the page starting at host token `token_index`, read through SGLang's
    `get_data_page(index, flat=True)` (the path a storage write takes out of the pool)."""
    page = pool.get_data_page(token_index, flat=True).contiguous()
    return page.view(torch.uint8).numpy().tobytes()


def storage_config(**overrides: Any) -> HiCacheStorageConfig:
    """SGLang's `HiCacheStorageConfig` for one rank, as `HiCacheController` would make it for a
    single-GPU MHA model with a layer-first host pool; any field can be overridden."""
    fields: dict[str, Any] = {
        "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0,
        "attn_cp_size": 1, "is_mla_model": False, "enable_storage_metrics": False,
        "is_page_first_layout": False, "model_name": "test/model", "extra_config": {},
    }
    fields.update(overrides)
    return HiCacheStorageConfig(**fields)


@dataclass
class PrefetchResult:
    """What one prefetch brought into the host pool: the host tokens SGLang allocated for the
    storage hit, how many of them the backend filled, and every ack the controller sent."""

    host_indices: torch.Tensor
    hit_tokens: int
    completed_tokens: int
    acks: list[PrefetchAck] = field(default_factory=list)


class Controller:
    """SGLang's real `HiCacheController` on CPU with its storage threads running, driven the
    way SGLang's radix cache drives it (its scheduler-side steps done here, bounded by timeouts).

    The controller is built over the CPU device pool behind `host_pool`, a real paged
    allocator, `tp_group=None` and io_backend "direct"; SGLang's parallel context is overridden
    to one rank for the controller's lifetime (the storage threads read it) and restored by
    `close()`. Only the L2<->L3 path (host pool <-> storage backend) is exercised; the
    device<->host copies need SGLang's CUDA kernels and are not used.
    """

    def __init__(self, host_pool: HostPool, backend_name: str, extra_config: dict[str, Any],
                 *, model_name: str = "test/model", prefetch_threshold: int = 0) -> None:
        self.host_pool = host_pool
        self.page_size = host_pool.page_size
        self.device_pool = device_pool_of(host_pool)
        self._scope = ExitStack()
        self._scope.enter_context(get_parallel().override(**SINGLE_RANK))
        try:
            self.allocator = PagedTokenToKVPoolAllocator(
                size=self.device_pool.size, page_size=self.page_size,
                dtype=self.device_pool.dtype, device="cpu", kvcache=self.device_pool,
                need_sort=False)
            self.controller = HiCacheController(
                token_to_kv_pool_allocator=self.allocator, mem_pool_host=host_pool,
                page_size=self.page_size, tp_group=None, load_cache_event=threading.Event(),
                io_backend="direct", storage_backend=backend_name,
                prefetch_threshold=prefetch_threshold, model_name=model_name,
                storage_backend_extra_config=dict(extra_config))
        except BaseException:
            self._scope.close()
            raise

    @property
    def storage_backend(self) -> Any:
        """The storage backend instance SGLang's factory made (`HiCacheFile`, kvd's, ...)."""
        return self.controller.storage_backend

    def threads(self) -> list[threading.Thread]:
        """The controller's four storage threads (prefetch, prefetch I/O, prefetch sync,
        backup)."""
        c = self.controller
        return [c.prefetch_thread, c.prefetch_io_aux_thread, c.prefetch_sync_thread,
                c.backup_thread]

    def page_hashes(self, token_ids: list[int]) -> list[str]:
        """The storage keys SGLang derives for `token_ids`, one per full page, with the same
        call (and namespace seed) its prefetch hit query uses."""
        return list(get_storage_hash_str(token_ids, None, page_size=self.page_size))

    def write_storage(self, host_indices: torch.Tensor, token_ids: list[int],
                      *, timeout: float = 30.0) -> StorageOperation:
        """Back up the host pages at `host_indices` (holding `token_ids`) to storage through
        the controller's backup thread, and wait for its ack; returns the acked operation
        (`completed_tokens` says how much was stored).

        The page hashes are computed here, as SGLang's radix cache does before it calls
        `write_storage`; without them the backup thread has nothing to write."""
        if len(host_indices) != len(token_ids) or len(token_ids) % self.page_size:
            raise ValueError(f"{len(host_indices)} host indices for {len(token_ids)} tokens; "
                             f"both must be the same whole number of {self.page_size}-pages")
        op_id = self.controller.write_storage(host_indices, token_ids,
                                              hash_value=self.page_hashes(token_ids))
        deadline = time.monotonic() + timeout
        while True:
            operation = self._get(self.controller.ack_backup_queue, deadline, "backup ack")
            if operation.id == op_id:
                return operation

    def prefetch(self, request_id: str, token_ids: list[int], *,
                 timeout: float = 30.0) -> PrefetchResult:
        """Prefetch `token_ids` from storage into newly allocated host pages, and wait for the
        controller's final ack.

        SGLang's controller does this in two halves around the scheduler: its prefetch thread
        answers the hit query into `prefetch_hit_queue`; the scheduler allocates host pages
        for the hit and queues the operation on `prefetch_buffer`; the I/O thread reads the
        pages and acks through `ack_prefetch_queue`, ending with `completed_req`. The
        scheduler's steps are done here. The caller owns the returned host pages
        (`release(result.host_indices)` frees them)."""
        deadline = time.monotonic() + timeout
        operation = self.controller.prefetch(request_id, token_ids)
        while True:
            hit = self._get(self.controller.prefetch_hit_queue, deadline, "hit query")
            if hit is operation:
                break
        hit_tokens = operation.storage_hit_count
        empty = torch.empty(0, dtype=torch.int64)
        if hit_tokens == 0:
            return PrefetchResult(host_indices=empty, hit_tokens=0, completed_tokens=0)
        host_indices = self.controller.alloc_prefetch_host_buffers(operation, hit_tokens)
        if host_indices is None:
            raise RuntimeError(f"host pool has no room for a {hit_tokens}-token prefetch")
        operation.host_indices = host_indices
        self.controller.prefetch_buffer.put(operation)
        acks: list[PrefetchAck] = []
        while True:
            ack = self._get(self.controller.ack_prefetch_queue, deadline, "prefetch ack")
            if ack.operation is not operation:
                continue
            acks.append(ack)
            if ack.completed_req:
                break
        completed = max((a.completed_tokens or 0 for a in acks), default=0)
        return PrefetchResult(host_indices=host_indices, hit_tokens=hit_tokens,
                              completed_tokens=completed, acks=acks)

    def alloc_pages(self, count: int) -> torch.Tensor:
        """Host token indices for `count` pages from the host pool's own allocator, so pages
        filled for a backup are not handed out again by a prefetch's allocation."""
        indices = self.host_pool.alloc(count * self.page_size)
        if indices is None:
            raise RuntimeError(f"host pool has no room for {count} pages")
        return indices

    def release(self, host_indices: torch.Tensor) -> None:
        """Return host pages (prefetched or from `alloc_pages`) to the host pool."""
        if host_indices.numel():
            self.host_pool.free(host_indices)

    def close(self) -> None:
        """Stop the storage threads (SGLang's `detach_storage_backend`: bounded joins, raises
        if one stays alive), close the backend, and restore the parallel context."""
        try:
            self.controller.detach_storage_backend()
        finally:
            self._scope.close()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _get(queue: Queue[Any], deadline: float, what: str) -> Any:
        """The next item of one of the controller's queues, or TimeoutError at `deadline`:
        a stuck storage thread fails the test instead of hanging it."""
        try:
            return queue.get(timeout=max(deadline - time.monotonic(), 0.001))
        except Empty:
            raise TimeoutError(f"no {what} from SGLang's HiCacheController in time") from None

def controller(host_pool: HostPool, backend_name: str,
               extra_config: dict[str, Any]) -> Controller:
    """SGLang's `HiCacheController` over `host_pool` (built by this module) with the storage
    backend `backend_name` ("file", "dynamic", ...) attached and its threads running; close it
    (or use it as a context manager) to stop them."""
    return Controller(host_pool, backend_name, extra_config)
