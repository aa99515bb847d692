"""The expert cache: slot tables, policies, copies, statistics; shared by the engine and the simulator."""

from ggmoe.cache.cache import ExpertCache
from ggmoe.cache.clock import Clock, ManualClock, MonotonicClock
from ggmoe.cache.config import CacheConfig, slots_for_budget
from ggmoe.cache.copy import CopyBackend, CopyHandle, NullCopyBackend, Priority, ThreadedCopyBackend
from ggmoe.cache.slots import SlotState, SlotTable
from ggmoe.cache.stats import CacheStats, LayerStats

__all__ = ["CacheConfig", "CacheStats", "Clock", "CopyBackend", "CopyHandle", "ExpertCache", "LayerStats",
           "ManualClock", "MonotonicClock", "NullCopyBackend", "Priority", "SlotState", "SlotTable",
           "ThreadedCopyBackend", "slots_for_budget"]
