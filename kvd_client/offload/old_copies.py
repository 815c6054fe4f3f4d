"""Copies an engine still runs for sessions that ended while its process lived on.

After a reconnect the daemon keeps what the old session held (its pins and store slots) in
quarantine: the engine's workers may still be copying with that session's offsets. The
engine counts those copies as they finish; when the last one does, it tells the daemon
(ReleaseHeld) to give everything back."""

from __future__ import annotations

from kvd_proto import records as rec


class OldCopies:
    def __init__(self) -> None:
        self._sessions: list[str] = []        # ended sessions whose copies still run
        self._copies = 0
        self._unsent: list[str] = []          # sessions to release once connected again

    def ended(self, session_id: str | None, copies: int) -> None:
        """A session ended (a reconnect) with `copies` in flight: its release waits for
        them, and for the new session to tell it (`release_records`)."""
        self._unsent.extend(self.add(session_id, copies))

    def release_records(self) -> list[bytes]:
        """The releases that waited for a connection, to send now."""
        unsent, self._unsent = self._unsent, []
        return [rec.encode_release_held(session_id) for session_id in unsent]

    def finished_records(self, n: int) -> list[bytes]:
        """`n` copies finished: the releases to send now (when the last one did)."""
        if not n:
            return []
        return [rec.encode_release_held(session_id) for session_id in self.finished(n)]

    def add(self, session_id: str | None, copies: int) -> list[str]:
        """A session ended with `copies` loads and stores in flight; the sessions to release
        now (this one, when none of its copies runs and none of an earlier one does: the
        daemon may hold what it had, after a reconnect or a daemon's warm restart)."""
        if not session_id:
            return []
        self._sessions.append(session_id)
        self._copies += copies
        return self.finished(0)

    def finished(self, n: int = 1) -> list[str]:
        """`n` of those copies finished: the sessions to release once all have."""
        if not self._sessions or n < 0:
            return []
        self._copies = max(0, self._copies - n)
        if self._copies:
            return []
        released, self._sessions = self._sessions, []
        return released
