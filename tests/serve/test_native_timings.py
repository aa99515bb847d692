"""llama-server's ``timings_per_token`` and ``return_progress`` on a streamed ``/completion``."""

from __future__ import annotations

from test_llama_server import stream


def test_timings_per_token_puts_the_timings_so_far_in_every_chunk(server):
    with server.client() as c:
        chunks = stream(c, "/completion", {"prompt": "Once upon a time", "n_predict": 6, "temperature": 0,
                                           "timings_per_token": True})
    partial = [ch for ch in chunks if not ch["stop"]]
    assert partial and all("timings" in ch for ch in partial)
    counts = [ch["timings"]["predicted_n"] for ch in partial]
    assert counts == sorted(counts) and counts[-1] <= 6 and chunks[-1]["timings"]["predicted_n"] == 6
    assert all(ch["timings"]["prompt_n"] + ch["timings"]["cache_n"] == ch["tokens_evaluated"] for ch in partial)
    with server.client() as c:
        plain = stream(c, "/completion", {"prompt": "Once upon a time", "n_predict": 6, "temperature": 0})
    assert not any("timings" in ch for ch in plain if not ch["stop"]) and "timings" in plain[-1]


def test_return_progress_reports_the_prompt_in_the_first_chunk(server):
    with server.client() as c:
        chunks = stream(c, "/completion", {"prompt": "Once upon a time", "n_predict": 4, "return_progress": True,
                                           "cache_prompt": False})
    progress = [ch["prompt_progress"] for ch in chunks if "prompt_progress" in ch]
    assert len(progress) == 1 and "prompt_progress" in chunks[0]
    p = progress[0]
    assert p["total"] == p["processed"] == chunks[0]["tokens_evaluated"] and p["cache"] == 0 and p["time_ms"] > 0
