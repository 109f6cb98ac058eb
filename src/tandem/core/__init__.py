"""Scheduling and KV-block bookkeeping: plain Python over ints, no torch."""

from tandem.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.scheduler import (
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

__all__ = [
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]
