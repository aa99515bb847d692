"""``/metrics``: Prometheus text from prometheus_client, one registry per app.

Request, token and latency metrics are updated by the server; the cache's
figures are read from ``GgmoeLlama.stats()`` at scrape time by a custom
collector, so they are never out of date and cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ggmoe.engine.parallel import BatchStats
    from ggmoe.serve.lanes import LaneState

# seconds; first tokens include the queue wait and the prefill, per-token times one decode
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class CacheCollector(Collector):
    """Per-layer cache figures from a ``stats()`` callable (``{"cache": None}`` without a cache)."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        cache = self._stats().get("cache")
        if not cache:
            return
        families = _layer_families()
        for il, s in cache["layers"].items():
            _add_layer(families, il, s, cache)
        yield from families.values()
        yield from _mode_families(cache)
        yield from _host_tier_families(cache.get("host_tier"))
        yield from _reader_families(cache.get("prefetch"))


def _reader_families(prefetch: dict[str, Any] | None) -> Iterator[Any]:
    """The stride prefetcher's budget, and on the async decode its mailbox reader's layers: those read that
    predict a later layer, and those read only after that layer had started (they prefetched nothing)."""
    if not prefetch:
        return
    budget = GaugeMetricFamily("ggmoe_prefetch_budget", "Experts per layer the stride prefetcher may prefetch "
                               "now (0: it turned itself off, its prefetches having cost more than they saved)")
    budget.add_metric([], prefetch["experts_per_layer"])
    yield budget
    if prefetch.get("runs_on") != "mailbox":
        return
    reader = CounterMetricFamily("ggmoe_prefetch_reader_layers", "Layers the mailbox's reader read that predict "
                                 "a later layer (read), and those it read only after that layer had started "
                                 "(behind: the decode ran ahead of it)", labels=["state"])
    reader.add_metric(["read"], prefetch["layers_targeted"])
    reader.add_metric(["behind"], prefetch["layers_behind"])
    yield reader


def _host_tier_families(tier: dict[str, Any] | None) -> Iterator[Any]:
    """The host tier's counters per MoE layer, under a disk tier (nothing otherwise)."""
    if not tier:
        return
    for key, name, doc in (
            ("hits", "hits", "Experts found in the host tier (or their read in flight) by a copy to the GPU tier"),
            ("reads", "disk_reads", "Experts read from the model file into the host tier"),
            ("predicted_reads", "disk_reads_predicted", "Disk reads started by a prediction (a prefetch)"),
            ("predicted_used", "disk_reads_predicted_used", "Predicted disk reads later asked for"),
            ("in_place", "in_place", "Experts read from the model file in place (no host slot)"),
            ("bytes_read", "disk_read_bytes", "Bytes of experts read from the model file into the host tier")):
        fam = CounterMetricFamily(f"ggmoe_host_tier_{name}", f"{doc}, per MoE layer", labels=["il"])
        for il, s in tier["layers"].items():
            fam.add_metric([il], s[key])
        yield fam


