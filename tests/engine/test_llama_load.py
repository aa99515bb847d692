"""``ggmoe.load()``: a ``llama_cpp.Llama`` with host experts and the cache, token for token a plain ``Llama``."""

from __future__ import annotations

import gguf
import jinja2
import llama_cpp
import pytest

import ggmoe
from ggmoe.base.errors import EngineError, ModelFileError, UsageError
from ggmoe.engine.llama import GgmoeLlama
from ggmoe.inspect import inspect_model
from ggmoe.models import default_model_path
from tools.fixtures.make_fixtures import rewrite_gguf

PROMPT = "The quick brown fox"
N_TOKENS = 24


def greedy(llm: llama_cpp.Llama) -> list[int]:
    """The greedy continuation of PROMPT as token ids."""
    llm.reset()
    out = []
    for tok in llm.generate(llm.tokenize(PROMPT.encode()), temp=0.0, top_k=1):
        out.append(tok)
        if len(out) == N_TOKENS:
            break
    return out


@pytest.fixture(scope="module", params=["embedded", "qwen3moe"])
def model(request, qwen3moe_model):
    return str(default_model_path() if request.param == "embedded" else qwen3moe_model)


@pytest.fixture(scope="module")
def stock_tokens(model):
    llm = llama_cpp.Llama(model, n_ctx=128, verbose=False, seed=0)
    try:
        return greedy(llm)
    finally:
        llm.close()


# options by (n_expert, n_expert_used) of the model
@pytest.mark.parametrize("make_options", [
    lambda n, k: {},
    lambda n, k: {"cache_slots": n},
    lambda n, k: {"cache_slots": k},
    lambda n, k: {"cache_slots": k + 1, "policy": "lfu"},
    lambda n, k: {"cache_slots": k + 2, "miss_policy": "cpu"},
    lambda n, k: {"cache_slots": k + 2, "predictor": "reuse", "stride": 1},
], ids=["no-cache", "all-cached", "top-k-slots", "lfu", "host-path", "prefetch"])
def test_same_greedy_tokens_as_plain_llama(model, stock_tokens, make_options):
    facts = inspect_model(model)
    options = make_options(facts.n_expert, facts.n_expert_used)
    with ggmoe.load(model, n_ctx=128, **options) as llm:
        assert isinstance(llm, llama_cpp.Llama)
        assert greedy(llm) == stock_tokens
        stats = llm.stats()["cache"]
    if options:
        total = stats["total"]
        assert total["hits"] + total["misses"] > 0
        assert stats["slots_per_layer"] and set(stats["occupancy"]) == set(stats["slots_per_layer"])
        if options.get("miss_policy") == "cpu":
            assert total["host_computed"] > 0
        if "predictor" in options:
            assert total["prefetch_issued"] > 0
    else:
        assert stats is None


def test_a_run_config_from_the_package_root_runs_as_its_options_do(model, stock_tokens):
    """``ggmoe.load(run=ggmoe.RunConfig(...))``: the records from the package root, the same run as the options."""
    facts = inspect_model(model)
    run = ggmoe.RunConfig(ggmoe.CacheConfig(n_slots=facts.n_expert_used + 2),
                          decode=ggmoe.DecodeConfig(mode="sync", miss_policy="cpu"))
    with ggmoe.load(model, n_ctx=128, run=run) as llm:
        assert llm.run_config is run
        assert greedy(llm) == stock_tokens
        stats = llm.stats()["cache"]
    assert stats["decode_mode_in_effect"] == "sync" and stats["total"]["host_computed"] > 0
    with pytest.raises(UsageError, match="run=RunConfig"):
        ggmoe.load(model, cache=run.cache)  # the cache alone is not a run: one clear error, nothing loaded


def test_llama_api_works_unchanged():
    with ggmoe.load(n_ctx=256, cache_slots=8, seed=1) as llm:
        c = llm.create_completion("def main():", max_tokens=8, temperature=0)
        assert c["choices"][0]["text"] and c["usage"]["completion_tokens"] <= 8
        chunks = list(llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=6, stream=True))
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = llm.detokenize(llm.tokenize(b"hello world", add_bos=False))
        assert text == b"hello world"


def test_default_chat_template_when_the_gguf_has_none():
    with ggmoe.load(n_ctx=256) as llm:
        assert "tokenizer.chat_template" not in llm.metadata
        r = llm.create_chat_completion([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
                                       max_tokens=4, temperature=0)
    assert r["choices"][0]["message"]["role"] == "assistant"


ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('echo pwned').read() }}",
    "{% for m in messages %}{{ m.__class__.__base__.__subclasses__() }}{% endfor %}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_a_template_that_tries_to_escape_the_sandbox_is_refused(tmp_path, template):
    path = rewrite_gguf(default_model_path(), tmp_path / "evil.gguf", keys={
        "tokenizer.chat_template": (template, gguf.GGUFValueType.STRING, None)})
    with ggmoe.load(path, n_ctx=128) as llm:
        with pytest.raises(jinja2.exceptions.SecurityError):
            llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=2)
        # the model is still usable afterwards
        assert llm.create_completion("a", max_tokens=2)["choices"][0]["text"] is not None


