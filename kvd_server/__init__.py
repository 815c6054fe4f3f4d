"""kvd daemon: the node's shared host-memory KV pool, offload manager, gRPC API and CLI.

This package never imports torch, CUDA or engine code.
"""

from kvd_proto.version import __version__  # one for the whole distribution

__all__ = ["__version__"]
