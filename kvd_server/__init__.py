"""kvd daemon: the node's shared host-memory KV pool, offload manager, gRPC API and CLI.

This package never imports torch, CUDA or engine code.
"""

__version__ = "0.1.0"
