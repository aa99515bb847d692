"""One async token, walked (docs/architecture.md): which ggmoe modules a decode step's Python runs in, and which
way the calls between packages go. A profile of one ``eval`` of one token, counted by modules, not by time:
the house's shape, held so that a change that routes the token through more of it is seen."""

from __future__ import annotations

import sys

import pytest

import ggmoe

pytestmark = pytest.mark.engine

MAX_MODULES = 10  # docs/architecture.md's walk
PACKAGES = {"engine", "control", "cache"}  # the driver (GgmoeLlama) is the engine's
# the only call from a lower package into a higher one: the cache's copies through the copy backend it was
# given (a port the cache owns, ``ggmoe.cache.copy.CopyBackend``)
UPWARD_OK = {("cache", "engine")}
ORDER = ["base", "inspect", "trace", "cache", "predict", "control", "engine", "simulate", "serve", "cli"]


def _walk(llm, token: int) -> tuple[list[str], set[tuple[str, str]]]:
    """The ggmoe modules one ``eval([token])`` runs Python in, in first-call order, and every (caller's package,
    callee's package) pair of a call between two ggmoe modules."""
    modules: list[str] = []
    calls: set[tuple[str, str]] = set()

    def profile(frame, event, arg):
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("ggmoe."):
            return
        modules.append(name)
        caller = frame.f_back
        while caller is not None and not caller.f_globals.get("__name__", "").startswith("ggmoe."):
            caller = caller.f_back
        if caller is not None:
            calls.add((caller.f_globals["__name__"].split(".")[1], name.split(".")[1]))

    sys.setprofile(profile)
    try:
        llm.eval([token])
    finally:
        sys.setprofile(None)
    return list(dict.fromkeys(modules)), calls


def test_one_async_token_stays_in_three_packages_and_few_modules():
    with ggmoe.load(None, cache_slots=4, decode_mode="async", verbose=False, n_ctx=256) as llm:
        llm.eval(llm.tokenize(b"Once upon a time"))
        for t in (42, 43, 44):  # past the prompt: the cache full, admissions evicting
            llm.eval([t])
        runtime = llm.attachment.runtime
        runtime.stream.synchronize()  # every admission landed (a deferred stream's too): the walked token's
        llm.eval([44])  # misses are admitted whatever the copies' timing; this step marks them landed
        runtime.stream.synchronize()
        before = llm.attachment.runtime.cache.stats.total()
        modules, calls = _walk(llm, 45)
        after = llm.attachment.runtime.cache.stats.total()
    # the token's misses crossed the link: filled by the graph (the default), or admitted as copies
    moved = after.fills + after.admission_copies - before.fills - before.admission_copies
    assert moved > 0, "the walked token filled and copied nothing: the walk would miss the miss path"
    assert {m.split(".")[1] for m in modules} == PACKAGES, modules
    assert len(modules) <= MAX_MODULES, modules
    upward = {(a, b) for a, b in calls if a != b and ORDER.index(a) < ORDER.index(b)}
    assert upward <= UPWARD_OK, upward


def test_the_route_ops_recorded_error_reaches_the_caller_once():
    """The pipeline reads the op's error code in C after every decode and runs the hook's Python only when one
    was recorded: a repeated slot within a token (which CUDA's mul_mat_id would count once) is refused by the op,
    raised from that token's ``eval``, and cleared for the next."""
    from ggmoe.base.errors import EngineError

    with ggmoe.load(None, cache_slots=4, decode_mode="sync", verbose=False, n_ctx=256) as llm:
        llm.eval(llm.tokenize(b"Once upon a time"))
        cache = llm.attachment.runtime.cache
        real = cache.route_flat
        cache.route_flat = lambda il, ids, *a: [0] * len(real(il, ids))  # every entry of the token in slot 0
        with pytest.raises(EngineError, match="the route op failed: .*SLOT"):
            llm.eval([42])
        del cache.route_flat
        llm.eval([43])
