"""Which decode mode runs: ``sync`` (the route op answers every MoE layer from Python) or ``async``.

``async`` keeps the decode graph whole: the device reads each selected expert through the expert table
(its cache slot, or its host copy over the link; with the host path, the experts the CPU computes in the
graph's host part), the routing leaves the device once per token, and the cache is managed between tokens
(``ggmoe.control.TokenController``). ``sync`` stays for what needs the CPU's answer inside a layer:
predictors that read router probabilities, observers that read router probabilities or hidden states
(tracing), benchmarks' routing overrides, and backends without ``mul_mat_id_table``; ``auto`` also keeps the
host path there. ``auto`` takes ``async`` unless one of those holds, and says why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ggmoe.base.errors import UsageError
from ggmoe.base.registry import check_choice
from ggmoe.cache.miss import miss_share

DECODE_MODES = ("auto", "async", "sync")


@dataclass(frozen=True)
class DecodeConfig:
    """How a token is decoded around the cache: the decode mode, what a miss does, the cost model that ``auto``
    weighs them with."""

    # sync (the route op per MoE layer), async (the expert table, no sync on the decode path) or auto
    mode: str = "auto"
    # the async decode's in-graph fills (patch 0012): the graph copies a layer's misses into free slots and reads
    # them there, so a miss crosses the link once; False: misses are read in place, then admitted (twice)
    fills: bool = True
    # a warmed cache with a slot for every expert read with stock's matmuls on its slots, no table (patch 0017);
    # False: through the tables, as a smaller cache is (benchmarks: the two side by side)
    identity: bool = True
    # an expert not on the device: wait for its copy, compute it on the CPU, or whichever the measured cost model
    # says is sooner (ggmoe.cache.miss)
    miss_policy: str = "wait"
    # the host path's CPU part on a worker of this many threads beside the device part (0: in the main graph,
    # after it); None: the build's default (ggmoe.engine.host_part; GGMOE_HOST_THREADS overrides it)
    host_threads: int | None = None
    # the cost model of auto: a hardware profile name or TOML file; None: measured at startup
    hw_profile: str | None = None
    # saved routing statistics (il -> [n_expert] tokens that chose each expert; --stats-in): auto's weighing of
    # the decode modes takes each layer's misses from them instead of uniform routing
    routing_counts: Mapping[int, Sequence[int]] | None = None

    def __post_init__(self) -> None:
        """A thread count that is not a whole number >= 0 refused before anything is built."""
        if self.host_threads is not None and (isinstance(self.host_threads, bool)
                                              or not isinstance(self.host_threads, int) or self.host_threads < 0):
            raise UsageError(f"host_threads {self.host_threads!r}: a whole number of threads >= 0 "
                             "(0: the host part in the main graph)")


# The largest micro-batch (tokens) that reads its experts through the tables. ggml-cuda runs
# mul_mat_id_table on MMVQ, whose MoE micro-batch limit is 4 to 8 tokens by type and GPU
# (get_mmvq_mmid_max_batch): 4 fits every type; decode is 1 token. Larger micro-batches take the route op.
TABLE_MAX_TOKENS = 4


# Expert types ggml-cuda reads through an expert table: those MMVQ has a kernel for (patch 0008's
# ggml_cuda_mmvq_has_type, mirroring mul_mat_vec_q_switch_type). ggml-cpu reads every type through a table.
CUDA_TABLE_TYPES = frozenset({
    "Q1_0", "Q2_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "NVFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
    "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS",
})


def table_type_note(backend: str, tensors: list[tuple[str, str]]) -> str | None:
    """Why ``backend`` (a ggml device name: CPU, CUDA0, Vulkan0...) cannot read these expert weights through
    an expert table, naming the first tensor it cannot read and its type; None when it can. ``tensors``:
    (GGUF name, ggml type name) of every expert weight the cache holds."""
    name = backend.upper()
    if name.startswith("CPU"):
        return None
    if not name.startswith("CUDA"):
        return f"the {backend or 'GPU'} backend has no expert-table matmul (ggml-cpu and ggml-cuda do)"
    for tensor, gtype in tensors:
        if gtype.upper() not in CUDA_TABLE_TYPES:
            return (f"ggml-cuda reads expert tables with MMVQ, which has no kernel for {tensor} of type {gtype} "
                    "(quantize the experts to a type such as Q4_K, Q8_0 or MXFP4)")
    return None


def check_decode_mode(name: str) -> str:
    return check_choice(name, DECODE_MODES, "decode mode")


@dataclass(frozen=True)
class DecodeMode:
    """The mode that runs and why (one line for the user, the stats and /metrics)."""

    asked: str  # auto | async | sync
    mode: str  # async | sync
    reason: str  # why this mode


def sync_reasons(miss_policy: str, prefetch_note: str | None, backend_note: str | None,
                 auto: bool = False) -> list[str]:
    """What needs the sync mode, from the configuration (miss policy as it runs, after ``auto``);
    ``prefetch_note``: why the predictor cannot run on the async decode's mailbox (None: it can). ``auto``: the
    decode mode is ``auto`` and the async decode's host part would take some layer, so auto keeps the host path
    in the sync decode: there each layer call's misses are split by the copies in flight, where the async
    decode's host part takes a layer's misses all or none, between tokens (``ggmoe.cache.miss.async_cpu_experts``).
    ``--decode-mode async`` runs the host path in its graph."""
    out = []
    if miss_policy != "wait" and auto:
        out.append(f"the host path (miss policy {miss_policy}) splits each layer call's misses by the copies in "
                   "flight in the sync decode (--decode-mode async computes them in its graph's host part)")
    if prefetch_note:
        out.append(prefetch_note)
    if backend_note:
        out.append(backend_note)
    return out


@dataclass(frozen=True)
class ModeEstimate:
    """What ``auto`` weighs for a stride prefetch (estimates): per decoded token, the time the cache adds to
    each mode's decode, and where the figures come from."""

    sync_s: float  # s per token: a device sync per cached layer plus the waits for its misses' copies
    async_s: float  # s per token: each miss over the link once (a fill), or read in place and then admitted
    source: str  # where the costs come from (a profile, measured here)

    def line(self) -> str:
        return (f"sync {self.sync_s * 1e3:.3f} ms a token against async {self.async_s * 1e3:.3f} ms "
                f"(estimates; {self.source})")


