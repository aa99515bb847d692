#!/usr/bin/env python3
"""Routing report of a model's traces, written into docs/tiny-model.md (between markers).

Reads the trace corpus (``tools/routing/trace_corpus.py``: DIR/{code,prose}-{mode}/trace.npz)
and measures, per domain and trace mode:
- expert load per layer: share of routed assignments per expert, its normalised
  entropy (1 = perfectly balanced) and max/mean ratio;
- temporal reuse: share of a decode token's experts the previous token also used
  (same layer);
- adjacent-layer similarity: cosine of the MoE inputs of layers l and l+1 (same token);
- request-level activation: per prompt's decode phase, share of a layer's experts
  used at least once;
- LRU hit rate against cached experts per layer (``ggmoe.simulate.replay``);
and draws two figures (LRU hit-rate curves; per-layer expert load).

    python tools/routing/routing_report.py [--corpus DIR ...] [--doc docs/tiny-model.md]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ggmoe.simulate import replay
from ggmoe.trace import STAGE_DECODE, Trace, load_trace

START, END = "<!-- routing-report:start -->", "<!-- routing-report:end -->"
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Routing:
    name: str  # "code/teacher"
    n_prompts: int
    n_tokens: int
    load: np.ndarray  # [L, E] share of assignments per expert
    entropy: np.ndarray  # [L] normalised entropy of the load
    reuse: np.ndarray  # [L] mean |S_t ∩ S_t-1| / k over decode tokens
    cosine: np.ndarray | None  # [L-1] mean cos(h_l, h_l+1)
    request_active: np.ndarray  # [L] mean share of experts used at least once per prompt's decode
    lru: dict[int, float]  # slots per layer -> hit rate


def expert_load(tr: Trace) -> tuple[np.ndarray, np.ndarray]:
    n_l, e = tr.ids.shape[1], tr.meta.n_expert
    load = np.zeros((n_l, e))
    for j in range(n_l):
        load[j] = np.bincount(tr.ids[:, j].ravel(), minlength=e)
    load /= load.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.nansum(np.where(load > 0, load * np.log(load), 0.0), axis=1) / np.log(e)
    return load, ent


def decode_rows(tr: Trace) -> list[np.ndarray]:
    """Per prompt, the row indices of its decode steps (plus the last prefill row before them)."""
    out = []
    for p in range(tr.n_prompts):
        sl = tr.prompt_slice(p)
        rows = np.arange(sl.start, sl.stop)
        dec = rows[tr.stage[sl] == STAGE_DECODE]
        if dec.size:
            out.append(np.r_[dec[0] - 1, dec])
    return out


def temporal_reuse(tr: Trace) -> np.ndarray:
    k = tr.meta.n_expert_used
    acc = np.zeros(tr.ids.shape[1])
    n = 0
    for rows in decode_rows(tr):
        ids = tr.ids[rows]  # [T, L, k]
        for t in range(1, len(rows)):
            for j in range(ids.shape[1]):
                acc[j] += len(set(ids[t, j].tolist()) & set(ids[t - 1, j].tolist())) / k
            n += 1
    return acc / max(n, 1)


def adjacent_cosine(tr: Trace) -> np.ndarray | None:
    if tr.hidden is None or tr.hidden.shape[1] < 2:
        return None
    h = tr.hidden.astype(np.float32)
    h /= np.linalg.norm(h, axis=2, keepdims=True) + 1e-12
    return np.mean(np.sum(h[:, 1:] * h[:, :-1], axis=2), axis=0)


def request_activation(tr: Trace) -> np.ndarray:
    e = tr.meta.n_expert
    shares = [np.array([np.unique(tr.ids[rows[1:], j]).size / e for j in range(tr.ids.shape[1])])
              for rows in decode_rows(tr)]
    return np.mean(shares, axis=0)


def analyse(name: str, tr: Trace, slot_counts: list[int]) -> Routing:
    load, ent = expert_load(tr)
    lru = {s: replay(tr, s, "lru").total().hit_rate for s in slot_counts}
    return Routing(name=name, n_prompts=tr.n_prompts, n_tokens=tr.n_tokens, load=load, entropy=ent,
                   reuse=temporal_reuse(tr), cosine=adjacent_cosine(tr), request_active=request_activation(tr),
                   lru=lru)


def figures(results: list[Routing], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        xs = sorted(r.lru)
        ax.plot(xs, [100 * r.lru[x] for x in xs], marker="o", label=r.name)
    ax.set_xlabel("cached experts per layer (slots)")
    ax.set_ylabel("LRU hit rate (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "tiny-moe-lru.png", dpi=110)
    plt.close(fig)
    main = next(r for r in results if r.name.endswith("teacher"))
    fig, ax = plt.subplots(figsize=(7, 3.2))
    im = ax.imshow(100 * main.load, aspect="auto", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_title(f"share of routed assignments (%), {main.name}")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out_dir / "tiny-moe-load.png", dpi=110)
    plt.close(fig)
    return ["img/tiny-moe-lru.png", "img/tiny-moe-load.png"]


def markdown(results: list[Routing], meta, imgs: list[str], corpus: Path) -> str:
    k, e = meta.n_expert_used, meta.n_expert
    slots = sorted(results[0].lru)
    lines = [START, "## Routing report", "",
             f"Model `{meta.model_name}` (fingerprint `{meta.model_fingerprint}`): {e} experts per layer, "
             f"top-{k}. Traces: `python tools/routing/trace_corpus.py --docs 200` (teacher-forced) and "
             "`python tools/routing/trace_corpus.py --docs 100 --modes greedy sample --no-hidden --out ~/.cache/ggmoe/corpus/cmp`"
             " (held-out documents, never trained on; 64-token prefill, 64 decode steps), report: "
             "`python tools/routing/routing_report.py`. Teacher-forced traces feed each document's real continuation; "
             "greedy and sampled ones let the model continue the same prefills.", "",
             "| trace | prompts | tokens | load entropy (mean) | max/mean load | reuse t-1 | adjacent-layer cosine "
             "| experts active per request | " + " | ".join(f"LRU {s}/{e}" for s in slots) + " |",
             "|---" * (8 + len(slots)) + "|"]
    for r in results:
        cos = f"{np.mean(r.cosine):.3f}" if r.cosine is not None else "n/a"
        lines.append(
            f"| {r.name} | {r.n_prompts} | {r.n_tokens} | {np.mean(r.entropy):.3f} | "
            f"{np.mean(r.load.max(axis=1) * e):.2f} | {100 * np.mean(r.reuse):.1f}% | {cos} | "
            f"{100 * np.mean(r.request_active):.1f}% | "
            + " | ".join(f"{100 * r.lru[s]:.1f}%" for s in slots) + " |")
    main = next(r for r in results if r.name.endswith("teacher"))
    lines += ["", f"Per layer ({main.name}):", "",
              "| layer | load entropy | max/mean load | reuse t-1 | cosine to next layer | active per request |",
              "|---|---|---|---|---|---|"]
    for j in range(main.load.shape[0]):
        cos = f"{main.cosine[j]:.3f}" if main.cosine is not None and j < len(main.cosine) else "-"
        lines.append(f"| {j} | {main.entropy[j]:.3f} | {main.load[j].max() * e:.2f} | "
                     f"{100 * main.reuse[j]:.1f}% | {cos} | {100 * main.request_active[j]:.1f}% |")
    lines += ["", *[f"![{Path(i).stem}]({i})" for i in imgs], "", END]
    return "\n".join(lines)


def write_section(doc: Path, section: str) -> None:
    text = doc.read_text() if doc.exists() else "# The tiny MoE\n"
    if START in text and END in text:
        a, b = text.index(START), text.index(END) + len(END)
        text = text[:a] + section + text[b:]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    doc.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Path(os.environ.get("GGMOE_CACHE", Path.home() / ".cache" / "ggmoe")) / "corpus"
    ap.add_argument("--corpus", type=Path, nargs="+", default=[default, default / "cmp"],
                    help="directories holding {code,prose}-{mode}/trace.npz (first match wins)")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "tiny-model.md")
    ap.add_argument("--print", action="store_true", help="print the section instead of writing it")
    a = ap.parse_args()
    results, meta = [], None
    for domain in ("code", "prose"):
        for mode in ("teacher", "greedy", "sample"):
            paths = [d / f"{domain}-{mode}" / "trace.npz" for d in a.corpus]
            path = next((p for p in paths if p.exists()), None)
            if path is None:
                continue
            tr = load_trace(path)
            meta = tr.meta
            e, k = tr.meta.n_expert, tr.meta.n_expert_used
            slot_counts = sorted({k, 2 * k, e // 4, e // 2, 3 * e // 4, e} - {0})
            results.append(analyse(f"{domain}/{mode}", tr, [s for s in slot_counts if k <= s <= e]))
            print(f"analysed {domain}/{mode}", file=sys.stderr)
    if not results or not any(r.name.endswith("teacher") for r in results):
        print(f"error: no teacher-forced traces under {', '.join(map(str, a.corpus))}; run tools/routing/trace_corpus.py",
              file=sys.stderr)
        return 2
    imgs = figures(results, a.doc.parent / "img")
    section = markdown(results, meta, imgs, a.corpus)
    if a.print:
        print(section)
    else:
        write_section(a.doc, section)
        print(f"wrote the routing report into {a.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
