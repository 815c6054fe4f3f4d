"""What a namespace's shared index costs, and when it goes: an empty namespace is forgotten at
the sweep after its last session ended (once no ended reader's process may still act on what
it read, and its freed slots are back), and what one tenant's namespaces' indexes take is
bounded in bytes (`tenants.max_index_memory`), refused RESOURCE_EXHAUSTED naming the setting
and counted in the stats."""

from __future__ import annotations

import os

import pytest

from kvd_client.link.index_reader import Marks
from kvd_proto.wire import KvLayout
from kvd_server.cli.render import render_stats
from kvd_server.config import load_config
from kvd_server.core.core import KvdCore
from kvd_server.core.sessions import Session
from kvd_server.errors import KvdError
from kvd_server.ops.stats import StatsSnapshot
from tests.support.core import make_core, protocols, session, stats

LAYOUT = KvLayout(block_bytes=4096, num_ranks=1, shard_bytes=4096, tokens_per_block=16,
                  dtype="bf16", max_key_bytes=128)


def index_bytes() -> int:
    """One index of LAYOUT over make_core's 1 MiB pool (sized for the whole pool)."""
    core, _ = make_core()
    return core.namespaces.index_bytes_for(LAYOUT)


def reader(core: KvdCore, model: str, uid: int = 1000) -> tuple[Session, Marks]:
    """A fast-path engine's session in `model` that mapped the index and published the
    reclaim epoch it read, through its own mapping of its marks file."""
    s = session(core, uid=uid, model=model, layout=LAYOUT)
    index_fd, marks_fd = protocols(core).fastpath.attach_index(s)
    marks = Marks(os.dup(marks_fd))
    assert s.ns is not None and s.ns.index is not None and s.ns.index.fd == index_fd
    marks.publish(s.ns.index.reclaim_epoch)
    return s, marks


def models(core: KvdCore) -> list[str]:
    return sorted(ns.model for ns in core.namespaces)


def test_an_empty_namespace_goes_at_the_sweep_after_its_last_session():
    core, _ = make_core()
    s, marks = reader(core, "gone")
    other = session(core, model="gone", layout=LAYOUT)     # two sessions: the last one counts
    index = s.ns.index
    core.close_session(s, "closed", copies_done=True)
    marks.close()
    core.sweep()
    assert models(core) == ["gone"]
    core.close_session(other, "closed", copies_done=True)
    core.sweep()
    assert models(core) == [] and index.fd == -1, "the daemon still holds the index"
    doc = stats(core)["index_memory"]
    assert doc["bytes"] == 0 and doc["namespaces_forgotten_total"] == 1, doc
    # Nothing is lost: the same model comes back as a new namespace.
    again = session(core, model="gone", layout=LAYOUT)
    assert again.ns is not None and again.ns.index is not index


def test_an_ended_readers_process_that_lives_on_keeps_the_namespace_until_it_exits():
    """The readers' grace: a reader whose stream broke while its process runs may still act
    on what it read, so its namespace stays until the process exits (or says it is done)."""
    running = {1}
    core, _ = make_core(alive=lambda pid: pid in running)
    s, marks = reader(core, "grace")
    core.close_session(s, "stream closed")             # not CloseSession: it may still copy
    for _ in range(3):
        core.sweep()
    assert models(core) == ["grace"]
    running.clear()                                     # the process exited
    core.sweep()
    assert models(core) == []
    marks.close()


def test_freed_slots_waiting_for_a_reader_that_left_do_not_keep_the_namespace():
    """Slots a session was granted go to limbo while another session reads the index; once
    that one has closed too, the same sweep takes them back and forgets the namespace."""
    core, _ = make_core()
    writer, writer_marks = reader(core, "limbo")
    last, last_marks = reader(core, "limbo")
    assert protocols(core).fastpath.grant(writer, 4)
    core.close_session(writer, "closed", copies_done=True)
    ns = last.ns
    assert ns is not None and ns.slots.in_use, "the writer's slots should wait for the reader"
    core.close_session(last, "closed", copies_done=True)
    core.sweep()
    assert models(core) == []
    for marks in (writer_marks, last_marks):
        marks.close()


def test_a_namespace_holding_blocks_stays_without_sessions():
    core, _ = make_core()
    s = session(core, model="kept", layout=LAYOUT)
    answer, epoch = protocols(core).callpath.prepare_store(s, [b"k" * 8], "r", None)
    protocols(core).completions.complete_store(s, [b"k" * 8], True, "r", epoch)
    core.close_session(s, "closed", copies_done=True)
    core.sweep()
    assert models(core) == ["kept"]


def test_a_tenant_past_its_index_memory_is_refused_naming_the_setting():
    one = index_bytes()
    limit = 2 * one + one // 2
    core, _ = make_core(**{"tenants.uids": {"2000": "team-a", "3000": "team-b"},
                           "tenants.max_index_memory": str(limit)})
    a = [session(core, uid=2000, model=f"m{i}", layout=LAYOUT) for i in range(2)]
    with pytest.raises(KvdError) as e:
        session(core, uid=2000, model="m2", layout=LAYOUT)
    assert e.value.code == "RESOURCE_EXHAUSTED"
    assert "tenants.max_index_memory" in str(e.value) and "'team-a'" in str(e.value)
    tenants = stats(core)["index_memory"]["tenants"]
    assert tenants["team-a"] == {"bytes": 2 * one, "limit_bytes": limit, "refused_total": 1}
    # Another tenant has a limit of its own.
    for i in range(2):
        session(core, uid=3000, model=f"m{i}", layout=LAYOUT)
    assert stats(core)["index_memory"]["tenants"]["team-b"]["bytes"] == 2 * one
    # An unused namespace of the tenant gives way at once, before any sweep.
    core.close_session(a[0], "closed", copies_done=True)
    assert session(core, uid=2000, model="m2", layout=LAYOUT).ns is not None
    assert sorted(ns.model for ns in core.namespaces if ns.tenant == "team-a") == ["m1", "m2"]


def test_an_index_larger_than_the_limit_alone_is_refused_and_zero_means_no_limit():
    core, _ = make_core(**{"tenants.max_index_memory": str(index_bytes() - 1)})
    with pytest.raises(KvdError, match="tenants.max_index_memory"):
        session(core, model="big", layout=LAYOUT)
    core, _ = make_core(**{"tenants.max_index_memory": "0"})
    for i in range(8):
        session(core, model=f"m{i}", layout=LAYOUT)
    assert stats(core)["index_memory"]["tenants"]["default"]["limit_bytes"] == 0


def test_the_defaults_forget_at_once_and_bound_a_tenant_at_4GiB():
    tenants = load_config(None, env={}).tenants
    assert tenants.namespace_idle_timeout == 0 and tenants.max_index_memory == 4 << 30
    env = {"KVD_TENANTS_MAX_INDEX_MEMORY": "512MiB"}
    assert load_config(None, env=env).tenants.max_index_memory == 512 << 20


def test_kvd_stats_shows_each_tenants_index_memory_against_its_limit():
    core, _ = make_core(**{"tenants.max_index_memory": str(index_bytes())})
    session(core, model="m0", layout=LAYOUT)
    with pytest.raises(KvdError):
        session(core, model="m1", layout=LAYOUT)
    text = render_stats(StatsSnapshot.from_dict(stats(core)))
    section = text[text.index("# index memory"):text.index("# namespaces")]
    assert "in 1 namespaces" in section and "1 refused" in section, section
    assert all(len(line) <= 80 for line in section.splitlines()), section
