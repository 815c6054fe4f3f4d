"""kvd client: the engine-side library (session, data plane, vLLM plug-in).

Never imports kvd_server: the two packages meet only at the wire (kvd_proto) and the attach
protocol.
"""

__version__ = "0.1.0"