@pytest.mark.parametrize("mode, hot_path", [("sync", "route_flat"), ("async", "after_one_token")])
def test_a_route_callback_error_surfaces_from_the_llama_call(mode, hot_path):
    """An error in the cache's per-layer call (sync: inside the route callback; async: in the controller
    between tokens) is raised by the Llama call that ran the decode."""
    with ggmoe.load(n_ctx=128, cache_slots=8, decode_mode=mode) as llm:
        cache = llm.attachment.runtime.cache

        def broken(il, ids):
            raise EngineError(f"injected failure in layer {il}")

        real = getattr(cache, hot_path)
        setattr(cache, hot_path, broken)
        with pytest.raises(EngineError, match="injected failure"):
            llm.create_completion("hello", max_tokens=4)
        assert llm.n_tokens == 0  # that decode's KV entries are meaningless: the sequence was forgotten
        setattr(cache, hot_path, real)
        assert llm.create_completion("hello", max_tokens=4)["usage"]["completion_tokens"] > 0


def test_close_is_deterministic_and_idempotent():
    llm = ggmoe.load(n_ctx=64, cache_slots=8)
    assert isinstance(llm, GgmoeLlama) and llm.attachment is not None
    llm.close()
    llm.close()
    assert llm.attachment is None


def _engine():
    from ggmoe.cache import CacheConfig
    from ggmoe.control.run_config import RunConfig
    from ggmoe.engine import Engine, EngineConfig

    return Engine(EngineConfig(default_model_path(), n_ctx=64, run=RunConfig(CacheConfig(n_slots=8))))


@pytest.mark.parametrize("driver", ["llama", "engine"])
def test_teardown_runs_every_step_when_one_raises(driver):
    """Both drivers tear down through one ExitStack: a step that raises (here in the pipeline's detach, taking the
    route hook off the context) is raised from ``close``, and every later step still runs: the pipeline leaves the
    context, the driver frees it, the cache's slot tensors are freed, the driver lets go."""
    obj = ggmoe.load(n_ctx=64, cache_slots=8) if driver == "llama" else _engine()
    pipeline = obj.attachment if driver == "llama" else obj.pipeline
    closed = []
    real_close = pipeline.close

    def broken_uninstall(ctx):
        raise EngineError("injected detach failure")

    def spied_close():
        closed.append(True)
        real_close()

    pipeline.hook.uninstall, pipeline.close = broken_uninstall, spied_close
    with pytest.raises(EngineError, match="injected detach failure"):
        obj.close()
    assert closed == [True] and pipeline.runtime is None  # the slot tensors went after all
    assert pipeline._ctx_ptr == 0  # detach let go of the context, so close never called into the freed one
    assert (obj.attachment if driver == "llama" else obj.pipeline) is None
    obj.close()  # and again: nothing left to do, nothing raised


@pytest.mark.parametrize("driver", ["llama", "engine"])
def test_detach_lands_the_copies_and_leaves_the_context_when_an_earlier_step_raises(driver):
    """The pipeline's detach is one ExitStack too: a stride reader that fails to stop still leaves the copies
    landed and the route callback off the context before the driver frees the model."""
    obj = ggmoe.load(n_ctx=64, cache_slots=8) if driver == "llama" else _engine()
    pipeline = obj.attachment if driver == "llama" else obj.pipeline
    done: list[str] = []
    quiesce, uninstall = pipeline.runtime.quiesce, pipeline.hook.uninstall

    def broken_stride():
        raise EngineError("injected stride failure")

    pipeline._close_stride = broken_stride
    pipeline.runtime.quiesce = lambda: (done.append("quiesce"), quiesce())
    pipeline.hook.uninstall = lambda ctx: (done.append("uninstall"), uninstall(ctx))
    with pytest.raises(EngineError, match="injected stride failure"):
        pipeline.detach()
    assert done == ["quiesce", "uninstall"] and pipeline._ctx_ptr == 0
    del pipeline._close_stride
    obj.close()


def test_close_lands_the_copies_in_flight_before_the_model_goes():
    """Copies read the model's host experts: with admissions still on a slow deferred stream (50 ms a copy),
    ``close`` lands them before the model is freed. It used to free the model first, and the process crashed
    when a copy landed (the README's example under GGMOE_COPY_STREAM=deferred; a GPU's copy engine would read
    the freed memory too). A child process: a crash is its exit status, not this run's end."""
    import os
    import subprocess
    import sys

    code = ("import ggmoe; llm = ggmoe.load(cache_slots=4, n_ctx=128); "
            "llm.create_completion('Once upon a time', max_tokens=8, temperature=0); llm.close(); print('closed')")
    env = {**os.environ, "GGMOE_COPY_STREAM": "deferred", "GGMOE_COPY_DELAY_MS": "50"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("closed"), (r.returncode, r.stderr[-2000:])


@pytest.mark.parametrize("kwargs,error,match", [
    ({"path": "/nonexistent/model.gguf"}, ModelFileError, "not found"),
    ({"cache_slots": 4, "vram": "1GiB"}, UsageError, "not both"),
    ({"policy": "lfu"}, UsageError, "needs a cache size"),
    ({"cache_slots": 4, "policy": "nope"}, UsageError, "nope"),
    ({"predictor": "reuse"}, UsageError, "needs a cache size"),
    ({"vram": "lots"}, UsageError, "bad size"),
    ({"vram": 10}, UsageError, "slots per layer"),
    ({"cache_slots": 4, "miss_policy": "sometimes"}, UsageError, "unknown miss policy"),
], ids=["missing-file", "slots-and-vram", "policy-without-cache", "unknown-policy", "predictor-without-cache",
        "bad-vram", "vram-too-small", "bad-miss-policy"])
def test_load_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        ggmoe.load(**kwargs)


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelFileError):
        ggmoe.load(bad)
