"""Offline text corpus for the tiny trained MoE: Python code and English prose.

Every document comes from files that a Debian machine with CPython has without
network access:

- ``code``: the CPython standard library sources (``*.py`` under
  ``sysconfig.get_paths()["stdlib"]``, site-packages excluded).
- ``prose``: English technical prose: the Python language reference that ships
  inside the stdlib (``pydoc_data/topics.py``, one document per topic), the GNU
  info manuals (``/usr/share/info``, one document per node), the English man
  pages (``/usr/share/man/man[1-8]``, roff markup stripped here in Python so the
  text does not depend on the installed groff) and the licence texts in
  ``/usr/share/common-licenses``.

The split into ``train`` / ``heldout`` is by source FILE: a stable hash of the
file's path (relative to its root) puts 1 file in 6 into ``heldout``, so no
held-out document, nor any other document cut from the same file, is ever
seen in training. Hashing paths (rather than numbering a sorted list) keeps the
split of a file unchanged when other files are added or removed.

Documents are listed in sorted path order; the functions are deterministic for
a given set of files. ``corpus_fingerprint`` hashes the listing and the texts,
so two machines can check that they see the same corpus.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib
import re
import sysconfig
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Literal, NamedTuple

Split = Literal["train", "heldout"]
Domain = Literal["code", "prose"]

SPLITS: tuple[Split, ...] = ("train", "heldout")
DOMAINS: tuple[Domain, ...] = ("code", "prose")

# 1 source file in HELDOUT_MODULUS goes to the held-out split (about 17 %):
# enough for >= 200 held-out documents per domain on a stock CPython 3.11.
HELDOUT_MODULUS = 6
# Documents shorter than this (characters) carry too little context to be useful.
MIN_CHARS = 400
# Larger stdlib files are generated tables or test data, not representative code.
MAX_CODE_BYTES = 400_000

MAN_ROOT = Path("/usr/share/man")
INFO_ROOT = Path("/usr/share/info")
LICENSE_ROOT = Path("/usr/share/common-licenses")
# Google Cloud SDK ships ~16k auto-generated near-identical gcloud pages; they
# would swamp the prose and are not on most machines.
MAN_EXCLUDE_PREFIXES = ("gcloud",)


class Document(NamedTuple):
    """One corpus document: ``source`` is the file it came from (the split key)."""

    source: str  # e.g. "stdlib/json/decoder.py", "man/man1/ls.1.gz", "info/sed.info.gz#Overview"
    text: str


def heldout_file(source_file: str) -> bool:
    """True when the file belongs to the held-out split (stable hash of its relative path)."""
    digest = hashlib.sha256(source_file.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % HELDOUT_MODULUS == 0


# --------------------------------------------------------------------------- code


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _code_documents() -> Iterator[Document]:
    root = _stdlib_root()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix()
        # site-packages holds third-party code that varies per machine; pydoc_data/topics.py
        # is the language reference as a dict of strings: it is prose, used there.
        if rel.startswith(("site-packages/", "dist-packages/")) or rel == "pydoc_data/topics.py":
            continue
        if not path.is_file() or path.stat().st_size > MAX_CODE_BYTES:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue  # deliberately mis-encoded test data
        if len(text) >= MIN_CHARS:
            yield Document(f"stdlib/{rel}", text)


# --------------------------------------------------------------------------- prose: python reference


def _pydoc_topic_documents() -> Iterator[Document]:
    try:
        topics: dict[str, str] = importlib.import_module("pydoc_data.topics").topics
    except ImportError:
        return
    # All topics come from one file, so they share one split key.
    for name in sorted(topics):
        text = topics[name].strip() + "\n"
        if len(text) >= MIN_CHARS:
            yield Document(f"stdlib/pydoc_data/topics.py#{name}", text)


# --------------------------------------------------------------------------- prose: info manuals

_INFO_NODE_HEADER = re.compile(r"^File: [^,]+,\s+Node: ([^,\n]+).*\n", re.MULTILINE)


def _info_documents() -> Iterator[Document]:
    if not INFO_ROOT.is_dir():
        return
    for path in sorted(INFO_ROOT.glob("*.info*.gz")):
        text = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
        # Info files are nodes separated by the unit separator 0x1f.
        for chunk in text.split("\x1f"):
            header = _INFO_NODE_HEADER.match(chunk.lstrip("\n"))
            if header is None:
                continue  # preamble, tag table, indirect table
            body = chunk.lstrip("\n")[header.end():].strip() + "\n"
            if len(body) >= MIN_CHARS:
                yield Document(f"info/{path.name}#{header.group(1).strip()}", body)


# --------------------------------------------------------------------------- prose: licences


def _license_documents() -> Iterator[Document]:
    if not LICENSE_ROOT.is_dir():
        return
    seen: set[Path] = set()
    for path in sorted(LICENSE_ROOT.iterdir()):
        real = path.resolve()  # GPL -> GPL-3 etc. are symlinks: keep one copy
        if real in seen or not real.is_file():
            continue
        seen.add(real)
        text = real.read_text(encoding="utf-8", errors="replace")
        if len(text) >= MIN_CHARS:
            yield Document(f"licenses/{real.name}", text)


# --------------------------------------------------------------------------- prose: man pages

# Named roff glyphs, written as ASCII where an ASCII form exists.
_ROFF_GLYPHS: dict[str, str] = {
    "em": "--", "en": "-", "hy": "-", "mi": "-", "bu": "*", "aq": "'", "dq": '"', "lq": '"',
    "rq": '"', "oq": "'", "cq": "'", "co": "(c)", "rg": "(R)", "tm": "(TM)", "ga": "`", "ti": "~",
    "ha": "^", "rs": "\\", "sl": "/", "ba": "|", "or": "|", "lh": "<=", "rh": "=>", "<=": "<=",
    ">=": ">=", "!=": "!=", "==": "==", "pl": "+", "mu": "x", "de": " degrees", "->": "->",
    "<-": "<-", "Fo": "<<", "Fc": ">>", "fo": "<", "fc": ">", "ss": "ss", "ae": "ae", "bv": "|",
}
_ROFF_ESCAPE = re.compile(
    r"\\(?:"
    r"f(?:\[[^\]]*\]|\(..|.)"          # font change
    r"|s[+-]?(?:\(\d\d|\[\d+\]|\d)"     # size change
    r"|[*n](?:\[[^\]]*\]|\(..|.)"       # string / register interpolation
    r"|[hvwlLoxbDSkXZNRM]'[^']*'"       # motions, widths, drawing, \X'..'
    r"|[mM](?:\[[^\]]*\]|\(..|.)"       # colours
    r"|\(..|\[[^\]]*\]"                 # named glyphs
    r"|[-e&|^~0 c%:udtr'`\"{}!.\\]"       # one-character escapes
    r"|."
    r")",
    re.DOTALL,
)
_ONE_CHAR_ESCAPES = {"-": "-", "e": "\\", "\\": "\\", "~": " ", "0": " ", " ": " ", "'": "'",
                     "`": "`", ".": ".", "t": "\t"}
# mdoc callable macro names that appear inside argument lists (".Op Fl v Ar file").
_MDOC_CALLABLE = re.compile(r"^(?:[A-Z][a-z]|[A-Z][a-z][a-z]|Ns|Pf|Ap)$")
# Macros whose arguments are text to keep (man and mdoc).
_TEXT_MACROS = {
    "SH", "SS", "B", "I", "SM", "SB", "BI", "BR", "IB", "IR", "RB", "RI", "IP", "TQ", "UR", "MT",
    "Sh", "Ss", "Nm", "Nd", "Fl", "Ar", "Op", "Xr", "It", "Dl", "Pa", "Ev", "Cm", "Ic", "Va",
    "Em", "Sy", "Li", "Ql", "Dq", "Sq", "Pq", "Qq", "Fn", "Fa", "Ft", "Fd", "Vt", "Dv", "Er",
    "An", "St", "Ux", "Bx", "Lk", "Mt", "Tn", "Ad", "Cd", "Aq", "Ta", "%T", "%A", "Rs", "Re",
}
_ALTERNATING = {"BI", "BR", "IB", "IR", "RB", "RI"}
_PARAGRAPH_MACROS = {"PP", "LP", "P", "TP", "sp", "Pp", "Sh", "SH", "SS", "Ss", "IP", "Bl", "El", "Bd", "Ed"}


def _roff_text(line: str) -> str:
    def repl(match: re.Match[str]) -> str:
        esc = match.group(0)[1:]
        if esc.startswith("(") and len(esc) == 3:
            return _ROFF_GLYPHS.get(esc[1:], "")
        if esc.startswith("[") and not esc.startswith("[]"):
            return _ROFF_GLYPHS.get(esc[1:-1], "")
        if len(esc) == 1:
            return _ONE_CHAR_ESCAPES.get(esc, "")
        return ""

    return _ROFF_ESCAPE.sub(repl, line)


def _split_macro_args(rest: str) -> list[str]:
    """Split a macro's arguments the way roff does: by spaces, double quotes group."""
    return [a if a else "" for a in (m.group(1) if m.group(1) is not None else m.group(2)
                                     for m in re.finditer(r'"((?:[^"]|"")*)"|(\S+)', rest))]


