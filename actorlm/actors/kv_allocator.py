"""KVAllocatorActor: the only owner of KV block bookkeeping. One request/reply per step."""

from __future__ import annotations

import pykka

from actorlm.actors.base import EngineActor, tell
from actorlm.core.block_pool import BlockPool
from actorlm.messages import AllocateSlots, GetStats, KVStats


class KVAllocatorActor(EngineActor):
    def __init__(self, num_blocks: int, scheduler: pykka.ActorRef, on_death=None):
        super().__init__(on_death)
        self.pool = BlockPool(num_blocks)
        self.scheduler = scheduler  # its only client: every grant goes back there

    def on_receive(self, message):
        if isinstance(message, AllocateSlots):
            tell(self.scheduler, self.pool.grant(message))
        elif isinstance(message, GetStats):
            return KVStats(self.pool.num_free_blocks, self.pool.num_total_blocks,
                           self.pool.num_requests_holding_blocks)
        else:
            raise TypeError(f"KVAllocatorActor cannot handle {type(message).__name__}")
