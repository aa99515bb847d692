"""What to do with an expert that is not on the device when its layer runs: wait for a copy, or the CPU.

- ``wait``: copy it now (demand priority) and wait: what llama.cpp's own expert cache does;
- ``cpu``: compute it on the CPU from the host tensor (the host path) and queue an admission copy at low
  priority so that a later token finds it; a copy still in flight is not waited for either;
- ``auto``: whichever the cost model says is sooner: the copy's remaining time (or a new copy's whole
  time) against the CPU's time for that expert. Where the CPU computes beside the link (the cache's
  ``cpu_beside_link``: the simulator's ``hybrid`` decode), a layer's new misses are instead split between
  the two servers so that both finish together (``split_misses``).

Why ``auto`` splits only beside the link: without a worker for the host part (patch 0015), the engine's sync
decode waits for a layer's copies inside the route op, before the graph computes anything, its CPU part
included, so the link and the CPU run in turn. Their times then add, and each miss going to the server that
is sooner for it alone (``prefer_host``) minimizes that sum. With a worker, the CPU starts on its misses at the
route op and the layer waits for its copies afterwards (the wait hook): there the split pays.

The host path exists only for micro-batches of at most ``HOST_MAX_TOKENS`` tokens (the patch's
``LLAMA_GGMOE_HOST_MAX_TOKENS``); larger ones wait, whatever the policy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ggmoe.base.registry import check_choice

MISS_POLICIES = ("wait", "cpu", "auto")
HOST_MAX_TOKENS = 16  # tokens; mirrors LLAMA_GGMOE_HOST_MAX_TOKENS of patch 0004
SLOT_HOST = -1  # the route callback's answer "computed by the CPU" (LLAMA_GGMOE_SLOT_HOST)


def check_miss_policy(name: str) -> str:
    return check_choice(name, MISS_POLICIES, "miss policy")


@dataclass(frozen=True)
class MissCosts:
    """The machine's cost model for one expert of ``nbytes`` bytes (seconds); measured or from a profile."""

    copy_bytes_per_s: float  # host-to-device copy bandwidth (bytes/s)
    copy_latency_s: float  # fixed cost of one expert copy (s)
    cpu_bytes_per_s: float  # bytes of expert weights the CPU multiplies per second (memory-bound matvec)
    cpu_latency_s: float = 0.0  # fixed cost of one expert on the CPU (s)
    # fixed cost of a layer call whose experts the CPU computes any of, where the CPU runs beside the link: the
    # graph split's device sync, the activations to the host and the results back (s)
    host_split_s: float = 0.0
    # what the GPU's matvec of one expert reads per second and its fixed cost, where known (a copied miss is
    # computed after its copy lands, beside the hits): None, the GPU's time is left out
    gpu_bytes_per_s: float | None = None
    gpu_latency_s: float = 0.0  # s
    # what the GPU's kernels read of pinned host memory per second (the async decode's fills and reads in place,
    # no per-copy latency); None: the copy engine's rate (HardwareProfile.zero_copy_s's fallback)
    zero_copy_bytes_per_s: float | None = None

    def copy_s(self, nbytes: int) -> float:
        return self.copy_latency_s + nbytes / self.copy_bytes_per_s

    def zero_copy_s(self, nbytes: int) -> float:
        """A miss the async decode's graph reads over the link (filled into a slot, or read in place)."""
        return nbytes / (self.zero_copy_bytes_per_s or self.copy_bytes_per_s)  # no per-copy latency: a kernel reads

    def gpu_s(self, nbytes: int) -> float:
        return self.gpu_latency_s + nbytes / self.gpu_bytes_per_s if self.gpu_bytes_per_s else 0.0

    def cpu_s(self, nbytes: int) -> float:
        return self.cpu_latency_s + nbytes / self.cpu_bytes_per_s


def prefer_host(policy: str, costs: MissCosts | None, nbytes: int, copy_left_s: float | None) -> bool:
    """Whether a missing expert goes to the CPU. ``copy_left_s``: remaining time of a copy in flight, or None."""
    if policy == "wait":
        return False
    if policy == "cpu" or costs is None:
        return True
    wait_s = copy_left_s if copy_left_s is not None else costs.copy_s(nbytes)
    return costs.cpu_s(nbytes) < wait_s


