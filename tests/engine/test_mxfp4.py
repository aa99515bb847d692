"""MXFP4 experts (gpt-oss's own type) on the CPU build: every family's logits equal stock exactly in every
decode mode and on the host path. The GPU tier (tests/gpu/test_gpu_mxfp4.py) reads them through ggml-cuda's
tables."""

from __future__ import annotations

import numpy as np
import pytest
from test_cache_engine import EXACT, run_sequences

from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.inspect import inspect_model
from tools.fixtures.make_fixtures import ARCHES, fixture_path


@pytest.mark.parametrize("arch", ARCHES)
def test_mxfp4_experts_are_exact_in_every_mode(arch, stock_logits):
    path = fixture_path(arch, expert_type="mxfp4")
    facts = inspect_model(path)
    assert {t.ggml_type for layer in facts.layers for t in layer.cached} == {"MXFP4"} and facts.experts_quantized
    ref = stock_logits(path)
    for mode, miss in (("sync", "wait"), ("sync", "cpu"), ("async", "wait")):
        cfg = EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4,
                           run=RunConfig(CacheConfig(n_slots=facts.n_expert_used),
                                         decode=DecodeConfig(mode=mode, miss_policy=miss)))
        with Engine(cfg) as eng:
            assert eng.decode_mode["decode_mode_in_effect"] == mode
            got = run_sequences(eng)
            st = eng.cache_stats.total()
        for a, b in zip(got, ref, strict=True):
            assert np.abs(a - b).max() <= EXACT, (arch, mode, miss)
        assert st.misses + st.host_reads > 0, (arch, mode, miss)