_MDOC_OPEN = {"Op": "[", "Oo": "[", "Pq": "(", "Po": "(", "Dq": '"', "Do": '"', "Qq": '"', "Sq": "'", "Aq": "<"}
_MDOC_CLOSE = {"Op": "]", "Oc": "]", "Pq": ")", "Pc": ")", "Dq": '"', "Dc": '"', "Qq": '"', "Sq": "'", "Aq": ">"}
_PUNCT = re.compile(r"^[.,:;)\]?!]$")


def _mdoc_text(tokens: list[str], page_name: str) -> str:
    """Render one mdoc(7) macro line: callable macros become their punctuation or are dropped."""
    words: list[str] = []
    closers: list[str] = []
    glue = False  # next word attaches to the previous one (Ns, Fl, opening brackets)
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        piece: str | None = None
        if tok == "Fl":
            piece, glue_after = "-", True
        elif tok == "Nm" and (nxt is None or _MDOC_CALLABLE.match(nxt)):
            piece, glue_after = page_name, False
        elif tok == "Xr" and nxt is not None and i + 2 < len(tokens):
            piece, glue_after = f"{nxt}({tokens[i + 2]})", False
            i += 2
        elif tok in _MDOC_OPEN and not (tok in _MDOC_CLOSE and closers and tok in ("Dq", "Qq", "Sq")):
            piece, glue_after = _MDOC_OPEN[tok], True
            if tok in _MDOC_CLOSE:
                closers.append(_MDOC_CLOSE[tok])
        elif tok in ("Oc", "Pc", "Dc"):
            if words:
                words[-1] += _MDOC_CLOSE[tok]
            i += 1
            continue
        elif tok == "Ns":
            glue = True
            i += 1
            continue
        elif _MDOC_CALLABLE.match(tok) or (i == 0):
            i += 1
            continue
        else:
            piece, glue_after = tok, False
        if piece is not None:
            if words and (glue or _PUNCT.match(piece)):
                words[-1] += piece
            else:
                words.append(piece)
            glue = glue_after
        i += 1
    text = " ".join(w for w in words if w)
    return text + "".join(reversed(closers))


