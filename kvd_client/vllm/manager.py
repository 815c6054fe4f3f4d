"""The scheduler side: vLLM's OffloadingManager over kvd's engine-neutral OffloadSession.

vLLM calls the manager synchronously on its scheduler thread. Every answer here is local
(kvd_client/offload/session.py): lookups read the namespace's shared index, loads are kept
safe by the epoch this engine publishes, stores go to slots granted in advance, and everything
the daemon must hear is sent in the background. No call waits for the daemon, so a slow,
stopped or dead daemon costs a step nothing (lookups answer MISS, stores are declined, vLLM
keeps serving). This module only translates vLLM's types to the session's.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

from kvd_client.client import KvdClient
from kvd_client.dataplane.planner import SKIP
from kvd_client.offload.admission import DEFAULT_MAX_KEYS, OfferCounter
from kvd_client.offload.session import OffloadSession
from kvd_client.vllm.offload_stats import OffloadStats
from kvd_client.vllm.transfer_spec import KvdSlotsSpec
from kvd_proto.native import key_positions

log = logging.getLogger(__name__)

# What OffloadSession.lookup answers, in vLLM's terms: miss, hit, pending.
ANSWERS = (LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING,
           LookupResult.RETRY)


class KvdOffloadingManager(OffloadingManager):
    def __init__(self, session: OffloadSession, *, store_threshold: int = 0,
                 max_tracker_size: int = DEFAULT_MAX_KEYS) -> None:
        """`store_threshold` >= 2 stores a block only once it was offered that many times
        (vLLM's admission filter, counted here: kvd_client/offload/admission.py); below 2, none."""
        self.session = session
        self._admission = OfferCounter(store_threshold, max_tracker_size) \
            if store_threshold >= 2 else None
        self._stats = OffloadStats(session, self._admission)
        # vLLM's scheduler calls lookup(key, req_context) once per chunk: straight into the
        # session, which answers in vLLM's LookupResult (see OffloadSession's `answers`).
        self.lookup = session.lookup  # type: ignore[method-assign,assignment]  # vLLM names the context req_context: passed by position

    @property
    def client(self) -> KvdClient:
        """The session's client, for tests and benchmarks."""
        return self.session.client

    @staticmethod
    def _positions(keys: Sequence[bytes], ctx: ReqContext) -> Sequence[int] | None:
        """The keys' token positions (what vLLM's ReqContext.get_offload_key_position
        answers), which the daemon uses only to order a request's blocks for eviction: a
        range from three reads when the keys are consecutive chunks, as they almost always are
        (kvd_proto/native.py key_positions, compiled where built). From a plain ReqContext
        the dict that method reads is read directly (three Python calls a store or load
        less); a subclass, or a context without that dict, is asked through the method."""
        if type(ctx) is ReqContext:
            table = ctx.__dict__.get("_offload_key_positions")
            if type(table) is dict:
                return key_positions(table, keys)
        return key_positions(ctx.get_offload_key_position, keys)

    # ---------------------------------------------------------------- lookups
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return self.session.lookup(key)       # replaced per instance by the session's own

    # ------------------------------------------------------------------ loads
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext
                     ) -> LoadStoreSpec:
        if type(keys) is not list:          # vLLM passes a list: used as it is (not changed)
            keys = list(keys)
        # vLLM loads only keys answered HIT in this step; one that was not is skipped (SKIP:
        # not transferred) and the session logs it.
        offsets = self.session.start_loads(keys, req_context.req_id,
                                           self._positions(keys, req_context), missing=SKIP)
        return KvdSlotsSpec(offsets, self.session.pool_id)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if keys:
            self.session.touch(list(keys), req_context.req_id)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        # vLLM passes the job's keys as a set: taken as it is (no copy, known distinct).
        self.session.finish_loads(keys, req_context.req_id)  # type: ignore[arg-type]

    # ----------------------------------------------------------------- stores
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext
                      ) -> PrepareStoreOutput | None:
        if type(keys) is not list:          # vLLM passes a list: used as it is (not changed)
            keys = list(keys)
        if self._admission is not None:      # store_threshold: new keys offered too seldom
            keys = self._admission.admit(keys, self._stats.view.new_keys)
        stored = self.session.store_slots(keys, req_context.req_id,
                                          self._positions(keys, req_context))
        if stored is None:
            self._stats.declined(keys)
            return None            # the reserve is short: vLLM offers these again later
        new, offsets = stored
        if new:
            self._stats.allocated(len(new))
        return PrepareStoreOutput(keys_to_store=new,
                                  store_spec=KvdSlotsSpec(offsets, self.session.pool_id),
                                  evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        self.session.complete_store(keys, req_context.req_id, success)  # type: ignore[arg-type]

    # --------------------------------------------------------- request scope
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        # An agent session's retention hint rides in the request's kv_transfer_params
        # ({"kvd": {"session": ..., "retain_s": ...}}: kvd_client/offload/hints.py).
        params = req_context.kv_transfer_params
        if params:
            self.session.hint(req_context.req_id, params)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.session.request_finished(req_context.req_id)

    def take_events(self) -> Iterable[OffloadingEvent]:
        for event in self.session.take_events():
            yield OffloadingEvent(keys=list(event.keys), medium=Medium.CPU,
                                  removed=event.removed, metadata_only=event.metadata_only)

    def has_pending_work(self) -> bool:
        return self.session.has_pending_work()

    # ------------------------------------------------------------------ resets
    def reset_cache(self) -> None:
        self.session.reset()

    def on_reset_flushed(self) -> None:
        self.session.reset_flushed()

    # --------------------------------------------------------------- the step
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        try:
            self.session.end_step()
        except Exception:  # never let kvd break a scheduler step
            log.exception("kvd end of step failed; offload skipped this step")

    # ----------------------------------------------------------------- metrics
    def get_stats(self) -> OffloadingConnectorStats | None:
        """vLLM's CPU-tier series (cache usage, write/read usage, allocation sizes, stores
        skipped) from local state only, as vLLM asks every step (vllm/offload_stats.py)."""
        return self._stats.take()

    def shutdown(self) -> None:
        self.session.close()
        self.session.client.close()
