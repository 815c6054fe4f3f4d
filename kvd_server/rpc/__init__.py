"""The daemon's gRPC ways in: the engine and admin services (validation, the call recorder), the front door's listeners and the admin tokens."""
