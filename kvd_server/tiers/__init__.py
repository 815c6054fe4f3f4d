"""Tiers below the pool: where evicted blocks go, and where a lookup's miss may still be found.

The pool is the first tier. A tier below it (`Tier`, kvd_server/tiers/base.py) takes blocks the
pool evicts (demotion: write-behind, bounded, never blocking the pool) and gives them back into
a pool slot on request (promotion), verifying each block's checksum so that nothing torn or
corrupt is ever served. Blocks are named by a `TierKey` (namespace id + block key): the
namespace id digests tenant, model and layout, so two tenants never share a block in any tier.

- base.py: the interface every tier implements (the local disk, the cluster tier, the two
  stacked), with defaults for its optional capabilities, its key, its counters and its health.
- disk/: the local disk tier: preallocated files, direct I/O with aligned extents, a pool of
  I/O threads, a checksum per block, LRU eviction, quotas per tenant (disk/space.py), and its
  own index persisted as a journal (disk/journal.py) so it survives a restart and a reboot.
"""

from kvd_server.tiers.base import Tier, TierHealth, TierKey, TierStats

__all__ = ["Tier", "TierHealth", "TierKey", "TierStats"]