def man_to_text(source: str) -> str:
    """Plain text of a man(7) or mdoc(7) page: macros dropped, text arguments kept."""
    out: list[str] = []
    skip_until: str | None = None
    page_name = ""  # mdoc: the first .Nm argument, repeated by later bare .Nm
    for raw in source.splitlines():
        if skip_until is not None:
            if raw.startswith(skip_until):
                skip_until = None
            continue
        if raw.startswith((".\\\"", "'\\\"", "\\\"", ".\\#")):
            continue  # comment
        if raw.startswith((".", "'")) and len(raw) > 1:
            parts = raw[1:].strip().split(None, 1)
            if not parts:
                continue
            name, rest = parts[0], (parts[1] if len(parts) > 1 else "")
            if name in ("de", "de1", "am", "ig"):
                skip_until = ".."  # macro definition / ignored block
                continue
            if name in _PARAGRAPH_MACROS and (not out or out[-1] != ""):
                out.append("")
            if name not in _TEXT_MACROS:
                continue
            args = _split_macro_args(rest)
            if name[0].isupper() and name[1:2].islower():
                text = _mdoc_text([name, *args], page_name)
                if name == "Nm" and args and not page_name:
                    page_name = args[0]
            elif name in _ALTERNATING:
                text = "".join(args)
            else:
                text = " ".join(args)
            text = _roff_text(text).strip()
            if text:
                out.append(text)
            continue
        out.append(_roff_text(raw).rstrip())
    text = "\n".join(out)
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def _man_documents() -> Iterator[Document]:
    if not MAN_ROOT.is_dir():
        return
    for section in range(1, 9):
        directory = MAN_ROOT / f"man{section}"
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if path.is_symlink() or not path.is_file() or path.name.startswith(MAN_EXCLUDE_PREFIXES):
                continue
            raw = path.read_bytes()
            if path.suffix == ".gz":
                raw = gzip.decompress(raw)
            source = raw.decode("utf-8", errors="replace")
            if source.lstrip().startswith(".so "):
                continue  # a redirect to another page
            text = man_to_text(source)
            if len(text) >= MIN_CHARS:
                yield Document(f"man/man{section}/{path.name}", text)


