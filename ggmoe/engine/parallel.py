"""``--parallel N``: N lanes decoding together, one ``llama_decode`` per step for all of them.

Lanes (what llama-server calls slots) over one context: each lane is a sequence (``seq_id`` = lane id), holding at most its
share of ``n_ctx`` (``n_ctx // N`` tokens, enforced here as llama-server enforces ``n_ctx_slot``), in one
unified KV cache or in a stream of its own (``GgmoeLlama(kv_unified=False)``). Each request runs, as with one lane, llama-cpp-python's ``create_completion`` (stop strings,
streaming, grammars, logits processors, seeds), but on its lane's ``LaneLlama``: a view of the shared
``GgmoeLlama`` with its own tokens, sampler chain and watch, whose ``eval`` hands its tokens to the
``Batcher`` instead of calling ``llama_decode``.

The ``Batcher`` makes one micro-batch of the tokens every active lane has handed in (it waits, at most
``MAX_WAIT_S``, until each active lane has: a step is one token from each; the lane that completes the step
decodes it in its own thread, so no thread hands work to another per token), decodes it through
``GgmoeLlama.decode_sequences`` (the ggmoe pipeline around it, so the expert cache sees the union of the
lanes' experts; up to ``TABLE_MAX_TOKENS`` tokens read through the expert tables), and gives each lane a
copy of its logits row. The lane samples from that row with its own sampler chain
(``ggmoe.engine.sequences.sample_row``, what ``llama_sampler_sample`` does on the context's row).
Prompts (several tokens) are decoded in their own micro-batches, apart from the one-token steps.

What a lane cannot do (the prompt's logprobs, which need every position's logits; embeddings, which clear
the KV cache) runs on the whole model once every lane is idle (the request queue's whole-model hold), and every
lane's prompt cache is forgotten (``LanePool.forget_all``). A lane's save and restore (llama-server's slot actions) also wait for every
lane to be idle, and move one sequence's KV cells only (``LaneLlama.save_state`` / ``load_state``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llama_cpp
import numpy as np

from ggmoe.base.errors import ContextLengthError, UsageError
from ggmoe.engine.llama import GgmoeLlama
from ggmoe.engine.sequences import SeqEntry, sample_row, seq_state, set_seq_state

if TYPE_CHECKING:
    from llama_cpp import _internals

MAX_WAIT_S = 0.05  # seconds a step waits for an active lane that has not handed in its token yet
MIN_LANE_CTX = 16  # tokens: a smaller share of the context per lane is a typo
_POLL_S = 0.005  # seconds: past its wait, a lane looks this often whether it may decode the step itself


@dataclass
class _Job:
    entry: SeqEntry
    done: bool = False
    row: np.ndarray | None = None  # float32, n_vocab: the logits of the entry's last token
    error: BaseException | None = None
    event: threading.Event = field(default_factory=threading.Event)  # set when done, or to lead
    lead: list[_Job] | None = None  # the step this job's thread is to decode


@dataclass
class BatchStats:
    """What the batcher decoded since start (for /metrics)."""

    decodes: int = 0  # llama_decode calls
    tokens: int = 0  # tokens in them
    steps: int = 0  # decodes of one-token entries (generation steps)
    step_sequences: int = 0  # sequences in those steps (mean batch: step_sequences / steps)
    by_width: dict[int, int] = field(default_factory=dict)  # steps by number of sequences


class Batcher:
    """Every lane's decodes on the shared context, several sequences per ``llama_decode``.

    No thread of its own: the lane whose token completes a step (every active lane has handed one in, or
    its wait for the others passed ``max_wait_s``) decodes the step in its own thread; each waiting lane is
    woken once, by its own event, when its row is ready or when it is to decode the next step. One lane
    alone decodes with no thread handoff at all."""

    def __init__(self, llama: GgmoeLlama, max_wait_s: float = MAX_WAIT_S) -> None:
        self.llama = llama
        self.max_wait_s = max_wait_s
        self.stats = BatchStats()
        self._lock = threading.Lock()
        self._active: set[int] = set()  # lanes inside a generation (a step waits for their tokens)
        self._pending: dict[int, _Job] = {}
        self._leading = False  # a lane's thread is decoding a step
        self._closed = False
        # Held around every llama_decode and every change of the KV cache: a lane's thread removing its cells
        # (prompt reuse, a new prompt) must not race a decode of the other lanes on the same context.
        self.ctx_lock = threading.Lock()

    def join(self, seq_id: int) -> None:
        """``seq_id`` is generating: each step waits (briefly) for its token."""
        with self._lock:
            self._active.add(seq_id)

    def leave(self, seq_id: int) -> None:
        with self._lock:
            self._active.discard(seq_id)
            self._hand_over()

    def decode(self, entry: SeqEntry) -> np.ndarray:
        """Decode ``entry`` in the next step; its last token's logits (raises the decode's error)."""
        job = _Job(entry)
        jobs = self._wait_or_lead(job)
        if jobs is not None:  # this thread decodes the step, then hands the next complete one over
            try:
                for group in self._groups(jobs):
                    self._run(group)
            finally:
                with self._lock:
                    self._leading = False
                    self._hand_over()
        if job.error is not None:
            raise job.error
        return job.row  # type: ignore[return-value]

    def _ready(self) -> bool:
        return bool(self._pending) and not self._leading and self._active <= self._pending.keys()

    def _take(self) -> list[_Job]:
        jobs = list(self._pending.values())
        self._pending.clear()
        self._leading = True
        return jobs

    def _hand_over(self) -> None:
        """(Holding the lock) a complete step waits and no one decodes: wake one of its lanes to decode it."""
        if self._ready():
            job = next(iter(self._pending.values()))
            job.lead = self._take()
            job.event.set()

    def _wait_or_lead(self, job: _Job) -> list[_Job] | None:
        """Wait until ``job`` is decoded (None), or get the jobs of a step to decode in this thread."""
        deadline = time.monotonic() + self.max_wait_s
        with self._lock:
            if self._closed:
                raise UsageError("the server is shutting down")
            self._pending[job.entry.seq_id] = job
            if self._ready():
                return self._take()
        while True:
            job.event.wait(max(deadline - time.monotonic(), _POLL_S))
            with self._lock:
                if job.lead is not None:
                    jobs, job.lead = job.lead, None
                    job.event.clear()
                    return jobs
                if job.done:
                    return None
                if self._closed:
                    raise UsageError("the server is shutting down")
                if not self._leading and job.entry.seq_id in self._pending:  # waited long enough for the rest
                    return self._take()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for job in self._pending.values():
                job.event.set()

    def _groups(self, jobs: list[_Job]) -> list[list[_Job]]:
        """One-token entries together (a generation step), then prompts packed up to ``n_batch`` tokens."""
        steps = [j for j in jobs if len(j.entry.tokens) == 1]
        groups = [steps] if steps else []
        n_batch = self.llama.n_batch
        for j in sorted((j for j in jobs if len(j.entry.tokens) > 1), key=lambda j: j.entry.seq_id):
            if groups and groups[-1] is not steps and \
                    sum(len(g.entry.tokens) for g in groups[-1]) + len(j.entry.tokens) <= n_batch:
                groups[-1].append(j)
            else:
                groups.append([j])
        return groups

    def _run(self, group: list[_Job]) -> None:
        s = self.stats
        try:
            with self.ctx_lock:
                rows = self.llama.decode_sequences([j.entry for j in group])
        except BaseException as e:  # noqa: BLE001 - every lane of the decode raises it from its eval
            for j in group:
                j.error = e
        else:
            for j, row in zip(group, rows, strict=True):
                j.row = row
        s.decodes += 1
        s.tokens += sum(len(j.entry.tokens) for j in group)
        if len(group[0].entry.tokens) == 1:
            s.steps += 1
            s.step_sequences += len(group)
            s.by_width[len(group)] = s.by_width.get(len(group), 0) + 1
        with self._lock:
            for j in group:
                j.done = True
                j.event.set()


class _SeqContext:
    """The shared ``LlamaContext`` as one lane sees it: KV removals of "every sequence" (-1) act on its
    own and wait for any decode in progress (``lock``), its context is its share, it never decodes by
    itself, and the context-wide timings are left alone."""

    def __init__(self, ctx: _internals.LlamaContext, seq_id: int, n_ctx: int, lock: threading.Lock) -> None:
        self._inner = ctx
        self.seq_id = seq_id
        self._n_ctx = n_ctx
        self.lock = lock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def n_ctx(self) -> int:
        return self._n_ctx

    def kv_cache_seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        with self.lock:
            return self._inner.kv_cache_seq_rm(self.seq_id if seq_id < 0 else seq_id, p0, p1)

    def kv_cache_clear(self) -> None:
        self.kv_cache_seq_rm(self.seq_id, 0, -1)

    def reset_timings(self) -> None:
        pass  # llama.cpp's timings are the context's: not one lane's to reset while others decode

    def print_timings(self) -> None:
        pass

    def decode(self, batch: _internals.LlamaBatch) -> None:
        raise UsageError("a lane decodes through the batcher")


class LaneLlama(GgmoeLlama):
    """One lane's view of a shared ``GgmoeLlama``: its sequence, tokens, sampler and watch; decodes go
    through the ``Batcher``. Never closes the model (the server's ``GgmoeLlama`` owns it)."""

    seq_id: int
    batcher: Batcher

    @classmethod
    def of(cls, main: GgmoeLlama, seq_id: int, n_ctx: int, batcher: Batcher) -> LaneLlama:
        self = cls.__new__(cls)
        shared = {k: v for k, v in main.__dict__.items() if k not in ("_stack", "_ggmoe_seq_batch")}
        self.__dict__.update(shared)
        self.seq_id, self.batcher = seq_id, batcher
        self._ctx = _SeqContext(main._ctx, seq_id, n_ctx, batcher.ctx_lock)
        self._n_ctx = n_ctx
        self.input_ids = np.zeros(n_ctx, dtype=np.intc)
        self._row = np.zeros(main._n_vocab, dtype=np.single)
        self.scores = self._row[None, :]  # Llama._scores[-1]: the last logits (stopping criteria read it)
        self.n_tokens = 0
        self._requires_eval = True
        self._sampler = None
        self.watch = None
        return self

    def eval(self, tokens: Sequence[int]) -> None:
        self._ctx.kv_cache_seq_rm(self.seq_id, self.n_tokens, -1)
        for i in range(0, len(tokens), self.n_batch):
            chunk = tuple(int(t) for t in tokens[i:i + self.n_batch])
            n_past = self.n_tokens
            if n_past + len(chunk) > self._n_ctx:
                raise ContextLengthError(f"lane {self.seq_id}: {n_past + len(chunk)} tokens do not fit its "
                                         f"share of the context ({self._n_ctx} tokens)")
            try:
                row = self.batcher.decode(SeqEntry(self.seq_id, n_past, chunk))
            except BaseException:
                self.n_tokens = 0  # this sequence's KV entries are meaningless now
                self._requires_eval = True
                raise
            self.input_ids[n_past:n_past + len(chunk)] = chunk
            self._row = row
            self.scores = row[None, :]
            self.n_tokens += len(chunk)
            self._requires_eval = False

    def sample(self, idx: int | None = None, **kwargs: Any) -> int:
        """Llama.sample on the lane's own logits row (the last token decoded: ``idx`` is the last position)."""
        if idx is not None and idx != self.n_tokens - 1:
            raise UsageError("a lane samples only after its last decoded token")
        tmp = self._sampler is None
        if tmp:
            self._sampler = self._init_sampler(**kwargs)
        try:
            return sample_row(self._sampler.sampler, self._row)
        finally:
            if tmp:
                self._sampler = None

    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any) -> Any:
        self.batcher.join(self.seq_id)
        try:
            yield from super().generate(tokens, *args, **kwargs)
        finally:
            self.batcher.leave(self.seq_id)

    def save_state(self) -> llama_cpp.LlamaState:
        """The lane's tokens and its sequence's KV cells (``llama_state_seq_get_data``), not the whole context's."""
        with self._ctx.lock:
            data = seq_state(self._ctx.ctx, self.seq_id)
        return llama_cpp.LlamaState(input_ids=self.input_ids.copy(), scores=self._row[None, :].copy(),
                                    n_tokens=self.n_tokens, llama_state=data, llama_state_size=len(data),
                                    seed=self._seed)

    def load_state(self, state: llama_cpp.LlamaState) -> None:
        """The lane's tokens and KV cells from ``save_state``'s record (RuntimeError when llama.cpp refuses)."""
        self._ctx.kv_cache_seq_rm(self.seq_id, 0, -1)
        self.forget()
        with self._ctx.lock:
            ok = set_seq_state(self._ctx.ctx, self.seq_id, bytes(state.llama_state))
        if not ok:
            self._ctx.kv_cache_seq_rm(self.seq_id, 0, -1)
            raise RuntimeError("llama.cpp refused the sequence state")
        n = int(state.n_tokens)
        self.input_ids[:n] = state.input_ids[:n]
        self.n_tokens = n

    def forget(self) -> None:
        """Drop the lane's prompt cache (its KV cells may have been cleared by a whole-model operation)."""
        self.n_tokens = 0
        self._requires_eval = True

    def close(self) -> None:
        pass  # the shared model, context and cache are the server's GgmoeLlama's


