"""The channel's record kinds, the Python side of kvd_proto/_records.h (where the C code has
them): one number per kind and direction, and their names. tests/unit/test_record_kinds_one_source.py
holds the two equal and fails where another module defines a kind again. A leaf, imported by
kvd_proto/records.py (the encoders and decoders) and by whatever names a kind.
"""

from __future__ import annotations

# --- up: engine -> daemon ---------------------------------------------------------------------
STORE = 1             # StoreGranted: offered keys, which granted slots hold which new keys
COMPLETE_STORE = 2
PIN = 3               # loads the engine started from its own lookups
COMPLETE_LOAD = 4
TOUCH = 5
REQUEST_FINISHED = 6
RESERVE = 7           # the slots this session wants held for its stores (flag 1: evict now)
RESET = 8             # reset the namespace (answered by RESET_DONE with the same token)
TAKE_EVENTS = 9
COUNTERS = 10         # lookups, hits and misses answered locally since the last COUNTERS
RELEASE_HELD = 11     # an earlier session of this process has no copies in flight any more
RETURN_SLOTS = 12     # granted slots the engine will not use (never written)
PROMOTE = 13          # keys the engine answered HIT_PENDING from the "held below" table
RESTORE = 14          # granted slots taken back as the evicted blocks they still hold
HINT = 15             # a request's retention hint: its agent session and how long to retain
FIND = 16             # keys to ask the cluster store about (missed by the index and the
                      # "held below" table); answered by FOUND
UP_KINDS = {STORE: "store", COMPLETE_STORE: "complete_store", PIN: "pin",
            COMPLETE_LOAD: "complete_load", TOUCH: "touch",
            REQUEST_FINISHED: "request_finished", RESERVE: "reserve", RESET: "reset",
            TAKE_EVENTS: "take_events", COUNTERS: "counters", RELEASE_HELD: "release_held",
            RETURN_SLOTS: "return_slots", PROMOTE: "promote", RESTORE: "restore",
            HINT: "hint", FIND: "find"}

# --- down: daemon -> engine -------------------------------------------------------------------
GRANTED = 1           # slots granted to the reserve, whenever the daemon has them free
RESET_DONE = 2        # answers RESET: token, the namespace's new epoch, blocks dropped
EVENTS = 3            # answers TAKE_EVENTS: stored / removed events, and whether more wait
REJECTED = 4          # an up record the daemon refused: its kind, a status name, a message
FOUND = 5             # answers FIND: the store was asked; what it holds is "held below" now
DOWN_KINDS = {GRANTED: "granted", RESET_DONE: "reset_done", EVENTS: "events",
              REJECTED: "rejected", FOUND: "found"}
