"""The miss policy of a cache with a slot for every expert, warmed before the first token: auto and cpu leave the
host path off (no miss is ever left for the CPU), unless the policy drops what it loads (on-demand)."""

from __future__ import annotations

import pytest

from ggmoe.cache.miss import without_host_path_when_full

pytestmark = pytest.mark.unit

N_EXPERT = 8


@pytest.mark.parametrize("policy, slots, keeps, want", [
    ("auto", {0: 8, 1: 8}, True, "wait"),  # every expert has a slot: warmed, nothing for the CPU
    ("auto", {0: 8, 1: 7}, True, "auto"),  # a layer that misses: the host path can pay
    ("cpu", {0: 8, 1: 8}, True, "wait"),  # asked for by name, with nothing to do: off, and said
    ("cpu", {0: 8, 1: 8}, False, "cpu"),  # on-demand: every use a miss, whatever the slots
    ("auto", {0: 8, 1: 8}, False, "auto"),
    ("wait", {0: 8}, True, "wait"),
])
def test_the_host_path_is_off_where_every_expert_has_a_slot(policy, slots, keeps, want):
    got, note = without_host_path_when_full(policy, slots, N_EXPERT, keeps)
    assert got == want and (note is not None) == (policy != want)
    if note is not None:
        assert note.startswith(f"{policy}: every expert has a slot, warmed before the first token")