def _layer_families() -> dict[str, Any]:
    """The per-layer families, empty, by short name, in the order a scrape lists them."""
    f: dict[str, Any] = {}
    f["hits"] = CounterMetricFamily("ggmoe_cache_hits", "Distinct experts found resident, per MoE layer",
                                    labels=["il"])
    f["misses"] = CounterMetricFamily("ggmoe_cache_misses", "Distinct experts copied in, per MoE layer",
                                      labels=["il"])
    f["copied"] = CounterMetricFamily("ggmoe_cache_copied_bytes", "Bytes of expert weights copied into slots",
                                      labels=["il"])
    f["rate"] = GaugeMetricFamily("ggmoe_cache_hit_rate", "Hits / (hits + misses) since load, per MoE layer",
                                  labels=["il"])
    f["host"] = CounterMetricFamily("ggmoe_cache_host_computed", "Distinct experts computed on the CPU (host "
                                    "path), per MoE layer", labels=["il"])
    f["issued"] = CounterMetricFamily("ggmoe_prefetch_issued", "Experts prefetched on a prediction, per MoE "
                                      "layer", labels=["il"])
    f["precision"] = GaugeMetricFamily("ggmoe_prefetch_precision", "Prefetched experts later used / prefetched, "
                                       "per MoE layer (0 before any prefetch)", labels=["il"])
    # every prefetched expert ends used (its layer read it from its slot), wasted (evicted unused) or late
    # (its layer started before the copy landed and read it from host memory)
    f["fate"] = CounterMetricFamily("ggmoe_prefetch_experts", "Prefetched experts by outcome (used, wasted, "
                                    "late), per MoE layer", labels=["il", "outcome"])
    f["wasted_bytes"] = CounterMetricFamily("ggmoe_prefetch_wasted_bytes", "Bytes of prefetched experts evicted "
                                            "unused, per MoE layer", labels=["il"])
    f["reads"] = CounterMetricFamily("ggmoe_cache_host_read_bytes", "Bytes of missed experts the device read "
                                     "from host memory (async decode), per MoE layer", labels=["il"])
    f["lag"] = GaugeMetricFamily("ggmoe_cache_admission_lag_tokens", "Mean tokens from an admission's copy to "
                                 "its slot being readable (async decode's epoch lag), per MoE layer",
                                 labels=["il"])
    f["top"] = CounterMetricFamily("ggmoe_cache_top_hits", "Split layers (MoEpic): distinct experts found with "
                                   "only their top segment resident (the bottom read from host memory), per MoE "
                                   "layer", labels=["il"])
    f["bottom_read"] = CounterMetricFamily("ggmoe_cache_bottom_read_bytes", "Split layers: bytes of bottom "
                                           "segments read from host memory, per MoE layer", labels=["il"])
    f["bottom_pre"] = CounterMetricFamily("ggmoe_cache_bottom_prefetch_bytes", "Split layers: bytes of bottom "
                                          "segments prefetched into bottom buffers, per MoE layer", labels=["il"])
    f["occ"] = GaugeMetricFamily("ggmoe_cache_occupancy", "Experts resident in the layer's slots", labels=["il"])
    f["slots"] = GaugeMetricFamily("ggmoe_cache_slots", "Cache slots of the layer", labels=["il"])
    return f


def _add_layer(f: dict[str, Any], il: str, s: dict[str, Any], cache: dict[str, Any]) -> None:
    """One layer's figures (``s``: its entry of the cache's ``layers``) into the families."""
    for name, key in (("hits", "hits"), ("misses", "misses"), ("copied", "bytes_copied"), ("rate", "hit_rate"),
                      ("host", "host_computed"), ("issued", "prefetch_issued"),
                      ("wasted_bytes", "prefetch_wasted_bytes"), ("reads", "host_read_bytes"),
                      ("lag", "mean_lag_tokens"), ("top", "top_hits"), ("bottom_read", "bottom_read_bytes"),
                      ("bottom_pre", "bottom_prefetch_bytes")):
        f[name].add_metric([il], s[key])
    f["precision"].add_metric([il], s["prefetch_hits"] / s["prefetch_issued"] if s["prefetch_issued"] else 0.0)
    for outcome, key in (("used", "prefetch_hits"), ("wasted", "prefetch_wasted"), ("late", "prefetch_late")):
        f["fate"].add_metric([il, outcome], s[key])
    f["occ"].add_metric([il], cache["occupancy"].get(il, 0))
    f["slots"].add_metric([il], cache["slots_per_layer"].get(il, 0))