# --------------------------------------------------------------------------- listing


def _split_key(doc: Document) -> str:
    """The file a document was cut from: what the train/held-out split hashes."""
    return doc.source.split("#", 1)[0]


@cache
def _all_documents(domain: Domain) -> tuple[Document, ...]:
    if domain == "code":
        return tuple(_code_documents())
    if domain == "prose":
        sources = (_pydoc_topic_documents, _info_documents, _license_documents, _man_documents)
        return tuple(doc for source in sources for doc in source())
    raise ValueError(f"unknown domain {domain!r}; expected one of {DOMAINS}")


def list_documents(split: Split, domain: Domain, max_chars: int | None = None) -> list[Document]:
    """The documents of one split and domain, in deterministic (sorted source) order.

    ``max_chars`` cuts each document at the last line break before that many
    characters (documents are kept whole when None).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    want_heldout = split == "heldout"
    docs = [d for d in _all_documents(domain) if heldout_file(_split_key(d)) == want_heldout]
    if max_chars is not None:
        docs = [Document(d.source, _truncate(d.text, max_chars)) for d in docs]
    return docs


def documents(split: Split, domain: Domain, max_chars: int | None = None) -> list[str]:
    """Texts of ``list_documents(split, domain, max_chars)``."""
    return [d.text for d in list_documents(split, domain, max_chars)]


def _truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n", 0, max_chars)
    return text[: cut + 1 if cut > 0 else max_chars]


def corpus_fingerprint(split: Split, domain: Domain) -> str:
    """sha256 over the sources and texts of one split/domain: equal on machines with equal corpora."""
    h = hashlib.sha256()
    for doc in list_documents(split, domain):
        h.update(doc.source.encode("utf-8") + b"\0")
        h.update(hashlib.sha256(doc.text.encode("utf-8")).digest())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description="Summarise the offline corpus per split and domain.")
    parser.add_argument("--show", type=int, default=0, help="print the first N sources of each set")
    args = parser.parse_args()
    for domain in DOMAINS:
        for split in SPLITS:
            docs = list_documents(split, domain)
            chars = sum(len(d.text) for d in docs)
            print(f"{domain:5s} {split:7s} docs={len(docs):6d} chars={chars:11,d} "
                  f"sha256={corpus_fingerprint(split, domain)[:16]}")
            for d in docs[: args.show]:
                print("   ", d.source, len(d.text))


if __name__ == "__main__":
    main()
