"""The miss policy of a cache with a slot for every expert: auto leaves the host path off."""

from __future__ import annotations

import pytest

from ggmoe.cache.miss import without_host_path_when_full

pytestmark = pytest.mark.unit

N_EXPERT = 8


@pytest.mark.parametrize("policy, slots, want", [
    ("auto", {0: 8, 1: 8}, "wait"),  # every expert has a slot: nothing for the CPU once cached
    ("auto", {0: 8, 1: 7}, "auto"),  # a layer that misses: the host path can pay
    ("cpu", {0: 8, 1: 8}, "cpu"),  # asked for by name: left as it is
    ("wait", {0: 8}, "wait"),
])
def test_auto_turns_the_host_path_off_where_every_expert_has_a_slot(policy, slots, want):
    got, note = without_host_path_when_full(policy, slots, N_EXPERT)
    assert got == want and (note is not None) == (policy != want)