def split_misses(n_misses: int, copy_s: float, cpu_s: float, link_busy_s: float = 0.0,
                 cpu_busy_s: float = 0.0, cpu_fixed_s: float = 0.0) -> int:
    """How many of a layer's ``n_misses`` new misses go to the CPU when the link and the CPU serve them at once.

    The link copies its share one after another after ``link_busy_s`` of work already on it (``copy_s`` an
    expert); the CPU computes its share after ``cpu_busy_s`` (``cpu_s`` an expert), and pays ``cpu_fixed_s``
    once when it has any work at all (``MissCosts.host_split_s``). The answer minimizes the later of the two
    finishes, ``max(link_busy_s + (n - k) copy_s, cpu_busy_s + fixed + k cpu_s)``; on a tie, the fewer to the
    CPU, since a copy also leaves the expert cached for later tokens.
    """
    if n_misses <= 0 or copy_s + cpu_s <= 0.0:  # nothing missed, or both free: nothing to gain from the CPU
        return 0
    cpu_start = cpu_busy_s + cpu_fixed_s  # when the CPU starts on new misses

    def finish(k: int) -> float:
        cpu = cpu_start + k * cpu_s if k or cpu_busy_s > 0.0 else 0.0  # an idle CPU pays no fixed cost
        return max(link_busy_s + (n_misses - k) * copy_s, cpu)

    # the two lines cross at x; the best integer is one of its neighbours (clamped to [0, n]) or none at all
    x = (link_busy_s + n_misses * copy_s - cpu_start) / (copy_s + cpu_s)
    lo = min(max(math.floor(x), 0), n_misses)
    hi = min(max(math.ceil(x), 0), n_misses)
    return min((0, lo, hi), key=lambda k: (finish(k), k))


def host_path_pays_beside(costs: MissCosts | None, bytes_per_expert: Mapping[int, int], n_expert_used: int) -> bool:
    """Whether ``auto`` keeps the host path where the CPU runs beside the link: for some layer, a token's worth
    of misses (``n_expert_used``) on an idle link and CPU sends at least one to the CPU (no cost model: kept)."""
    if costs is None:
        return True
    return any(split_misses(n_expert_used, costs.copy_s(nb), costs.cpu_s(nb)) > 0 for nb in bytes_per_expert.values())


def host_path_pays(costs: MissCosts | None, bytes_per_expert: Mapping[int, int]) -> bool:
    """Whether ``auto`` keeps the host path: for some layer, the CPU computes an expert sooner than a copy on
    an idle link brings it (no cost model: kept, as ``prefer_host`` then sends misses to the CPU).

    The host path is not free when unused: its host matmuls split the graph at every MoE layer, whether or
    not an expert goes to the CPU (docs/benchmarks.md has an H100's figures, where a copy always beats the
    CPU). A host path ``auto`` would never choose only costs, so it is not built.
    """
    if costs is None:
        return True
    return any(costs.cpu_s(nb) < costs.copy_s(nb) for nb in bytes_per_expert.values())


def effective_miss_policy(policy: str, costs: MissCosts | None, bytes_per_expert: Mapping[int, int],
                          beside_k: int | None = None) -> tuple[str, str | None]:
    """The miss policy the cache runs and, when ``auto`` became ``wait``, why (one line for the user).
    ``beside_k``: where the CPU runs beside the link, the misses a layer call can have (``n_expert_used``): the
    host path then pays where the split sends one of them to the CPU (``host_path_pays_beside``)."""
    policy = check_miss_policy(policy)
    pays = (host_path_pays(costs, bytes_per_expert) if beside_k is None
            else host_path_pays_beside(costs, bytes_per_expert, beside_k))
    if policy != "auto" or pays:
        return policy, None
    nb = max(bytes_per_expert.values(), default=0)
    return "wait", (f"auto: a copy ({costs.copy_s(nb) * 1e6:.0f} us per expert) is sooner than the CPU "
                    f"({costs.cpu_s(nb) * 1e6:.0f} us), so misses wait for copies and the host path is off")


def without_host_path_when_full(policy: str, n_slots: Mapping[int, int], n_expert: int,
                                keeps: bool = True) -> tuple[str, str | None]:
    """``auto`` or ``cpu`` on a cache with a slot for every expert of every layer, under a policy that ``keeps``
    what it loads (not on-demand): every decode mode warms such a cache before the first token
    (``ExpertCache.preload``), so no miss is ever left for the CPU, while the host path would still split every
    MoE layer's graph and keep a zero slot (one expert too few: a miss every few tokens). It runs as ``wait`` and
    says so (one line for the user: the flag given has nothing to do)."""
    if policy == "wait" or not keeps or not n_slots or min(n_slots.values()) < n_expert:
        return policy, None
    return "wait", (f"{policy}: every expert has a slot, warmed before the first token, so no miss is left for the "
                    "CPU and the host path is off")


