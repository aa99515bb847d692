"""GPU tier: MXFP4 experts (gpt-oss's type) read through ggml-cuda's expert tables (skipped without a GPU).

MXFP4 is among the types MMVQ reads through a table (patch 0008's supports_op list; ``ggmoe.cache.decode_mode``'s
``CUDA_TABLE_TYPES``), so the async decode runs: cached experts from VRAM slots, misses read by the GPU from pinned
host memory. Logits match stock all-in-VRAM within float tolerance, greedy tokens are identical, the decode graph
has no more splits than stock's; the sync mode and the host path (the CPU computes a miss) agree too.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_gpu_async import _decode_all, _stock, _tg_splits

from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine.log import llama_log
from ggmoe.inspect import inspect_model
from tools.fixtures.make_fixtures import ARCHES, fixture_path

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ARCHES)
def test_mxfp4_experts_through_the_table(arch):
    path = fixture_path(arch, expert_type="mxfp4")
    facts = inspect_model(path)
    ids = list(range(3, 40))
    ref, ref_toks, stock_splits = _stock(path, ids)
    for mode, miss, n_slots in (("async", "wait", facts.n_expert_used), ("async", "wait", facts.n_expert),
                                ("sync", "wait", facts.n_expert_used), ("sync", "cpu", facts.n_expert_used)):
        mark = llama_log().count
        cfg = EngineConfig(model_path=path, n_ctx=256, n_gpu_layers=-1,
                           run=RunConfig(CacheConfig(n_slots=n_slots),
                                         decode=DecodeConfig(mode=mode, miss_policy=miss)))
        with Engine(cfg) as eng:
            assert eng.decode_mode["decode_mode_in_effect"] == mode, eng.decode_mode
            got, toks = _decode_all(eng, ids, 16)
            st = eng.cache_stats.total()
        assert toks == ref_toks, (arch, mode, miss, n_slots)
        for a, b in zip(got, ref, strict=True):
            assert np.abs(a - b).max() <= 2e-2 * max(1.0, float(np.abs(b).max())), (arch, mode, miss, n_slots)
        if mode == "async":
            assert _tg_splits(mark) <= stock_splits  # the decode graph stays on the device
            if n_slots < facts.n_expert:
                assert st.host_reads + st.fills > 0  # misses read by the GPU over the link: in place, or filled
        if miss == "cpu":
            assert st.host_computed > 0
