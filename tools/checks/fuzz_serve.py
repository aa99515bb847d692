#!/usr/bin/env python3
"""Fuzz every route of a running ``ggmoe serve`` from the app's own OpenAPI schema (schemathesis + Hypothesis).

For each operation in ``/openapi.json``, schema-valid bodies (positive) and schema-violating ones
(negative) are sent; a response fails the run when it is a 5xx, when an error (4xx) lacks its route's shape
(OpenAI's ``{"error": {"message", "type", "param", "code"}}``; on ``/v1/messages`` Anthropic's
``{"type": "error", "error": {"type", "message"}}``), or when the server stops answering ``/health``.
Generation lengths are capped (``max_tokens`` 8, ``n_predict`` 8, ``n`` 2) so a run measures robustness,
not decoding.

Usage:
    python tools/checks/fuzz_serve.py                          # starts the embedded model on a free port, 200 cases/op
    python tools/checks/fuzz_serve.py --examples 1000 --time 1800
    python tools/checks/fuzz_serve.py --url http://127.0.0.1:8080 --api-key KEY
The serve tier runs the same function briefly (tests/serve/test_fuzz.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 2, "min_tokens": 8, "n_predict": 8}
NATIVE = ("/completion", "/infill")  # llama-server's routes: n_predict -1 (the default) runs to the context's end
ERROR_KEYS = {"message", "type", "param", "code"}
# more fields llama-server puts in some errors, which ggmoe serve gives too (its context-size error: the prompt's
# tokens and the context size)
LLAMA_SERVER_EXTRAS = {"n_prompt_tokens", "n_ctx"}


@dataclass
class Report:
    statuses: Counter = field(default_factory=Counter)  # (route, status) -> responses
    failures: list[str] = field(default_factory=list)  # what went wrong, with the request
    cases: int = 0
    seconds: float = 0.0
    record: Any = None  # an open text file: one JSON line per request (op, body, status), to replay a run

    def summary(self) -> str:
        lines = [f"{self.cases} requests in {self.seconds:.0f} s, {len(self.failures)} failures"]
        for (route, status), n in sorted(self.statuses.items()):
            lines.append(f"  {route:32s} {status}  x{n}")
        lines += [f"FAIL {f}" for f in self.failures[:20]]
        return "\n".join(lines)


def _cap(body: Any, path: str = "") -> Any:
    if isinstance(body, dict) and path in NATIVE:
        v = body.get("n_predict")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            body["n_predict"] = CAPS["n_predict"]
    if isinstance(body, dict):
        for key, cap in CAPS.items():
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > cap:
                body[key] = cap
    return body


def check(response: httpx.Response | Any, path: str = "") -> str | None:
    """What is wrong with a response (None: nothing)."""
    status = response.status_code
    if status >= 500:
        return f"{status}: {response.text[:300]}"
    if status >= 400 and path.startswith("/v1/messages"):
        try:
            body = response.json()
            err = body["error"]
        except (ValueError, KeyError, TypeError):
            return f"{status} without Anthropic's error shape: {response.text[:300]}"
        if body.get("type") != "error" or not isinstance(err, dict) or set(err) != {"type", "message"}:
            return f"{status} with a malformed Anthropic error: {response.text[:300]}"
        return None
    if status >= 400:
        try:
            err = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"{status} without OpenAI's error shape: {response.text[:300]}"
        if (not isinstance(err, dict) or not ERROR_KEYS <= set(err) <= ERROR_KEYS | LLAMA_SERVER_EXTRAS
                or not err.get("message") or not err.get("type")):
            return f"{status} with a malformed error: {response.text[:300]}"
    return None


def _fuzz_operation(op: Any, mode: Any, base_url: str, headers: dict[str, str], examples: int, stop_at: float,
                    report: Report) -> None:
    """``examples`` cases of one operation in one generation mode, recorded in ``report``."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable

    label = f"{op.method.upper()} {op.path}"

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if time.monotonic() > stop_at:
            return
        case.body = _cap(case.body, op.path)
        try:
            resp = case.call(base_url=base_url, headers=headers, timeout=120)
        except Exception as e:  # the connection itself failed: the server died or hung
            report.failures.append(f"{label}: {type(e).__name__}: {e}")
            return
        report.cases += 1
        report.statuses[(label, resp.status_code)] += 1
        if report.record is not None:
            err = resp.text[:200] if resp.status_code >= 400 else None
            report.record.write(json.dumps({"op": label, "body": case.body if isinstance(case.body, dict | list)
                                            else None, "status": resp.status_code, "error": err},
                                           default=str) + "\n")
        problem = check(resp, op.path)
        if problem is not None:
            body = json.dumps(case.body, default=str)[:300] if case.body is not None else ""
            report.failures.append(f"{label} {mode.value}: {problem}  body={body}")

    try:
        run()
    except Unsatisfiable:  # nothing to vary (a GET without parameters has no invalid form)
        pass


def fuzz(base_url: str, api_key: str | None, examples: int, time_limit_s: float, record: Any = None) -> Report:
    """Fuzz every operation of the server at ``base_url`` in both generation modes; never raises on findings."""
    import schemathesis
    from schemathesis.generation import GenerationMode

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json", headers=headers)
    report = Report(record=record)
    t0 = time.monotonic()
    for result in schema.get_all_operations():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(result.ok(), mode, base_url, headers, examples, t0 + time_limit_s, report)
    try:
        health = httpx.get(base_url + "/health", timeout=10)
        if health.status_code != 200:
            report.failures.append(f"/health answered {health.status_code} after the run")
    except httpx.HTTPError as e:
        report.failures.append(f"/health did not answer after the run: {e}")
    report.seconds = time.monotonic() - t0
    return report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start the embedded model on a free port)")
    ap.add_argument("--api-key", help="the running server's API key")
    ap.add_argument("--examples", type=int, default=200, help="cases per operation and mode")
    ap.add_argument("--time", type=float, default=900.0, help="seconds at most")
    ap.add_argument("--model", help="GGUF to serve when starting a server (default: the embedded model)")
    ap.add_argument("--record", help="write every request (op, body, status) to this JSON-lines file")
    a = ap.parse_args()
    proc = None
    url = a.url
    if url is None:
        port = _free_port()
        log = tempfile.NamedTemporaryFile("w", prefix="ggmoe-fuzz-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "ggmoe", "serve", "--port", str(port), "--n-ctx", "512"]
        proc = subprocess.Popen(cmd + ([a.model] if a.model else []), stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        print(f"server log: {log.name}")
    try:
        record = open(a.record, "w") if a.record else None  # noqa: SIM115 - closed below
        report = fuzz(url, a.api_key, a.examples, a.time, record)
        if record is not None:
            record.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    print(report.summary())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
