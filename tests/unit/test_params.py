"""Declared options (ggmoe.base.params), byte sizes, the prompt rule (ggmoe.base.context), bounded cache slots and
plan-file options: table-driven, no llama.cpp."""

from __future__ import annotations

import inspect

import pytest

from ggmoe.base.context import check_prompt, decode_batch
from ggmoe.base.errors import ContextLengthError, UsageError
from ggmoe.base.params import MAX_COLLECTION, Param, check_params, check_state_bytes, parse_pairs
from ggmoe.base.units import MAX_BYTES, parse_bytes
from ggmoe.cache.config import CacheConfig
from ggmoe.cache.policies import POLICIES, make_policy
from ggmoe.control.plan_file import read_plan, render_plan
from ggmoe.predict import PREDICTORS, ModelShape, make_predictor
from ggmoe.predict.evaluate import check_options

pytestmark = pytest.mark.unit


def _keywords(cls: type, skip: int) -> set[str]:
    """__init__'s parameters after self and the ``skip`` positional ones every family takes."""
    return set(list(inspect.signature(cls.__init__).parameters)[1 + skip:])


# ggmoe's own policies (other test modules register stress policies named "test-..." for their own use)
@pytest.mark.parametrize("name", [n for n in POLICIES.names() if not n.startswith("test-")])
def test_every_policy_declares_exactly_its_options(name):
    cls = POLICIES.get(name)
    assert {p.name for p in cls.PARAMS} == _keywords(cls, 2)


@pytest.mark.parametrize("name", PREDICTORS.names())
def test_every_predictor_declares_exactly_its_options(name):
    cls = PREDICTORS.get(name)
    assert {p.name for p in cls.PARAMS} == _keywords(cls, 2)


P = (Param("capacity", int, low=1, high=MAX_COLLECTION), Param("decay", float, low=0.0, high=1.0, high_open=True),
     Param("online", bool), Param("model", str), Param("counts", dict, internal=True))

# (given, from_text, expected dict or the error's words)
CASES = [
    ({"capacity": "12"}, True, {"capacity": 12}),
    ({"capacity": "abc"}, True, "not an integer"),
    ({"capacity": "2.5"}, True, "not an integer"),
    ({"capacity": "1e12"}, True, "not an integer"),
    ({"capacity": str(10**12)}, True, "out of bounds"),
    ({"capacity": "0"}, True, "out of bounds"),
    ({"capacity": 10**12}, False, "out of bounds"),
    ({"capacity": 2.0}, False, "must be an int"),
    ({"capacity": True}, False, "must be an int"),
    ({"decay": "abc"}, True, "not a number"),
    ({"decay": "nan"}, True, "not a finite number"),
    ({"decay": "inf"}, True, "not a finite number"),
    ({"decay": "1"}, True, "out of bounds"),
    ({"decay": "0"}, True, {"decay": 0.0}),
    ({"decay": 1}, False, "out of bounds"),
    ({"decay": "0.25"}, True, {"decay": 0.25}),
    ({"online": "maybe"}, True, "not true or false"),
    ({"online": "false"}, True, {"online": False}),
    ({"online": 1}, False, "must be a bool"),
    ({"model": ""}, True, "is empty"),
    ({"nope": "1"}, True, "unknown option 'nope'"),
    ({"counts": "x"}, True, "unknown option 'counts'"),  # internal: never from text
    ({"counts": {0: [1]}}, False, {"counts": {0: [1]}}),
]


@pytest.mark.parametrize("given,from_text,expected", CASES, ids=lambda v: repr(v)[:40])
def test_check_params(given, from_text, expected):
    if isinstance(expected, dict):
        assert check_params("x", P, given, from_text=from_text) == expected
    else:
        with pytest.raises(UsageError, match=expected):
            check_params("x", P, given, from_text=from_text)


@pytest.mark.parametrize("pairs,error", [(("capacity",), "expected KEY=VALUE"), (("=3",), "expected KEY=VALUE"),
                                         (("a=1", "a=2"), "given twice")])
def test_parse_pairs_refuses(pairs, error):
    with pytest.raises(UsageError, match=error):
        parse_pairs(pairs)


SHAPE = ModelShape(model_fingerprint="0" * 16, layers=(0, 1, 2), n_expert=8, n_expert_used=2, n_embd=4)


@pytest.mark.parametrize("opts,error", [
    ({"capacity": "1e12"}, "not an integer"),
    ({"capacity": str(10**12)}, "out of bounds"),
    ({"decay": "abc"}, "not a number"),
    ({"window": "4"}, "not accepted by eam, reuse"),
])
def test_eval_predictor_options_fail_before_any_predictor_is_built(opts, error):
    with pytest.raises(UsageError, match=error):
        check_options(["eam", "reuse"], opts)


def test_an_option_is_checked_against_every_predictor_that_takes_it():
    assert check_options(["eam", "expert-map"], {"capacity": "64"}) == {"capacity": 64}
    assert make_predictor("reuse", SHAPE, 1, decay=0.25).decay == 0.25
    with pytest.raises(UsageError, match="out of bounds"):
        make_predictor("eam", SHAPE, 1, capacity=10**12)
    with pytest.raises(UsageError, match="unknown option"):
        make_policy("lru", 8, [0, 1], {"window": 3})
    with pytest.raises(UsageError, match="out of bounds"):
        CacheConfig(n_slots=4, policy="lcp", policy_options={"rho": 2.0})


