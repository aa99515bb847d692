"""The expert cache: slot tables, policies, statistics; shared by the engine and the simulator."""

from ggmoe.cache.cache import (
    CacheConfig,
    CacheStats,
    ExpertCache,
    LayerStats,
    Loader,
    NullLoader,
    SlotTable,
    slots_for_budget,
)

__all__ = ["CacheConfig", "CacheStats", "ExpertCache", "LayerStats", "Loader", "NullLoader", "SlotTable",
           "slots_for_budget"]
