"""The few CUDA driver calls the GPU data plane makes, through ctypes on libcuda.so.1.

The driver API, not the runtime: there is exactly one driver per machine, so no version can
mismatch the runtime torch or cupy bring, and a symbol's presence says what the driver can do
(cuMemcpyBatchAsync: 12.8+). Importing this module loads nothing; `CudaDriver()` does.
Every call runs in the CUDA context current on the calling thread (torch's primary context
on the engine's threads; `set_context` on others).
"""

from __future__ import annotations

import ctypes

import numpy as np

from .pin_table import Registration

ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
REGISTER_PORTABLE = 0x01          # pinned for every context, not just the current one
REGISTER_DEVICEMAP = 0x02         # mapped into the device's address space
MEMCPY_SRC_ACCESS_ORDER_STREAM = 1  # read the source in stream order (it may still be written)

_u64 = ctypes.c_uint64
_ptr = ctypes.c_void_p


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


class CudaError(RuntimeError):
    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} failed with CUDA error {code}")
        self.code = code


class CudaDriver:
    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._lib = lib
        sig = {
            "cuCtxGetCurrent": [ctypes.POINTER(_ptr)],
            "cuCtxSetCurrent": [_ptr],
            "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
            "cuDriverGetVersion": [ctypes.POINTER(ctypes.c_int)],
            "cuMemHostRegister_v2": [_ptr, ctypes.c_size_t, ctypes.c_uint],
            "cuMemHostUnregister": [_ptr],
            "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(_u64), _ptr, ctypes.c_uint],
            "cuMemcpyAsync": [_u64, _u64, ctypes.c_size_t, _ptr],
        }
        for name, args in sig.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
        # The unsuffixed export keeps the 12.8 ABI (with failIdx) in every later driver.
        self._batch = getattr(lib, "cuMemcpyBatchAsync", None)
        if self._batch is not None:
            self._batch.argtypes = [_ptr, _ptr, _ptr, ctypes.c_size_t, _ptr, _ptr,
                                    ctypes.c_size_t, _ptr, _ptr]
            self._batch.restype = ctypes.c_int
        self._attrs = _MemcpyAttributes(srcAccessOrder=MEMCPY_SRC_ACCESS_ORDER_STREAM)

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise CudaError(what, rc)

    # -------------------------------------------------------------- context / device
    def current_context(self) -> int:
        ctx = _ptr()
        self._check(self._lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            raise CudaError("cuCtxGetCurrent (no current context)", 201)
        return int(ctx.value)

    def set_context(self, ctx: int) -> None:
        self._check(self._lib.cuCtxSetCurrent(_ptr(ctx)), "cuCtxSetCurrent")

    def attribute(self, attr: int, device: int) -> int:
        value = ctypes.c_int()
        self._check(self._lib.cuDeviceGetAttribute(ctypes.byref(value), attr, device),
                    "cuDeviceGetAttribute")
        return value.value

    def version(self) -> int:
        v = ctypes.c_int()
        self._check(self._lib.cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
        return v.value

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    # ------------------------------------------------------------------ host memory
    def register(self, address: int, size: int) -> Registration:
        """Pin [address, address + size) and say whether the GPU may use it by its host
        address (the kernel's requirement; checked, never assumed)."""
        register = self._lib.cuMemHostRegister_v2
        rc = register(_ptr(address), size, REGISTER_PORTABLE | REGISTER_DEVICEMAP)
        if rc != 0:   # a context that cannot map host memory may still pin it for DMA
            rc = register(_ptr(address), size, REGISTER_PORTABLE)
        if rc != 0:
            return Registration(False, False)
        dptr = _u64()
        rc = self._lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), _ptr(address), 0)
        return Registration(True, rc == 0 and dptr.value == address)

    def unregister(self, address: int) -> None:
        self._lib.cuMemHostUnregister(_ptr(address))

    # ---------------------------------------------------------------------- copies
    def memcpy_runs(self, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray,
                    stream: int) -> None:
        """One cuMemcpyAsync per run (unified addressing picks each direction)."""
        copy = self._lib.cuMemcpyAsync
        handle = _ptr(stream)
        for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
            rc = copy(d, s, n, handle)
            if rc != 0:
                raise CudaError("cuMemcpyAsync", rc)

    def memcpy_batch(self, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray,
                     stream: int) -> None:
        """All runs in one cuMemcpyBatchAsync; the arrays are read during the call."""
        if self._batch is None:
            raise CudaError("cuMemcpyBatchAsync (absent from this driver)", 500)
        src = np.ascontiguousarray(src, dtype=np.uint64)
        dst = np.ascontiguousarray(dst, dtype=np.uint64)
        sizes = np.ascontiguousarray(lengths, dtype=np.uint64)
        index = ctypes.c_size_t(0)
        fail = ctypes.c_size_t(0)
        rc = self._batch(dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, sizes.size,
                         ctypes.byref(self._attrs), ctypes.byref(index), 1,
                         ctypes.byref(fail), _ptr(stream))
        if rc != 0:
            raise CudaError(f"cuMemcpyBatchAsync (copy {fail.value})", rc)
