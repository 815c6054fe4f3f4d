"""What both sides of kvd share: the generated wire code and the facts around it.

- `kvd_pb2`, `kvd_pb2_grpc`: generated from proto/kvd/v1/kvd.proto (do not edit: `make proto`);
- `wire`: bounds, metadata keys and slot alignment that the proto states in comments;
- `paths`: where a daemon's sockets are and whether one answers there;
- `attach`: the attach side channel's wire format and its client exchange;
- `version`: kvd's version (`__version__`, read from pyproject.toml or the installed metadata).

kvd_server and kvd_client import from here and never from each other. The generated modules
are imported on first use (`from kvd_proto import kvd_pb2`), so the shelf alone stays free of
grpc and protobuf (the CLI's help and argument errors stay fast).
"""

from .version import __version__
from .wire import ADMIN_TOKEN_METADATA, SESSION_TOKEN_METADATA

__all__ = ["ADMIN_TOKEN_METADATA", "SESSION_TOKEN_METADATA", "__version__"]
