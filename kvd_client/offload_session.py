"""The import path docs/client.md named before the session moved to kvd_client/offload/:
kept so that engines written against it keep working."""

from kvd_client.offload.session import Lookup, OffloadSession

__all__ = ["Lookup", "OffloadSession"]
