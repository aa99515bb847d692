"""Traces: the versioned ``.npz`` format, merging and the split by prompt.

Prompts files are ``ggmoe.trace.prompts``; the recorder, which needs the engine, is ``ggmoe.engine.record``.
"""

from ggmoe.trace.data import (
    load_counts,
    load_traces,
    merge_traces,
    select_prompts,
    split_prompts,
    trace_counts,
)
from ggmoe.trace.format import (
    FORMAT,
    STAGE_DECODE,
    STAGE_PREFILL,
    VERSION,
    Trace,
    TraceMeta,
    TraceWriter,
    load_trace,
)

__all__ = ["FORMAT", "STAGE_DECODE", "STAGE_PREFILL", "VERSION", "Trace", "TraceMeta", "TraceWriter",
           "load_counts", "load_trace", "load_traces", "merge_traces", "select_prompts", "split_prompts",
           "trace_counts"]