def host_path_refusal(split: bool) -> str | None:
    """Why the host path cannot serve a cache (None: it can): ``split``, whether some layer's experts are split
    (MoEpic). Every decode mode has a host path: the async decode computes its CPU experts in the graph's host
    part (patch 0016)."""
    if split:
        return "split experts read what is not cached from host memory through the expert table"
    return None


def async_cpu_experts(policy: str, costs: MissCosts | None, nbytes: int, n_slots: int, n_expert: int,
                      n_expert_used: int, counts: Sequence[int] | None = None) -> tuple[int, ...]:
    """The experts of one layer that the async decode computes on the CPU whenever no slot holds them (its host
    part in table mode, patch 0016); every other miss is filled into a slot by the graph (or read in place).

    The async decode decides between tokens, before the routing is known, so it decides by expert, not by call:
    ``cpu``, every expert; ``wait``, none; ``auto``, every expert where a miss is sooner on the CPU than read over
    the link by the graph (``zero_copy_s``, then computed on the GPU), counting its share of the layer's graph split (``host_split_s``, paid every token by a layer with
    a host part) over a token's expected misses (``counts``, else uniform routing: ``miss_share``), else none.
    A fixed share of the experts does not balance the two per token: the real routing's misses of a layer fall
    on either side unevenly, and the simulator put such a share behind both choices on the shared
    DeepSeek-V2-Lite routing (docs/policies.md). The per-token balance is the sync decode's (``split_misses``)."""
    policy = check_miss_policy(policy)
    if policy == "wait" or n_slots >= n_expert:
        return ()
    if policy == "cpu" or costs is None:
        return tuple(range(n_expert))
    misses = n_expert_used * miss_share(n_slots, n_expert, counts)  # expected a token (a fraction)
    if misses <= 0.0:
        return ()
    link_s, cpu_s = costs.zero_copy_s(nbytes) + costs.gpu_s(nbytes), costs.cpu_s(nbytes)
    return tuple(range(n_expert)) if cpu_s + costs.host_split_s / misses < link_s else ()


def async_cpu_masks(policy: str, costs: MissCosts | None, bytes_per_expert: Mapping[int, int],
                    n_slots: Mapping[int, int], n_expert: int, n_expert_used: int,
                    counts: Mapping[int, Sequence[int]] | None = None, keeps: bool = True) -> dict[int, list[bool]]:
    """``ExpertCache.cpu_of`` for the async decode's host part, as the engine's pipeline and the simulator set it:
    il -> [n_expert] flags of the experts ``async_cpu_experts`` sends to the CPU; a layer with none is left out.
    ``keeps``: the eviction policy keeps what it loads (False: on-demand, every use a miss, whatever the slots)."""
    masks: dict[int, list[bool]] = {}
    for il, n in n_slots.items():
        n = n if keeps else 0
        experts = async_cpu_experts(policy, costs, bytes_per_expert.get(il, 0), n, n_expert, n_expert_used,
                                    (counts or {}).get(il))
        if experts:
            mask = [False] * n_expert
            for e in experts:
                mask[e] = True
            masks[il] = mask
    return masks


def miss_share(n_slots: int, n_expert: int, counts: Sequence[int] | None) -> float:
    """The share of a layer's expert selections a cache of ``n_slots`` misses: with routing statistics
    (``counts`` [n_expert], tokens that chose each expert), what its ``n_slots`` most chosen experts do not
    cover; without them (or with none counted), ``1 - slots / n_expert``, uniform routing."""
    total = sum(counts) if counts is not None else 0
    if not total:
        return max(0.0, 1.0 - n_slots / n_expert)
    return max(0.0, 1.0 - sum(sorted(counts, reverse=True)[:n_slots]) / total)


def auto_without_host_path(policy: str, split: bool) -> tuple[str, str | None]:
    """The miss policy to build a cache with, before any cost model: ``auto`` becomes ``wait`` where the host
    path cannot serve the cache, and says why (``cpu`` asked for explicitly is left to be refused)."""
    policy = check_miss_policy(policy)
    why = host_path_refusal(split) if policy == "auto" else None
    if why is None:
        return policy, None
    return "wait", f"auto: {why}, so misses are not computed on the CPU (the host path is off)"
