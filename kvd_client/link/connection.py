"""What a session with the daemon needs before its first step: the namespace's index, the
session's marks file and channel, the namespace's "held below" table (a daemon with a tier
under the pool), and a first grant of slots. Made by whichever thread
connects (the engine's at start, the client's background thread after a reconnect), never by
a step; the session adopts it at its next step."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

from kvd_client.client import KvdClient
from kvd_client.link.channel import SessionChannel
from kvd_client.link.index_reader import BelowMap, IndexReader, Marks
from kvd_proto import kvd_pb2

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Connection:
    generation: int             # the client's, when it was made
    index: IndexReader
    marks: Marks
    channel: SessionChannel
    offsets: list[int] = field(default_factory=list)   # slots granted up front
    below: BelowMap | None = None

    def close(self) -> None:
        self.index.close()
        self.marks.close()
        self.channel.close()
        if self.below is not None:
            self.below.close()


def connect(client: KvdClient, first_grant: int) -> Connection | None:
    """Map the session's index and channel and take `first_grant` slots; None (offload off
    for this session: logged) when the daemon hands over nothing this client can use."""
    generation = client.generation
    mapped = client.map_index()
    if mapped is None:
        return None
    chan = client.map_channel()
    if chan is None:
        for fd in mapped:
            os.close(fd)
        return None
    try:
        index = IndexReader(mapped[0])
    except (OSError, ValueError) as exc:
        for fd in (*mapped, *chan):
            os.close(fd)
        log.error("kvd daemon handed over an index this client cannot read (%s); offload "
                  "stays off for this session", exc)
        return None
    try:
        channel = SessionChannel(*chan)
    except (OSError, ValueError) as exc:
        index.close()
        for fd in (mapped[1], *chan):
            os.close(fd)
        log.error("kvd daemon handed over a channel this client cannot use (%s); offload "
                  "stays off for this session", exc)
        return None
    # Its marks stay 0 ("nothing read") until the first step publishes an epoch.
    connection = Connection(generation, index, Marks(mapped[1]), channel,
                            below=_map_below(client))
    results = client.step([kvd_pb2.StepOp(grant=kvd_pb2.GrantRequest(count=first_grant))])
    if results:
        connection.offsets = list(results[0].grant.slot_offsets)
    return connection


def _map_below(client: KvdClient) -> BelowMap | None:
    """The namespace's "held below" table, where the daemon has one (None: keys held below
    the pool answer MISS)."""
    fd = client.map_below()
    if fd is None:
        return None
    try:
        return BelowMap(fd)
    except (OSError, ValueError) as exc:
        os.close(fd)
        log.warning("kvd daemon handed over a below table this client cannot read (%s); keys "
                    "held below the pool answer MISS", exc)
        return None


class Handoff:
    """The latest connection made for the session to adopt (set by the connecting thread,
    taken by the scheduler thread at a step's start)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connection: Connection | None = None

    def put(self, connection: Connection) -> None:
        with self._lock:
            stale, self._connection = self._connection, connection
        if stale is not None:
            stale.close()

    def take(self, generation: int) -> Connection | None:
        """The connection made for client generation `generation`, if it is here."""
        with self._lock:
            connection = self._connection
            if connection is None or connection.generation != generation:
                return None
            self._connection = None
            return connection

    def close(self) -> None:
        with self._lock:
            stale, self._connection = self._connection, None
        if stale is not None:
            stale.close()
