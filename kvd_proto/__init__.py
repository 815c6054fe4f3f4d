"""Generated protobuf and gRPC code for the kvd.v1 wire contract (proto/kvd/v1/kvd.proto).

Do not edit the *_pb2* files: run `make proto`. Both kvd_server and kvd_client import from here.
"""

from . import kvd_pb2, kvd_pb2_grpc

# Metadata key carrying the session token on every KvdEngine call.
SESSION_TOKEN_METADATA = "kvd-session-token"

__all__ = ["kvd_pb2", "kvd_pb2_grpc", "SESSION_TOKEN_METADATA"]
