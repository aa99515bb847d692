"""The refreshed engine: observers side by side, Ctrl-C, the context limit, facts once, placement from buffers."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from ggmoe.base.hook import HookRequest, RouteRecorder
from ggmoe.engine import Engine, EngineConfig
from ggmoe.inspect import inspect_model


class Raising:
    """An observer whose on_route raises ``exc`` once."""

    request = HookRequest(probs=False, hidden=False)

    def __init__(self, exc: BaseException) -> None:
        self.exc: BaseException | None = exc

    def on_route(self, event) -> None:
        exc, self.exc = self.exc, None
        if exc is not None:
            raise exc


class SigInt:
    """An observer that sends this process SIGINT from inside the route callback (a user's Ctrl-C)."""

    request = HookRequest(probs=False, hidden=False)

    def __init__(self) -> None:
        self.sent = False

    def on_route(self, event) -> None:
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("hook_path", ["route", "cb_eval"])
def test_several_observers_get_the_same_events(qwen3moe_model, hook_path):
    a = RouteRecorder(HookRequest(probs=True, hidden=True))
    b = RouteRecorder(HookRequest(probs=False, hidden=False))
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=128, hook_path=hook_path), observer=a) as eng:
        eng.add_observer(b)
        eng.decode(eng.tokenize("hello world"), all_logits=True)
        ea, eb = a.take(), b.take()
        assert ea and sorted(ea) == sorted(eb)
        for il in ea:
            assert np.array_equal(ea[il].ids, eb[il].ids)
            assert ea[il].probs is not None and ea[il].hidden is not None
        eng.remove_observer(b)
        eng.decode(eng.tokenize(" again", add_bos=False))
        assert a.take() and not b.take()


def test_observing_attaches_for_a_block_only(qwen3moe_model):
    rec = RouteRecorder()
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=128)) as eng:
        with eng.observing(rec):
            eng.decode(eng.tokenize("abc"))
        assert rec.take()
        eng.decode(eng.tokenize("def", add_bos=False))
        assert not rec.take() and rec not in list(eng.observers)


@pytest.mark.parametrize("hook_path", ["route", "cb_eval"])
def test_keyboard_interrupt_in_a_callback_surfaces_after_the_decode(qwen3moe_model, hook_path):
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=128, hook_path=hook_path)) as eng:
        eng.add_observer(Raising(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            eng.decode(eng.tokenize("hello"))
        eng.reset()
        assert eng.decode(eng.tokenize("hello")).shape == (1, eng.n_vocab)  # the engine still works


def test_ctrl_c_during_a_decode_is_held_then_raised(qwen3moe_model):
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=128), observer=SigInt()) as eng:
        with pytest.raises(KeyboardInterrupt):
            eng.decode(eng.tokenize("hello"))
        with pytest.raises(KeyboardInterrupt):  # outside a decode Ctrl-C interrupts at once, as by default
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        eng.reset()
        eng.decode(eng.tokenize("hello"))


def test_generation_stops_at_the_context_instead_of_failing(qwen3moe_model):
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=16)) as eng:
        n_ctx = eng.n_ctx  # llama.cpp may round the context up
        prompt = eng.tokenize("hello world")
        tok = next(t for t in range(3, eng.n_vocab) if not eng.is_eog(t))
        forced = [tok] * (n_ctx + 50)  # teacher forcing: no EOG can end it early
        out = [t for t, _ in eng.stream(prompt, len(forced), forced=forced)]
        assert eng.stopped_on_ctx
        assert eng.n_past == n_ctx and len(prompt) + len(out) == n_ctx + 1  # the last token is never fed
        gen = eng.generate("hello world", max_tokens=2)
        assert not gen.stopped_on_ctx


def test_n_ctx_defaults_to_the_training_context(qwen3moe_model):
    with Engine(EngineConfig(model_path=qwen3moe_model)) as eng:
        assert eng.n_ctx == eng.n_ctx_train > 0


def test_facts_come_from_the_inspector_once(qwen3moe_model):
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=64)) as eng:
        assert eng.facts == inspect_model(qwen3moe_model)
        assert eng.n_layer == eng.facts.n_layer and eng.n_embd == eng.facts.n_embd


def test_expert_placement_is_read_from_the_tensor_buffers(qwen3moe_model):
    facts = inspect_model(qwen3moe_model)
    every = {t.name for layer in facts.layers for t in layer.tensors}
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=64)) as eng:
        assert set(eng.host_expert_tensors) == every
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=64, experts_on_host=False)) as eng:
        assert eng.host_expert_tensors == ()


def test_streaming_text_equals_the_final_text(qwen3moe_model):
    pieces: list[str] = []
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=128)) as eng:
        gen = eng.generate("hello", max_tokens=12, on_text=pieces.append)
    assert "".join(pieces) == gen.text
