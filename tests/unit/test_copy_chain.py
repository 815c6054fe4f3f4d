"""The GPU fallback chain, the per-transfer route, and the data plane's knobs (no GPU)."""

from __future__ import annotations

import itertools

import pytest

from kvd_client.dataplane.chain import CopyMethod, DeviceCaps, choose_chain, route
from kvd_client.dataplane.options import DEFAULT_BLOCKS, DEFAULT_PIN_CHUNK, CopyOptions

K, B, L = CopyMethod.KERNEL, CopyMethod.BATCH, CopyMethod.LOOP
ALL = DeviceCaps(kernel_compiler=True, host_pointer_registered=True, memcpy_batch=True)


@pytest.mark.parametrize(("caps", "methods", "missing"), [
    (ALL, (K, B, L), ()),
    (DeviceCaps(False, True, True), (B, L), (K,)),
    (DeviceCaps(True, False, True), (B, L), (K,)),
    (DeviceCaps(True, True, False), (K, L), (B,)),
    (DeviceCaps(False, False, False), (L,), (K, B)),
])
def test_chain_keeps_the_usable_methods_in_order(caps, methods, missing):
    chain = choose_chain(caps)
    assert chain.methods == methods
    assert tuple(m for m, _ in chain.unavailable) == missing
    assert chain.describe().startswith(" -> ".join(m.value for m in methods))


def test_reasons_say_what_is_missing():
    text = choose_chain(DeviceCaps(False, False, False)).describe()
    assert "cupy" in text and "cuMemcpyBatchAsync" in text
    text = choose_chain(DeviceCaps(True, False, True)).describe()
    assert "cannot address registered host memory" in text


def test_forcing_a_method_puts_it_first_backed_by_the_loop():
    assert choose_chain(ALL, B).methods == (B, L)
    assert choose_chain(ALL, K).methods == (K, L)
    assert choose_chain(ALL, L).methods == (L,)
    with pytest.raises(ValueError, match="'kernel' cannot run here: .*host memory"):
        choose_chain(DeviceCaps(True, False, True), K)
    with pytest.raises(ValueError, match="'batch' cannot run here"):
        choose_chain(DeviceCaps(True, True, False), B)


@pytest.mark.parametrize(("pinned", "direct", "ready"),
                         list(itertools.product([False, True], repeat=3)))
def test_route_never_gives_the_kernel_memory_it_cannot_address(pinned, direct, ready):
    direct = direct and pinned           # DIRECT implies registered
    for forced in (None, K, B, L):
        chain = choose_chain(ALL, forced)
        method = route(chain, pinned=pinned, direct=direct, kernel_ready=ready)
        assert method in chain.methods
        if method is K:
            assert direct and ready
        if method is B:
            assert pinned
    best = route(choose_chain(ALL), pinned=pinned, direct=direct, kernel_ready=ready)
    assert best is (K if direct and ready else B if pinned else L)


def test_options_defaults_config_and_environment():
    assert CopyOptions.from_config({}, {}) == CopyOptions(None, DEFAULT_BLOCKS,
                                                         DEFAULT_PIN_CHUNK)
    opts = CopyOptions.from_config({"kvd_copy_backend": "Batch", "kvd_copy_blocks": 8,
                                    "kvd_pin_chunk_mib": 64}, {})
    assert opts == CopyOptions(B, 8, 64 << 20)
    env = {"KVD_COPY_BACKEND": "loop", "KVD_COPY_BLOCKS": "32", "KVD_PIN_CHUNK_MIB": "1024"}
    assert CopyOptions.from_config({}, env) == CopyOptions(L, 32, 1 << 30)
    # the engine's own config wins over the environment
    assert CopyOptions.from_config({"kvd_copy_backend": "auto"}, env).method is None


@pytest.mark.parametrize(("extra", "message"), [
    ({"kvd_copy_backend": "dma"}, "use one of auto, kernel, batch, loop"),
    ({"kvd_copy_blocks": 0}, "kvd_copy_blocks=0: must be in 1..1024"),
    ({"kvd_copy_blocks": "many"}, "not an integer"),
    ({"kvd_pin_chunk_mib": 3}, "multiple of 2"),
    ({"kvd_pin_chunk_mib": 1}, "must be in 2.."),
])
def test_bad_options_name_the_key(extra, message):
    with pytest.raises(ValueError, match=message):
        CopyOptions.from_config(extra, {})
