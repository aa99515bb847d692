"""A layer the context refuses takes back the layers registered before it, before their tensors are freed.

A context left pointing at freed slot tensors or expert tables builds its next graph over them: on a GPU an
illegal address, on the CPU build stale memory, possibly without a word. The refusal is forced with a
wrapper of the patched library that refuses the second layer's registration and records every call.
"""

from __future__ import annotations

import pytest

from ggmoe.base.errors import EngineError
from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine import patch as _patched

pytestmark = pytest.mark.engine

REFUSED = 99  # no code the patch returns: reported by number


class Refusing:
    """The patched library with ``name`` refused for the second layer it registers; that call's history."""

    def __init__(self, real, name: str) -> None:
        self.real, self.name = real, name
        self.calls: list[tuple[int, bool]] = []  # (il, registering: False when the layer is taken back)

    def __getattr__(self, attr: str):
        fn = getattr(self.real, attr)
        if attr != self.name:
            return fn

        def call(ctx, il, *args):
            registering = any(a not in (0, None) for a in args)
            self.calls.append((il, registering))
            if registering and len({i for i, r in self.calls if r}) == 2:
                return REFUSED
            return fn(ctx, il, *args)

        return call


CASES = [  # (the call refused, the cache asked for)
    ("llama_ggmoe_set_layer_cache", RunConfig(CacheConfig(n_slots=4))),
    ("llama_ggmoe_set_layer_table", RunConfig(CacheConfig(n_slots=4), decode=DecodeConfig(mode="async"))),
]


@pytest.mark.parametrize(("name", "config"), CASES, ids=["slots", "tables"])
def test_a_refused_layer_takes_back_the_layers_registered_before_it(name, config, qwen3moe_model, monkeypatch):
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=256, run=RunConfig(CacheConfig(n_slots=3)))) as eng:
        fake = Refusing(_patched.symbols(), name)
        monkeypatch.setattr(_patched, "symbols", lambda: fake)
        with pytest.raises(EngineError, match=f"failed: {REFUSED}"):
            eng.reconfigure(config)
        monkeypatch.undo()
        registered = [il for il, r in fake.calls if r]
        first, refused = registered[0], registered[1]
        after = fake.calls[fake.calls.index((refused, True)) + 1:]
        assert (first, False) in after, fake.calls  # taken back after the refusal, before anything freed it
        eng.decode([1, 2, 3])  # the context reads no freed tensor: stock experts, as with no cache
