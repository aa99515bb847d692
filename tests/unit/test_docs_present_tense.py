"""The docs describe what the code does now; how it got there lives in git, and measured figures with their
dates live in docs/benchmarks.md. This test reads every docs/*.md but benchmarks.md and fails on a phrase
that tells session, loan or round history: "this round", "the fifth session", "the H200 loan of
2026-11-26", "Issue 28 set ...", a date of a run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
HISTORY_FREE = {"benchmarks.md"}  # the one page that keeps dated measurements and the loans' story

_ORDINAL = r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth)"
HISTORY = [
    re.compile(r"\bthis round\b", re.I),
    re.compile(r"\blast (?:session|round)\b", re.I),
    re.compile(rf"\b(?:{_ORDINAL}|this|that|previous|next|other) (?:sessions?|loans?)\b", re.I),
    re.compile(rf"\b(?:{_ORDINAL}|next|last|the) (?:GPU )?loan's\b", re.I),
    re.compile(r"\b(?:H100|H200|GPU) loans?\b", re.I),
    re.compile(r"\bloan of 20\d\d\b", re.I),
    re.compile(r"\bsessions?'s? (?:start|starting|changes|jobs|test runs)\b", re.I),
    re.compile(r"\b20\d\d-\d\d-\d\d\b"),  # a run's date: the figure belongs in benchmarks.md
    # an issue number as the subject of history ("Issue 28 set ...", "issue 28's strategies"); a source
    # citation ("as quoted in issue 27") stays
    re.compile(r"(?<!quoted in )(?<!ggmoe's )\b[Ii]ssues? \d+\b(?!:)"),
]


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.glob("*.md") if p.name not in HISTORY_FREE)


def _history(text: str) -> list[str]:
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern in HISTORY:
            m = pattern.search(line)
            if m:
                found.append(f"{n}: {m.group(0)!r} in {line.strip()[:100]!r}")
    return found


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_docs_tell_no_history(page: Path):
    found = _history(page.read_text(encoding="utf-8"))
    assert not found, f"docs/{page.name} tells history (move dated figures to docs/benchmarks.md):\n" + "\n".join(found)


PACKAGE = DOCS.parent / "ggmoe"


@pytest.mark.parametrize("module", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_docstrings_tell_no_history(module: Path):
    """The package's docstrings and comments too (a cited issue of another project, on a github.com line,
    stays)."""
    text = "\n".join(line for line in module.read_text(encoding="utf-8").splitlines() if "github.com" not in line)
    found = _history(text)
    assert not found, f"{module.relative_to(PACKAGE.parent)} tells history:\n" + "\n".join(found)


@pytest.mark.parametrize("text", [
    "Four packages and ten modules (sixteen before this round's trimming).",
    "Issue 28 set the walk's goal at eight modules.",
    "the H200 loan of 2026-11-26 measured it",
    "A simulated link, fifth session: 77.8 %.",
    "the zero-copy rate the fourth loan's probe measured",
    "Measured 2026-11-25 on the development VM.",
    "as measured in the last session",
])
def test_history_is_found(text: str):
    assert _history(text)


@pytest.mark.parametrize("text", [
    "a detokenize round trip is exact, and the median over 21 rounds of the ratio",
    "github.com/ggml-org/llama.cpp/pull/29887 (as quoted in ggmoe's issue 27)",
    "the GPU harness measures the matrix on an H100; see docs/benchmarks.md",
    "a chat session keeps its history in the client",
    "the target is at most 10 points",
])
def test_present_tense_passes(text: str):
    assert not _history(text)
