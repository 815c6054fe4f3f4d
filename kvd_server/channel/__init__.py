"""The daemon's end of every session's shared-memory channel: the hub that reads the rings on the event loop, and the records applied to the core."""
