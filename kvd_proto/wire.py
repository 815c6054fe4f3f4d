"""Facts of the wire contract that a .proto file cannot state: bounds, metadata keys, alignment.

proto/kvd/v1/kvd.proto states these in its comments; this module is their one definition in
code. The daemon enforces them, the client stays within them, and a test checks that the
proto's comments say the same numbers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BlockState(enum.IntEnum):
    """What a lookup answers for a block: the wire's `kvd.v1.BlockState` (its numbers; a test
    holds them equal), and the one enum behind both sides' `Lookup` (the daemon's is this one,
    the client's has the same members by name)."""

    MISS = 1
    HIT = 2
    HIT_PENDING = 3     # being stored or promoted: not readable yet (vLLM's name)

# --- gRPC metadata keys ---------------------------------------------------------------------
SESSION_TOKEN_METADATA = "kvd-session-token"   # every KvdEngine call: the attach token
ADMIN_TOKEN_METADATA = "kvd-admin-token"       # KvdAdmin.Reset / Drain (and every remote call)
TENANT_TOKEN_METADATA = "kvd-tenant-token"     # KvdAdmin's agent-session calls, one tenant's

# --- request bounds (a request beyond them fails with INVALID_ARGUMENT) ---------------------
MAX_KEYS_PER_CALL = 4096        # every repeated `keys` field
MAX_KEY_BYTES = 128             # a key is 1..128 bytes
MAX_OPS_PER_STEP = 256          # operations in one StepRequest
MAX_KEYS_PER_STEP = 16384       # keys over all operations of one StepRequest
MAX_STRING_BYTES = 256          # ids, names, request ids
DEFAULT_EVENTS = 1024           # TakeEvents with max_events = 0
MAX_EVENTS = 65536              # TakeEvents.max_events
MAX_TRANSFER_SAMPLES = 4096     # TransferReport.load_sizes / store_sizes
MAX_BLOCK_BYTES = 1 << 30       # KvLayout.block_bytes
MAX_RANKS = 1024                # KvLayout.num_ranks
DEFAULT_SESSIONS_LIMIT = 1000   # ListSessions with limit = 0
MAX_SESSIONS_LIMIT = 10000      # ListSessions.limit
MAX_MESSAGE_BYTES = 4 << 20     # one gRPC message, each way
MAX_EVENT_ANSWER_BYTES = 1 << 20  # keys in one TakeEvents answer (at least one event)
# What the daemon's transport reads before it refuses a message itself (RESOURCE_EXHAUSTED,
# ending a stream): up to it, a message over MAX_MESSAGE_BYTES is answered INVALID_ARGUMENT.
TRANSPORT_MESSAGE_BYTES = 4 * MAX_MESSAGE_BYTES

# --- the pool -------------------------------------------------------------------------------
SLOT_ALIGNMENT = 4096           # slot offsets (and strides) are multiples of this
DEFAULT_INDEX_KEY_BYTES = 64    # KvLayout.max_key_bytes = 0
MAX_GRANTED_SLOTS = 4096        # slots one session may hold granted for future stores


def align_up(n: int, alignment: int = SLOT_ALIGNMENT) -> int:
    """`n` rounded up to a multiple of `alignment`."""
    return (n + alignment - 1) // alignment * alignment


def channel_options() -> list[tuple[str, int]]:
    """gRPC options both ends use: the stated message limit each way."""
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


@dataclass(frozen=True, slots=True)
class KvLayout:
    """The wire's KvLayout: one slot holds `num_ranks` shards of `shard_bytes` (rank r owns
    bytes [r * shard_bytes, (r + 1) * shard_bytes)), so block_bytes == num_ranks x shard."""

    block_bytes: int
    num_ranks: int
    shard_bytes: int
    tokens_per_block: int = 0
    dtype: str = ""
    max_key_bytes: int = 0      # 0: DEFAULT_INDEX_KEY_BYTES

    @property
    def index_key_width(self) -> int:
        """Bytes per key in the namespace's shared index."""
        return align_up(self.max_key_bytes or DEFAULT_INDEX_KEY_BYTES, 8)

    def __post_init__(self) -> None:
        if not 0 <= self.max_key_bytes <= MAX_KEY_BYTES:
            raise ValueError(f"max_key_bytes {self.max_key_bytes} is outside 0..{MAX_KEY_BYTES}")
        if not 1 <= self.num_ranks <= MAX_RANKS or self.shard_bytes < 1:
            raise ValueError(f"num_ranks must be 1..{MAX_RANKS} and shard_bytes positive")
        if self.block_bytes != self.num_ranks * self.shard_bytes:
            raise ValueError(f"block_bytes ({self.block_bytes}) must equal num_ranks "
                             f"({self.num_ranks}) x shard_bytes ({self.shard_bytes})")
        if self.block_bytes > MAX_BLOCK_BYTES:
            raise ValueError(f"block_bytes {self.block_bytes} is more than {MAX_BLOCK_BYTES}")
