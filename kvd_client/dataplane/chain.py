"""Which copy method runs a GPU transfer: the fallback chain and the per-transfer route.

Pure logic (no CUDA): the chain is chosen once per process from what the device and the
installed packages can do, then each transfer takes the first method of the chain that can run
it given the pin state of the pool ranges it touches. A method is only ever used where it
produces the right bytes; speed is the chain's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class CopyMethod(StrEnum):
    KERNEL = "kernel"   # one gather/scatter launch; host memory addressed by the GPU directly
    BATCH = "batch"     # cuMemcpyBatchAsync: one driver call per transfer, DMA engines
    LOOP = "loop"       # one cuMemcpyAsync per run: always correct, CPU-bound when runs are many


@dataclass(frozen=True, slots=True)
class DeviceCaps:
    """What this process and device offer; probed once by the CUDA backend."""

    kernel_compiler: bool      # cupy (NVRTC) importable
    host_pointer_registered: bool  # CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: the kernel may
    #                                 dereference a registered range by its host address
    memcpy_batch: bool         # the driver exports cuMemcpyBatchAsync (CUDA 12.8+)


@dataclass(frozen=True, slots=True)
class Chain:
    methods: tuple[CopyMethod, ...]                 # best first; LOOP always last
    unavailable: tuple[tuple[CopyMethod, str], ...]  # methods left out, and why

    def describe(self) -> str:
        text = " -> ".join(m.value for m in self.methods)
        if self.unavailable:
            text += " (" + "; ".join(f"no {m.value}: {why}" for m, why in self.unavailable) + ")"
        return text


def unavailable_reason(method: CopyMethod, caps: DeviceCaps) -> str | None:
    """Why `method` cannot run on this device, or None if it can."""
    if method is CopyMethod.KERNEL:
        if not caps.kernel_compiler:
            return "cupy is not installed (pip install 'kvd-offload[cuda]')"
        if not caps.host_pointer_registered:
            return "the device cannot address registered host memory by its host address"
    if method is CopyMethod.BATCH and not caps.memcpy_batch:
        return "the CUDA driver has no cuMemcpyBatchAsync (needs 12.8 or newer)"
    return None


def choose_chain(caps: DeviceCaps, forced: CopyMethod | None = None) -> Chain:
    """The methods this process uses, best first. A forced method that cannot run is an error
    (an operator asked for it by name); otherwise it leads and the per-run loop backs it up
    for ranges it cannot reach."""
    if forced is not None:
        why = unavailable_reason(forced, caps)
        if why is not None:
            raise ValueError(f"copy backend {forced.value!r} cannot run here: {why}")
        methods = (forced,) if forced is CopyMethod.LOOP else (forced, CopyMethod.LOOP)
        return Chain(methods, ())
    usable, skipped = [], []
    for method in CopyMethod:
        why = unavailable_reason(method, caps)
        if why is None:
            usable.append(method)
        else:
            skipped.append((method, why))
    return Chain(tuple(usable), tuple(skipped))


def route(chain: Chain, *, pinned: bool, direct: bool, kernel_ready: bool) -> CopyMethod:
    """The method for one transfer. `pinned`: every pool range it touches is registered;
    `direct`: and the GPU can use those host addresses; `kernel_ready`: compiled and loaded.

    The kernel dereferences host addresses, so an unregistered range would fault (or, on
    some systems, migrate pages): it runs only on direct ranges. The batch call gets only
    pinned ranges; the loop copies pageable memory correctly (the driver stages it).
    """
    for method in chain.methods:
        if method is CopyMethod.KERNEL and direct and kernel_ready:
            return method
        if method is CopyMethod.BATCH and pinned:
            return method
        if method is CopyMethod.LOOP:
            return method
    return CopyMethod.LOOP
