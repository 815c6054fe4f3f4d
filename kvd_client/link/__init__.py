"""The session's link to the daemon: the channel's rings, the shared index's read-only mapping, the records an engine sends, and the connection that sets them up."""