def _mode_families(cache: dict[str, Any]) -> tuple[Any, Any]:
    """The decode mode and the copy stream in effect, each a gauge of 1 labelled with its name."""
    mode = GaugeMetricFamily("ggmoe_decode_mode", "1 for the decode mode in effect (async: expert table, no "
                             "sync per MoE layer; sync: the route op per layer), with the reason",
                             labels=["mode", "asked", "reason"])
    if cache.get("decode_mode_in_effect"):
        mode.add_metric([cache["decode_mode_in_effect"], cache["decode_mode"], cache["decode_mode_reason"]], 1)
    stream = GaugeMetricFamily("ggmoe_copy_stream", "1 for the expert cache's copy stream in effect (events: "
                               "a GPU's, readiness by event query; immediate or deferred: the CPU build's)",
                               labels=["stream"])
    if cache.get("copy_stream"):
        stream.add_metric([cache["copy_stream"]], 1)
    return mode, stream


class LaneCollector(Collector):
    """Each lane's state and counts (``ggmoe.serve.lanes.LaneState``; the metric names keep llama-server's
    word, slot), and with several lanes what their batcher decoded (``ggmoe.engine.parallel.BatchStats``), read at scrape time."""

    def __init__(self, lanes: Sequence[LaneState], batch: BatchStats | None) -> None:
        self._lanes = lanes
        self._batch = batch

    def collect(self) -> Iterator[Any]:
        busy = GaugeMetricFamily("ggmoe_slot_processing", "1 while the slot runs a request", labels=["slot"])
        n_ctx = GaugeMetricFamily("ggmoe_slot_n_ctx", "Tokens the slot may hold (its share of the context)",
                                  labels=["slot"])
        reqs = CounterMetricFamily("ggmoe_slot_requests", "Requests the slot has run", labels=["slot"])
        toks = CounterMetricFamily("ggmoe_slot_generated_tokens", "Tokens the slot has generated (the running "
                                   "request's included)", labels=["slot"])
        for st in self._lanes:
            label = [str(st.id)]
            busy.add_metric(label, 1 if st.processing else 0)
            n_ctx.add_metric(label, st.n_ctx)
            reqs.add_metric(label, st.n_requests)
            toks.add_metric(label, st.generated())
        yield from (busy, n_ctx, reqs, toks)
        b = self._batch
        if b is None:
            return
        decodes = CounterMetricFamily("ggmoe_batch_decodes", "llama_decode calls of the slots' batcher")
        decodes.add_metric([], b.decodes)
        tokens = CounterMetricFamily("ggmoe_batch_tokens", "Tokens in the batcher's decodes (prompts included)")
        tokens.add_metric([], b.tokens)
        steps = CounterMetricFamily("ggmoe_batch_steps", "Generation steps (one token from each slot in one "
                                    "llama_decode), by the number of slots in the step", labels=["sequences"])
        for width, n in sorted(b.by_width.items()):
            steps.add_metric([str(width)], n)
        yield from (decodes, tokens, steps)


class Metrics:
    """The server's metrics on their own registry."""

    def __init__(self, stats: Callable[[], dict[str, Any]], queue_length: Callable[[], int],
                 running: Callable[[], int], lanes: Sequence[LaneState] = (), batch: BatchStats | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ggmoe_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.prompt_tokens = Counter("ggmoe_prompt_tokens", "Prompt tokens of completed generations",
                                     registry=r)
        self.completion_tokens = Counter("ggmoe_completion_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("ggmoe_time_to_first_token_seconds",
                              "Request arrival to its first generated token (queue wait and prefill included)",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("ggmoe_time_per_output_token_seconds",
                              "Mean seconds per generated token after the first, per request",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.cancelled = Counter("ggmoe_generations_cancelled", "Generations stopped by a client disconnect",
                                 registry=r)
        self.reconfigured = Counter("ggmoe_cache_reconfigurations", "Expert caches replaced between requests by "
                                    "MoEpic's configurator (--reconfigure-every)", registry=r)
        Gauge("ggmoe_queue_length", "Requests waiting for the model", registry=r).set_function(queue_length)
        Gauge("ggmoe_generations_running", "Slots busy now (0 to --parallel)", registry=r).set_function(running)
        r.register(CacheCollector(stats))
        r.register(LaneCollector(lanes, batch))