def weigh_modes(bytes_per_expert: Mapping[int, int], n_slots: Mapping[int, int], n_expert: int, n_expert_used: int,
                copy_s: Callable[[int], float], sync_s: float, read_s: Callable[[int], float] | None,
                source: str, counts: Mapping[int, Sequence[int]] | None = None, fills: bool = True) -> ModeEstimate:
    """Per token, the sync decode's cost (``sync_s`` per cached layer: the route op's graph split and device
    sync, plus a wait of ``copy_s(bytes)`` for each miss) against the async decode's.

    With in-graph fills (``fills``, ``DecodeConfig.fills``) the graph copies each miss into a fill slot inside its
    layer and reads it there: one crossing, ``read_s(bytes)`` (the fill kernel reads pinned host memory at the
    rate of a read in place), or ``copy_s(bytes)`` where ``read_s`` is None (the CPU build, whose fill is a
    memcpy), and no admission follows. Without fills each miss is read in place (``read_s``; None: nothing
    beyond the compute, as on the CPU build, whose experts are in the memory the CPU reads) and then admitted
    by a ``copy_s(bytes)`` over the same link between tokens: on a link that bounds the decode it moves each
    miss twice (docs/benchmarks.md, the H200 figures). A stride prefetch lands copies in both
    modes alike, so it moves both sides by the same misses and is not counted. A layer's misses a token: see
    ``miss_share``."""
    sync = read = 0.0
    for il, n in n_slots.items():
        nb = bytes_per_expert.get(il, 0)
        misses = n_expert_used * miss_share(n, n_expert, counts.get(il) if counts else None)
        sync += sync_s + misses * copy_s(nb)
        if fills:
            read += misses * (read_s(nb) if read_s is not None else copy_s(nb))
        else:
            read += misses * ((read_s(nb) if read_s is not None else 0.0) + copy_s(nb))
    if counts:
        source += "; misses from the routing statistics' counts"
    if fills:
        source += "; async fills each miss once"
    return ModeEstimate(sync, read, source)


def choose_decode_mode(asked: str, reasons: list[str], weighed: ModeEstimate | None = None,
                       weighed_for: str = "on a GPU") -> DecodeMode:
    """``asked`` against what needs sync: ``auto`` picks, ``async`` with a conflict is a usage error. With
    ``weighed`` (on a GPU, or with a stride prefetch, which either mode runs), ``auto`` takes the mode it
    estimates faster (async on a tie); ``weighed_for`` says why it weighed, in its reason."""
    asked = check_decode_mode(asked)
    if asked == "sync":
        return DecodeMode(asked, "sync", "asked for (--decode-mode sync)")
    if reasons:
        if asked == "async":
            raise UsageError(f"--decode-mode async cannot run here: {reasons[0]}; use --decode-mode sync or auto")
        return DecodeMode(asked, "sync", reasons[0])
    if asked == "async":
        return DecodeMode(asked, "async", "asked for (--decode-mode async)")
    if weighed is not None:
        faster = "sync" if weighed.sync_s < weighed.async_s else "async"
        return DecodeMode(asked, faster, f"auto, {weighed_for}, chose the faster: {weighed.line()}")
    return DecodeMode(asked, "async", "no layer needs the CPU's answer: experts read through the device-side "
                      "table, no sync per layer")
