"""The SGLang test environment (tests/support/sglang_env.py) against SGLang itself: its host
pools round-trip pages in every layout kvd serves, its zero-copy page pointers land inside the
pool, and its HiCacheController runs a backup and a prefetch through SGLang's own file backend.

If these fail, kvd's SGLang tests would be testing a broken stand-in rather than kvd."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

try:
    from tests.support import sglang_env as env
except ImportError as exc:
    pytest.skip(f"SGLang is not importable ({exc}); install it into the venv",
                allow_module_level=True)

BUILDERS = {"mha": env.mha_host_pool, "mla": env.mla_host_pool}


@pytest.fixture(params=env.PAGE_LAYOUTS)
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=sorted(BUILDERS))
def pool(request: pytest.FixtureRequest, layout: str) -> env.HostPool:
    return BUILDERS[request.param](layout)


def test_stand_ins_are_idempotent_and_leave_sglang_importable():
    before = {name: sys.modules[name] for name in ("torchvision", "torchvision.transforms",
                                                    "sglang.srt.multimodal.internvl_utils")}
    env.install_stand_ins()
    assert all(sys.modules[name] is module for name, module in before.items())
    from torchvision.transforms import InterpolationMode

    assert InterpolationMode.BICUBIC.name == "BICUBIC"
    with pytest.raises(AttributeError):
        _ = sys.modules["torchvision"].__file__


def test_pool_is_sglangs_own_in_the_asked_layout(pool: env.HostPool, layout: str):
    assert type(pool).__module__.startswith("sglang.srt.mem_cache.pool_host.")
    assert pool.layout == layout
    assert (pool.page_size, pool.page_num, pool.size) == (4, 32, 128)
    assert pool.kv_buffer.device.type == "cpu" and not pool.kv_buffer.is_pinned()


def test_fill_pages_round_trips_through_sglangs_page_accessors(pool: env.HostPool):
    written = env.fill_pages(pool, [0, 5, 31], seed=3)
    assert len(set(written.values())) == 3
    for page, data in written.items():
        assert env.page_bytes(pool, page * pool.page_size) == data
    assert env.page_bytes(pool, 6 * pool.page_size) == bytes(len(written[0])), \
        "an unfilled page changed"
    again = env.fill_pages(pool, [5], seed=4)
    assert again[5] != written[5] and env.page_bytes(pool, 5 * pool.page_size) == again[5]
    assert env.page_bytes(pool, 0) == written[0], "filling page 5 touched page 0"


def test_page_indices_are_the_tokens_of_each_page(pool: env.HostPool):
    indices = env.page_indices(pool, [7, 2])
    assert indices.tolist() == [28, 29, 30, 31, 8, 9, 10, 11]
    assert env.pages_of(pool, indices) == [7, 2]
    with pytest.raises(ValueError):
        env.page_indices(pool, [pool.page_num])


def test_page_buffer_meta_points_inside_the_kv_buffer(pool: env.HostPool):
    pages = [0, 9, 31]
    ptrs, sizes = pool.get_page_buffer_meta(env.page_indices(pool, pages))
    buffer = pool.kv_buffer
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    assert ptrs and len(ptrs) == len(sizes)
    assert len(ptrs) % len(pages) == 0
    for ptr, size in zip(ptrs, sizes):
        assert start <= ptr and ptr + size <= end
    assert sum(sizes) == len(pages) * len(env.page_bytes(pool, 0)), \
        "the pointers do not cover exactly the pages asked for"


def test_storage_config_defaults_to_one_rank_and_overrides():
    config = env.storage_config()
    assert (config.tp_rank, config.tp_size, config.pp_rank, config.pp_size) == (0, 1, 0, 1)
    assert (config.model_name, config.extra_config, config.is_mla_model) == \
        ("test/model", {}, False)
    assert config.is_storage_writer
    assert env.storage_config(is_mla_model=True, model_name="m").is_mla_model


def test_controller_backup_then_prefetch_round_trips_through_the_file_backend(
        pool: env.HostPool, tmp_path: Path):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    with env.controller(pool, "file", {"file_storage_path": str(tmp_path)}) as ctl:
        assert isinstance(ctl.storage_backend, HiCacheFile)
        threads = ctl.threads()
        assert all(thread.is_alive() for thread in threads)

        source = ctl.alloc_pages(3)
        written = env.fill_pages(pool, env.pages_of(pool, source), seed=11)
        tokens = list(range(1000, 1000 + len(source)))
        backup = ctl.write_storage(source, tokens)
        assert backup.completed_tokens == len(tokens)
        assert len(list(tmp_path.iterdir())) == 3

        result = ctl.prefetch("req-1", tokens)
        assert (result.hit_tokens, result.completed_tokens) == (len(tokens), len(tokens))
        assert result.acks[-1].completed_req
        assert set(env.pages_of(pool, result.host_indices)).isdisjoint(written)
        fetched = [env.page_bytes(pool, page * pool.page_size)
                   for page in env.pages_of(pool, result.host_indices)]
        assert fetched == [written[page] for page in env.pages_of(pool, source)]

        miss = ctl.prefetch("req-2", list(range(5000, 5000 + len(source))))
        assert (miss.hit_tokens, miss.completed_tokens) == (0, 0)
        ctl.release(result.host_indices)
        ctl.release(source)
    assert not any(thread.is_alive() for thread in threads)
    assert ctl.controller.storage_backend is None
