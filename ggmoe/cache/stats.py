"""Cache statistics per MoE layer: counts and bytes, and seconds measured through the injected clock."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class LayerStats:
    calls: int = 0  # routed layer calls (micro-batches)
    native_calls: int = 0  # calls that ran the native path (more distinct experts than slots)
    hits: int = 0  # distinct experts per call found resident (a split layer's: top and bottom on the device)
    misses: int = 0  # distinct experts per call loaded
    bytes_copied: int = 0  # bytes
    demand_copies: int = 0  # experts copied while their layer waited
    admission_copies: int = 0  # experts computed on the CPU and copied in at low priority for later tokens
    host_computed: int = 0  # distinct experts per call computed by the CPU (the host path)
    deferred_waits: int = 0  # calls that waited for their copies in the wait hook, with the CPU part running
    prefetch_issued: int = 0  # experts copied in ahead of their layer on a prediction
    prefetch_hits: int = 0  # prefetched experts that their layer then used (a prefetch hit)
    prefetch_wasted: int = 0  # prefetched experts evicted before any use
    prefetch_wasted_bytes: int = 0  # bytes
    prefetch_dropped: int = 0  # queued prefetches cancelled at the gate (stale: not among the real experts)
    admissions_dropped: int = 0  # async decode: an earlier token's admissions still queued, cancelled
    prefetch_late: int = 0  # predictions that came after their layer had started (not prefetched)
    pred_correct: int = 0  # predicted experts (top n_expert_used) that the layer really selected
    pred_total: int = 0  # experts predicted
    # the planner between tokens (ggmoe.control.planner): its plan's top n_expert_used for the layer's next call,
    # and those the call really selected
    plan_total: int = 0
    plan_correct: int = 0
    host_reads: int = 0  # async decode: distinct experts per call the device read from host memory (misses)
    host_read_bytes: int = 0  # bytes those reads moved over the link
    fills: int = 0  # async decode: misses the graph copied into a fill slot and read there (patch 0012)
    preloaded: int = 0  # experts copied in when the cache was built (a slot for every expert, either decode mode)
    evictions: int = 0  # experts evicted to make room (every mode)
    landed: int = 0  # copies seen landed between tokens (async decode)
    lag_tokens: int = 0  # async decode: tokens from each landed copy's submission to its slot being readable
    # split layers (MoEpic): top-only hits (the bottom read from host memory), full hits thanks to a prefetched
    # bottom (also in hits), bytes of bottoms read over the link and prefetched into bottom buffers
    top_hits: int = 0
    bottom_hits: int = 0
    bottom_read_bytes: int = 0  # bytes
    bottom_prefetches: int = 0
    bottom_prefetch_bytes: int = 0  # bytes
    wait_s: float = 0.0  # seconds spent waiting for this layer's copies (clock time)
    hook_s: float = 0.0  # seconds inside route() for this layer (clock time)

    @property
    def hit_rate(self) -> float:
        """Share of accesses found whole on the device (a split layer's top-only hits are not)."""
        n = self.hits + self.top_hits + self.misses
        return self.hits / n if n else 0.0

    @property
    def top_hit_rate(self) -> float:
        """Share of accesses that found at least the top segment on the device (whole experts: the hit rate)."""
        n = self.hits + self.top_hits + self.misses
        return (self.hits + self.top_hits) / n if n else 0.0

    @property
    def mean_lag_tokens(self) -> float:
        """Async decode's epoch lag: tokens from an admission's submission until a graph could read it."""
        return self.lag_tokens / self.landed if self.landed else 0.0

    @property
    def pred_accuracy(self) -> float:
        return self.pred_correct / self.pred_total if self.pred_total else 0.0

    @property
    def plan_accuracy(self) -> float:
        """Share of the planner's expected experts (top n_expert_used) that the layer's next call selected."""
        return self.plan_correct / self.plan_total if self.plan_total else 0.0

    def add(self, other: LayerStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["hit_rate"] = self.hit_rate
        d["top_hit_rate"] = self.top_hit_rate
        d["pred_accuracy"] = self.pred_accuracy
        d["plan_accuracy"] = self.plan_accuracy
        d["mean_lag_tokens"] = self.mean_lag_tokens
        return d


@dataclass
class CacheStats:
    layers: dict[int, LayerStats] = field(default_factory=dict)

    def total(self) -> LayerStats:
        t = LayerStats()
        for s in self.layers.values():
            t.add(s)
        return t

    def to_dict(self) -> dict:
        return {"total": self.total().to_dict(),
                "layers": {str(il): s.to_dict() for il, s in sorted(self.layers.items())}}
