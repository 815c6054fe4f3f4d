"""vLLM's OffloadingManager contract, through vLLM's own classes against a real daemon: what
kvd's manager answers where vLLM's CPU manager's answer is observable to the scheduler."""

from __future__ import annotations

import hashlib
import time

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

from kvd_client.vllm.manager import KvdOffloadingManager

CHUNK_TOKENS = 16


def keys_for(tag: str, n: int) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{tag}/{i}".encode()).digest(), 0)
            for i in range(n)]


def context(req_id: str, keys: list[bytes], first: int = 0) -> ReqContext:
    ctx = ReqContext(req_id=req_id)
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, (first + i + 1) * CHUNK_TOKENS)
    return ctx


def step(manager: KvdOffloadingManager) -> None:
    manager.on_schedule_end(None)  # type: ignore[arg-type]


def wait_read(manager: KvdOffloadingManager) -> None:
    """Steps until the daemon has read every record sent (bounded)."""
    deadline = time.monotonic() + 10
    while manager.has_pending_work():
        assert time.monotonic() < deadline, "the daemon did not read the engine's records"
        step(manager)
        time.sleep(0.005)


def test_a_failed_store_is_a_miss_at_once_and_offered_again_it_is_stored(engines):
    manager = engines().manager
    keys = keys_for("failed", 4)
    ctx = context("r-failed", keys)
    manager.lookup(keys[0], ctx)              # the step's first call
    out = manager.prepare_store(keys, ctx)
    assert out is not None and list(out.keys_to_store) == keys
    step(manager)
    wait_read(manager)                        # the index shows the keys being stored
    assert manager.lookup(keys[0], ctx) is LookupResult.HIT_PENDING
    # The copies failed: this engine knows now, before the daemon has read it.
    manager.complete_store(keys, ctx, success=False)
    assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 4
    again = manager.prepare_store(keys, ctx)
    assert again is not None and list(again.keys_to_store) == keys, \
        "vLLM's retry of the failed blocks was dropped"
    manager.complete_store(keys, ctx, success=True)
    step(manager)
    wait_read(manager)
    assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 4
    step(manager)


def test_a_completed_store_is_loadable_at_once_with_no_step_or_wait(engines):
    """vLLM's contract: once `complete_store` returns the blocks are loadable. The daemon reads
    the completion only after the step's end (its records go then), so in the steps between,
    the engine answers its own completed stores HIT and loads them from the slots it wrote, in
    the same step as the completion and in the next one (vLLM completes a store in
    update_from_output, after the step's on_schedule_end, and looks up in the next step's
    schedule: its SWA offload window tests see `get_num_new_matched_tokens` take the hit
    there)."""
    manager = engines().manager
    keys = keys_for("loadable", 4)
    ctx = context("r-loadable", keys)
    manager.lookup(keys[0], ctx)              # the step's first call
    out = manager.prepare_store(keys, ctx)
    assert out is not None and list(out.keys_to_store) == keys
    step(manager)
    wait_read(manager)                        # the daemon read the store: being stored
    assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 4
    step(manager)
    manager.complete_store(keys, ctx)         # between steps, as vLLM's update_from_output
    load_ctx = context("r-load", keys)
    assert [manager.lookup(k, load_ctx) for k in keys] == [LookupResult.HIT] * 4
    spec = manager.prepare_load(keys, load_ctx)
    assert list(spec.offsets) == list(out.store_spec.offsets)   # the slots this engine wrote
    manager.complete_load(keys, load_ctx)
    step(manager)
    wait_read(manager)                        # the daemon read the completion: READY
    assert [manager.lookup(k, load_ctx) for k in keys] == [LookupResult.HIT] * 4
    step(manager)


class PublicOnly(ReqContext):
    """A ReqContext whose private position table cannot be read: only the public method (the
    positions come from it; the lookups' lookahead, which reads the table as a hint only,
    does without)."""

    calls = 0

    def get_offload_key_position(self, key):
        PublicOnly.calls += 1
        return object.__getattribute__(self, "_offload_key_positions").get(key)

    def __getattribute__(self, name: str):
        if name == "_offload_key_positions":
            raise AttributeError("_offload_key_positions is not readable here")
        return super().__getattribute__(name)


def test_positions_come_from_vllms_public_api_only(engines):
    manager = engines().manager
    keys = keys_for("public", 40)
    ctx = PublicOnly(req_id="r-public")
    table = object.__getattribute__(ctx, "_offload_key_positions")   # as vLLM sets them
    for i, key in enumerate(keys):
        table[key] = (i + 1) * CHUNK_TOKENS
    assert manager.lookup(keys[0], ctx) == LookupResult.MISS
    out = manager.prepare_store(keys, ctx)
    assert out is not None and list(out.keys_to_store) == keys
    assert 0 < PublicOnly.calls <= len(keys)
    # Not consecutive: every key's position is read, and all are passed on.
    assert KvdOffloadingManager._positions(keys[:3] + keys[10:12], ctx) == \
        [16, 32, 48, 176, 192]
    assert list(KvdOffloadingManager._positions(keys[:10], ctx)) == [16 * i for i in range(1, 11)]
    manager.complete_store(keys, ctx, success=True)
    step(manager)


def test_positions_read_from_a_plain_context_are_what_its_public_method_answers():
    """For a plain ReqContext kvd reads the dict behind get_offload_key_position directly:
    the positions must be the method's answers (this fails if vLLM changes what the method
    reads)."""
    keys = keys_for("plain", 12)
    ctx = ReqContext(req_id="r-plain")
    for i, key in enumerate(keys[:10]):
        ctx.set_offload_key_position(key, (i + 1) * CHUNK_TOKENS)
    for part in (keys[:10], keys[:3] + keys[6:8], keys[2:5], keys[8:12]):
        want = [ctx.get_offload_key_position(k) for k in part]
        got = KvdOffloadingManager._positions(part, ctx)
        assert (None if None in want else want) == (None if got is None else list(got))


def test_an_unsupported_vllm_fails_at_engine_start_saying_what_is_missing(caplog):
    import types

    from vllm.v1.kv_offload import base, config

    from kvd_client.vllm import compat

    assert compat.check() == compat._version()
    assert compat.missing() == []
    old = types.ModuleType("vllm.v1.kv_offload.base")
    for name in compat.NAMES["vllm.v1.kv_offload.base"]:
        if name != "ScheduleEndContext":
            setattr(old, name, getattr(base, name))
    old.OffloadingManager = type("OffloadingManager", (), {"lookup": None})
    modules = {"vllm.v1.kv_offload.base": old, "vllm.v1.kv_offload.config": config}
    with pytest.raises(compat.UnsupportedVllm) as err:
        compat.check(modules, version="0.31.2")
    text = str(err.value)
    assert "vLLM 0.33.x" in text and "0.31.2" in text
    assert "vllm.v1.kv_offload.base.ScheduleEndContext" in text
    assert "OffloadingManager.prepare_store" in text
    with pytest.raises(compat.UnsupportedVllm, match="vllm.v1.kv_offload.config"):
        compat.check({"vllm.v1.kv_offload.base": base}, version="0.33.0")
    with caplog.at_level("WARNING"):
        assert compat.check(version="0.34.1") == "0.34.1"     # every name there: runs, warned
    assert "untested" in caplog.text
