"""MoEpic's LCP eviction: priority ``mu * rho ** (nu / omega)``, the lowest priority goes.

MoEpic (Yan, Liu, Xu, Huang: "Accelerating Mixture-of-Expert Inference with Adaptive Expert Split
Mechanism", arXiv 2509.08342) weighs how often an expert was used by how long ago, decayed geometrically:

- ``mu``: the expert's use frequency in its layer: the share of the layer's calls so far that used it
  (use count / layer calls; a count per layer scaled by the same number for every candidate, so only the
  count matters for the choice);
- ``nu``: the layer's calls since the expert's last use (0: the latest call used it; an expert never used
  has ``mu = 0``, priority 0);
- ``rho = 0.25`` and ``omega = 128``: the priority of an expert left unused for 128 calls falls to a quarter.

Calls are counted per MoE layer (one per token while decoding), see ``ggmoe.cache.policies.usage``.
Ties: least recently used, then lowest id.
"""

from __future__ import annotations

from ggmoe.base.errors import UsageError
from ggmoe.base.params import Param
from ggmoe.cache.policies.base import POLICIES, Policy
from ggmoe.cache.policies.usage import LayerUsage

RHO = 0.25  # decay base
OMEGA = 128.0  # calls of a layer over which the priority decays by RHO


@POLICIES.register("lcp")
class LCP(Policy):
    """MoEpic's LCP: evict the lowest mu * rho^(nu/omega) (mu use frequency, nu calls since last use)."""

    PARAMS = (Param("rho", float, low=0.0, high=1.0, low_open=True, high_open=True, help="decay base"),
              Param("omega", float, low=0.0, high=1e12, low_open=True,
                    help="calls of a layer over which the priority decays by rho"))

    def __init__(self, n_expert: int, layers: list[int], rho: float = RHO, omega: float = OMEGA) -> None:
        super().__init__(n_expert, layers)
        if not 0.0 < rho < 1.0 or omega <= 0.0:
            raise UsageError(f"lcp: need 0 < rho < 1 and omega > 0, got rho={rho}, omega={omega}")
        self.rho = rho
        self.omega = omega
        self.usage = LayerUsage(n_expert, layers)

    def on_access(self, il: int, experts: list[int], clock: int) -> None:
        self.usage.record(il, experts)

    def priority(self, il: int, expert: int) -> float:
        u = self.usage
        now = u.calls[il]
        if now == 0:
            return 0.0
        mu = u.count[il][expert] / now
        nu = now - u.last[il][expert]
        return mu * self.rho ** (nu / self.omega)

    def victim(self, il: int, candidates: list[int], clock: int) -> int:
        last = self.usage.last[il]
        return min(candidates, key=lambda e: (self.priority(il, e), last[e], e))
