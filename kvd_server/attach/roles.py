"""What the daemon answers on the attach socket, role by role (docs/attach.md).

`engine` opens a session and hands over its tenant's pool file; `dataplane` hands over the
pool only (a file-backed pool only to the daemon's uid and root: `pool.may_hold`); `admin`
issues an admin token to an admin peer; `report` takes a worker's transfer totals; `index`
and `channel` hand a registered session its namespace's shared index (with its marks file)
and its channel (rings + eventfd); `below` hands it its namespace's "held below" table (a
daemon with a tier under the pool). The peer's identity is the kernel's (SO_PEERCRED); a
refusal is a KvdError whose status name becomes the answer's `code`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvd_proto import below_layout
from kvd_proto import channel as channel_layout
from kvd_proto.attach import (
    ROLE_ADMIN,
    ROLE_BELOW,
    ROLE_CHANNEL,
    ROLE_INDEX,
    ROLE_REPORT,
    ROLE_TENANT,
    AttachRequest,
)
from kvd_proto.index_layout import VERSION as INDEX_VERSION
from kvd_proto.wire import SLOT_ALIGNMENT
from kvd_server import __version__
from kvd_server.attach.server import AttachReply
from kvd_server.channel.hub import ChannelHub
from kvd_server.core.core import KvdCore, TransferStats
from kvd_server.core.peer import PeerCred
from kvd_server.core.retention import TENANT_TOKEN_TTL_S
from kvd_server.core.sessions import Session
from kvd_server.errors import FailedPrecondition, PermissionDenied, Unauthenticated, Unavailable
from kvd_server.memory.pool import PoolError, may_hold
from kvd_server.memory.tenant_pools import TenantPools
from kvd_server.protocols.fastpath import FastPath
from kvd_server.rpc.admin_tokens import ADMIN_TOKEN_TTL_S, AdminTokens

if TYPE_CHECKING:
    # Imported where a tier is configured (kvd_server/server.py): not on every start.
    from kvd_server.tiers.link import TierLink

log = logging.getLogger(__name__)


class AttachRoles:
    """The attach server's handler (runs on the event loop)."""

    def __init__(self, core: KvdCore, fastpath: FastPath, below: TierLink | None,
                 pools: TenantPools, tokens: AdminTokens, channels: ChannelHub,
                 observe_transfer: Callable[[list[int], list[int]], None]) -> None:
        self.core = core
        self.fastpath = fastpath
        self.below = below              # the tier link (its held-below tables); None without
        self.pools = pools
        self.tokens = tokens
        self.channels = channels
        self.observe_transfer = observe_transfer

    def __call__(self, peer: PeerCred, request: AttachRequest) -> AttachReply:
        core = self.core
        if request.role == ROLE_ADMIN:
            return self._admin(peer)
        if request.role == ROLE_TENANT:
            return self._tenant(peer)
        if request.role == ROLE_INDEX:
            return self._index(self._session(peer, request))
        if request.role == ROLE_CHANNEL:
            return self._channel(self._session(peer, request))
        if request.role == ROLE_BELOW:
            return self._below(self._session(peer, request))
        if request.role == ROLE_REPORT and request.report is not None:
            # A data-plane worker has no session: its transfer totals come this way.
            core.sessions.check_peer(peer)
            r = request.report
            core.transfer_report(TransferStats(
                load_bytes=r.load_bytes, load_seconds=r.load_seconds,
                store_bytes=r.store_bytes, store_seconds=r.store_seconds))
            self.observe_transfer(r.load_sizes, r.store_sizes)
            return AttachReply(fields={"instance_id": core.instance_id})
        tenant = core.sessions.tenant_of(peer)
        core.sessions.check_peer(peer)
        backing = self.pools.backing
        if not may_hold(backing, peer.uid):
            setting = "restart.warm = true" if self.pools.warm is not None else \
                f'pool.backing = "{backing}"'
            raise FailedPrecondition(
                f"{setting} hands the pool only to the daemon's uid ({os.geteuid()}) and root, "
                f"not to uid {peer.uid}: a pool file cannot be sealed, so any engine holding "
                "it could truncate it under the others (SIGBUS); run the daemon as the engines' "
                'uid, or with pool.backing = "memfd" (the default) and no warm restart to serve '
                "other uids")
        try:
            pool = self.pools.for_tenant(tenant)   # only ever the peer's own tenant's file
        except (PoolError, OSError) as exc:
            raise Unavailable(f"cannot create the pool file of tenant {tenant}: {exc}") \
                from None
        session = core.attach(peer, request.role)
        if request.engine_id:
            log.debug("attach of %s (pid %d) as %s", request.engine_id, peer.pid, request.role)
        fields = {
            "token": session.token if session else "",
            "session_id": session.id if session else "",
            "pool_bytes": pool.size, "pool_id": pool.pool_id,
            "instance_id": core.instance_id, "slot_alignment": SLOT_ALIGNMENT,
            "daemon_version": __version__, "tenant": tenant,
        }
        return AttachReply(fields=fields, fd=pool.fd)

    def _admin(self, peer: PeerCred) -> AttachReply:
        if not self.core.sessions.is_admin(peer):
            raise PermissionDenied(f"uid {peer.uid} / gid {peer.gid} is not an admin (root, "
                                   "the daemon's uid, server.admin_uids / server.admin_gids)")
        log.info("admin token issued to pid %d uid %d", peer.pid, peer.uid)
        return AttachReply(fields={"admin_token": self.tokens.issue(),
                                   "expires_ms": int(ADMIN_TOKEN_TTL_S * 1000),
                                   "instance_id": self.core.instance_id,
                                   "daemon_version": __version__})

    def _tenant(self, peer: PeerCred) -> AttachReply:
        """A token for the agent-session calls, scoped to the peer's own tenant."""
        sessions = self.core.sessions
        sessions.check_peer(peer)
        tenant = sessions.tenant_of(peer)
        return AttachReply(fields={"tenant_token": self.core.retention.tokens.issue(tenant),
                                   "tenant": tenant,
                                   "expires_ms": int(TENANT_TOKEN_TTL_S * 1000),
                                   "instance_id": self.core.instance_id,
                                   "daemon_version": __version__})

    def _session(self, peer: PeerCred, request: AttachRequest) -> Session:
        """The registered session a token names, of this peer's uid."""
        session = self.core.sessions.get(request.token)
        if session is None or session.peer.uid != peer.uid:
            raise Unauthenticated("unknown or expired session token (or another uid's); "
                                  "attach again")
        return session

    def _index(self, session: Session) -> AttachReply:
        """A registered session maps its namespace's shared index and its own marks file."""
        index_fd, marks_fd = self.fastpath.attach_index(session)
        header = session.ns.index.header if session.ns and session.ns.index else None
        return AttachReply(fields={"session_id": session.id,
                                   "index_version": INDEX_VERSION,
                                   "index_bytes": header.file_bytes if header else 0},
                           fd=index_fd, more_fds=(marks_fd,))

    def _channel(self, session: Session) -> AttachReply:
        """A registered session's channel: the rings' memory file and the daemon's eventfd."""
        if session.ns is None:
            raise FailedPrecondition("session is not registered; call RegisterSession first")
        channel = self.channels.open(session, session.id)
        h = channel.header
        return AttachReply(fields={"session_id": session.id,
                                   "channel_version": channel_layout.VERSION,
                                   "channel_bytes": h.file_bytes, "up_bytes": h.up_bytes,
                                   "down_bytes": h.down_bytes},
                           fd=channel.fd, more_fds=(channel.wake_fd,))

    def _below(self, session: Session) -> AttachReply:
        """A registered session maps its namespace's "held below" table (read-only)."""
        if session.ns is None:
            raise FailedPrecondition("session is not registered; call RegisterSession first")
        table = self.below.table(session.ns.id) if self.below is not None else None
        if table is None:
            raise FailedPrecondition("this daemon has no tier below the pool")
        return AttachReply(fields={"session_id": session.id,
                                   "below_version": below_layout.VERSION,
                                   "below_bytes": table.file_bytes}, fd=table.fd)