def test_state_arrays_are_bounded_before_they_are_allocated():
    with pytest.raises(UsageError, match="GiB"):
        check_state_bytes("eam", 5 << 30, "lower its capacity")
    big = ModelShape(model_fingerprint="0" * 16, layers=tuple(range(64)), n_expert=512, n_expert_used=8, n_embd=8)
    with pytest.raises(UsageError, match="lower its capacity"):
        make_predictor("eam", big, 1, capacity=MAX_COLLECTION)


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 << 30), ("1.5GB", 1_500_000_000), ("123", 123), ("0", 0), ("1e36", "bad size"),
    ("1" + "0" * 36, "larger than 1 EiB"), ("1" + "0" * 400, "larger than 1 EiB"), ("9" * 400 + ".5GiB", "larger"),
    (str(MAX_BYTES + 1), "larger"), ("abc", "bad size"), ("1e99999", "bad size"), ("-5", "bad size"),
    ("nan", "bad size"), ("inf", "bad size"),
])
def test_parse_bytes(text, expected):
    if isinstance(expected, int):
        assert parse_bytes(text) == expected
    else:
        with pytest.raises(UsageError, match=expected):
            parse_bytes(text)


@pytest.mark.parametrize("n_ctx,n_batch,expected", [(8, 512, 8), (None, 512, 512), (4096, 512, 512), (512, 64, 64)])
def test_decode_batch_is_what_llama_cpp_takes(n_ctx, n_batch, expected):
    assert decode_batch(n_ctx, n_batch) == expected


@pytest.mark.parametrize("n_tokens,n_ctx,room,error", [
    (0, 8, 1, UsageError), (8, 8, 1, ContextLengthError), (9, 8, 0, ContextLengthError), (7, 8, 1, None),
    (8, 8, 0, None),
])
def test_check_prompt(n_tokens, n_ctx, room, error):
    if error is None:
        check_prompt(n_tokens, n_ctx, room=room)
    else:
        with pytest.raises(error):
            check_prompt(n_tokens, n_ctx, room=room)


def test_a_context_error_is_also_a_value_error_as_llama_cpp_raises():
    with pytest.raises(ValueError):
        check_prompt(100, 8)


@pytest.mark.parametrize("cfg,error", [
    (CacheConfig(n_slots=1), "from n_expert_used"),
    (CacheConfig(n_slots=9), "from n_expert_used"),
    (CacheConfig(layer_slots={0: 4, 1: 10**12}), "from n_expert_used"),
    (CacheConfig(layer_slots={0: 4, 1: 2.5}), "from n_expert_used"),
])
def test_cache_slots_are_bounded_before_any_slot_is_allocated(cfg, error):
    with pytest.raises(UsageError, match=error):
        cfg.slots({0: 10, 1: 10}, 8, 2)


def _plan(tmp_path, body: str):
    p = tmp_path / "plan.toml"
    p.write_text('[cache]\npolicy = "fmoe"\n[cache.slots]\n"0" = 4\n' + body)
    return p


@pytest.mark.parametrize("body,error", [
    ("[cache.policy_options]\nwindow = 0\n", "out of bounds"),
    ("[cache.policy_options]\nwindow = 1e12\n", "must be an int"),
    ("[cache.policy_options]\nwindow = 1000000000000\n", "out of bounds"),
    ("[cache.policy_options]\nnope = 1\n", "unknown option"),
    ('[cache.policy_options]\nwindow = "8"\n', "must be an int"),
    ("[prefetch]\npredictor = \"reuse\"\nstride = 100000\n", "stride"),
    ("[prefetch]\npredictor = \"reuse\"\nn_prefetch = 100000000\n", "n_prefetch"),
    ("[prefetch]\npredictor = \"\"\n", "predictor is empty"),
])
def test_plan_file_options_are_declared_and_bounded(tmp_path, body, error):
    with pytest.raises(UsageError, match=error):
        read_plan(_plan(tmp_path, body))


def test_plan_file_policy_options_round_trip(tmp_path):
    cfg = read_plan(_plan(tmp_path, "[cache.policy_options]\nwindow = 16\n"))
    assert cfg.cache.policy_options == {"window": 16}
    again = tmp_path / "again.toml"
    again.write_text(render_plan(cfg, {}))
    assert read_plan(again).cache.policy_options == {"window": 16}


def test_huge_plan_slots_are_refused_when_read(tmp_path):
    p = tmp_path / "plan.toml"
    p.write_text('[cache]\npolicy = "lru"\n[cache.slots]\n"0" = 1000000000000\n')
    with pytest.raises(UsageError, match="at most 65536"):
        read_plan(p)


@pytest.mark.parametrize("n_ctx,expected", [(0, 0), (1, 256), (8, 256), (256, 256), (257, 512), (1 << 24, 1 << 24),
                                            (-1, "from 1 to"), ((1 << 24) + 1, "from 1 to"), (10**12, "from 1 to"),
                                            (2.5, "from 1 to"), (True, "from 1 to")])
def test_context_tokens_is_llama_cpp_s_padded_context_and_bounded(n_ctx, expected):
    from ggmoe.base.context import context_tokens

    if isinstance(expected, int):
        assert context_tokens(n_ctx) == expected
    else:
        with pytest.raises(UsageError, match=expected):
            context_tokens(n_ctx)