class LanePool:
    """The N ``LaneLlama`` of a model loaded with ``n_seq_max = N`` and their batcher."""

    def __init__(self, llama: GgmoeLlama, n_lanes: int) -> None:
        if llama._is_recurrent or llama._is_hybrid:
            raise UsageError("--parallel > 1 needs a transformer model (this one is recurrent or hybrid)")
        n_seq = llama.context_params.n_seq_max
        if n_seq < n_lanes:
            raise UsageError(f"the model was loaded with n_seq_max {n_seq}: too few for {n_lanes} lanes")
        # each lane's share, as llama-server's n_ctx_slot (a stream's cells when the KV cache is split)
        self.n_ctx = min(llama.n_ctx() // n_lanes, llama.n_ctx_seq())
        if self.n_ctx < MIN_LANE_CTX:
            raise UsageError(f"--n-ctx {llama.n_ctx()} gives each of {n_lanes} lanes {self.n_ctx} tokens: give a "
                             f"context of at least {MIN_LANE_CTX} tokens per lane")
        self.llama = llama
        self.batcher = Batcher(llama)
        self.lanes = [LaneLlama.of(llama, i, self.n_ctx, self.batcher) for i in range(n_lanes)]

    def pick(self, free: Sequence[int], prompt: Sequence[int] | None, wanted: int = -1) -> int:
        """The free lane for a request: the one it names, else the one whose cached tokens share the longest
        prefix with its prompt (llama-server's lane similarity), else the first free one."""
        if wanted in free:
            return wanted
        if not prompt:
            return free[0]

        def common(i: int) -> int:
            ids = self.lanes[i]._input_ids
            n = min(len(ids), len(prompt))
            if n == 0:
                return 0
            diff = np.flatnonzero(ids[:n] != np.asarray(prompt[:n], dtype=np.intc))
            return int(diff[0]) if diff.size else n

        return max(free, key=lambda i: (common(i), -i))

    def forget_all(self) -> None:
        """After a whole-model operation: every lane's prompt cache is gone."""
        for s in self.lanes:
            s.forget()
        self.llama.reset()

    def close(self) -> None:
        self.batcher.close()
