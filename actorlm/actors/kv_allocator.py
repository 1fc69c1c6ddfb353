"""KVAllocatorActor: the only owner of the KV blocks and the prefix cache. One request/reply
per step (``AllocateSlots`` → ``SlotsGranted``); see ``core/block_pool.py`` for the decision."""

from __future__ import annotations

import pykka

from actorlm.core.block_pool import BlockPool
from actorlm.engine_actor import EngineActor, tell
from actorlm.messages import AllocateSlots, GetStats, KVStats, ResetPrefixCache


class KVAllocatorActor(EngineActor):
    def __init__(self, pool: BlockPool, scheduler: pykka.ActorRef, on_death=None):
        super().__init__(on_death)
        self.pool = pool
        self.scheduler = scheduler  # its only client on the step path: grants go back there

    def on_receive(self, message):
        if isinstance(message, AllocateSlots):
            tell(self.scheduler, self.pool.grant(message))
        elif isinstance(message, GetStats):
            p = self.pool
            return KVStats(p.num_free_blocks, p.num_total_blocks, p.num_requests_holding_blocks,
                           p.num_cached_blocks, p.prefix_cache_queries, p.prefix_cache_hits,
                           p.num_used_blocks)
        elif isinstance(message, ResetPrefixCache):
            self.pool.reset_prefix_cache()
            return True
        else:
            raise TypeError(f"KVAllocatorActor cannot handle {type(message).__name__}")
