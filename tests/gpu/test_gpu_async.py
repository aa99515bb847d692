"""GPU tier: the async decode on a CUDA device (skipped without one, never faked).

Experts are read through the device-side expert table: cached ones from their slots in VRAM, the others
from pinned host memory by the GPU itself. Logits match stock all-in-VRAM within float tolerance (MMVQ
with a table runs the same arithmetic), greedy tokens are identical, and the decode graph has no more
splits than stock's: nothing leaves the device inside it.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine.log import llama_log
from ggmoe.inspect import inspect_model
from ggmoe.models import default_model_path
from tools.fixtures.make_fixtures import ARCHES, fixture_path

pytestmark = pytest.mark.gpu

_SPLITS = re.compile(r"graph(?: \(pp bs=\d+, tg bs=\d+\))?: nodes = [\d /]+, splits = (\d+)(?: / (\d+))?")


def _tg_splits(since: int) -> int:
    """Splits of the last reserved single-token graph, from llama.cpp's reserve log line."""
    found = [m for _, line in llama_log().since(since) if (m := _SPLITS.search(line))]
    assert found, "llama.cpp logged no graph reserve"
    m = found[-1]
    return int(m.group(2) or m.group(1))


def _decode_all(eng: Engine, ids: list[int], n: int) -> tuple[list[np.ndarray], list[int]]:
    """Greedy: the prefill's logits, then n decode steps' logits and tokens."""
    eng.reset()
    logits = [eng.decode(ids)]
    toks = []
    for _ in range(n):
        tok = int(np.argmax(logits[-1]))
        toks.append(tok)
        logits.append(eng.decode([tok]))
    return logits, toks


def _stock(path, ids: list[int]) -> tuple[list[np.ndarray], list[int], int]:
    """Stock all-in-VRAM: its greedy logits and tokens, and the splits of its single-token graph."""
    mark = llama_log().count
    with Engine(EngineConfig(model_path=path, n_ctx=256, n_gpu_layers=-1, experts_on_host=False,
                             gate_hook=False)) as stock:
        ref, ref_toks = _decode_all(stock, ids, 16)
        stock.decode([ref_toks[-1]])
    return ref, ref_toks, _tg_splits(mark)


@pytest.mark.parametrize("fills", [True, False])  # the graph fills misses (patch 0012), or reads them in place
@pytest.mark.parametrize("model", ["tiny-moe", *ARCHES])
def test_async_matches_all_in_vram(model, fills):
    # quantized experts: ggml-cuda reads expert tables in MMVQ, its quantized matvec
    path = default_model_path() if model == "tiny-moe" else fixture_path(model, expert_type="q8_0")
    facts = inspect_model(path)
    ids = list(range(3, 40))
    ref, ref_toks, stock_splits = _stock(path, ids)
    for n_slots in sorted({facts.n_expert_used, facts.n_expert // 2, facts.n_expert}):
        mark = llama_log().count
        # with a slot for every expert: identity (patch 0017, stock's matmuls on the slots) with fills, the
        # tables without (both ways of reading a full cache, in the same two runs)
        cfg = EngineConfig(model_path=path, n_ctx=256, n_gpu_layers=-1,
                           run=RunConfig(CacheConfig(n_slots=n_slots),
                                         decode=DecodeConfig(mode="async", fills=fills, identity=fills)))
        with Engine(cfg) as eng:
            assert eng.decode_mode["decode_mode_in_effect"] == "async"
            full = n_slots >= facts.n_expert and fills
            assert eng.pipeline.tables.identity == (set(facts.moe_layers) if full else set()), (model, n_slots)
            assert eng.decode_mode["copy_stream"] == "events"  # readiness by event query, never a synchronize
            got, toks = _decode_all(eng, ids, 16)
            st = eng.cache_stats.total()
        assert toks == ref_toks, n_slots
        for a, b in zip(got, ref, strict=True):
            assert np.abs(a - b).max() <= 2e-2 * max(1.0, float(np.abs(b).max())), n_slots
        # the decode graph stays on the device: expert biases (gpt-oss) stay there too, so no more splits
        assert _tg_splits(mark) == stock_splits, (model, n_slots)
        assert st.hits > 0, (model, n_slots)
        if n_slots < facts.n_expert and fills:
            # the graph copied misses into its fill slots and read them there (one crossing): no admission
            assert st.fills > 0 and st.admission_copies == 0, (model, n_slots)
        elif n_slots < facts.n_expert:
            # admissions land, seen through their events; misses were read by the GPU from pinned host
            # memory. A slot for every expert is preloaded when the cache is built: nothing is left to land
            assert st.landed > 0 and st.host_reads > 0, (model, n_slots)


@pytest.mark.parametrize("model", ["tiny-moe", "qwen3moe"])
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_split_experts_match_all_in_vram(model, mode):
    """MoEpic's split on the GPU: tops in VRAM slots, bottoms read by MMVQ from pinned host memory (patch
    0007), every layer and every other layer split; greedy tokens equal stock all-in-VRAM's, logits within
    float tolerance, the async decode graph no more split than stock's."""
    path = default_model_path() if model == "tiny-moe" else fixture_path(model, expert_type="q8_0")
    facts = inspect_model(path)
    ids = list(range(3, 40))
    ref, ref_toks, stock_splits = _stock(path, ids)
    for theta in (dict.fromkeys(facts.moe_layers, 0.5),
                  {il: 0.5 for j, il in enumerate(facts.moe_layers) if j % 2 == 0}):
        mark = llama_log().count
        cfg = EngineConfig(model_path=path, n_ctx=256, n_gpu_layers=-1,
                           run=RunConfig(CacheConfig(n_slots=facts.n_expert_used + 2, layer_theta=theta),
                                         decode=DecodeConfig(mode=mode)))
        with Engine(cfg) as eng:
            assert eng.decode_mode["decode_mode_in_effect"] == mode
            got, toks = _decode_all(eng, ids, 16)
            st = eng.cache_stats.total()
        assert toks == ref_toks
        for a, b in zip(got, ref, strict=True):
            assert np.abs(a - b).max() <= 2e-2 * max(1.0, float(np.abs(b).max()))
        assert st.top_hits > 0 and st.bottom_read_bytes > 0
        if mode == "async":
            assert _tg_splits(mark) <= stock_splits
