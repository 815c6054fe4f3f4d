"""The daemon's core: sessions and their liveness, namespaces and their slots, leases, the peer credentials a session is born with."""
