"""kvd client: the engine-side library (session, data plane, vLLM plug-in).

Never imports kvd_server: the two packages meet only at the wire (kvd_proto) and the attach
protocol.
"""

from kvd_proto.version import __version__  # one for the whole distribution

__all__ = ["__version__"]
