"""Every route driven from the app's own OpenAPI schema (schemathesis): valid and invalid bodies never give a
500, every error has OpenAI's shape, the server stays healthy. A short run; tools/checks/fuzz_serve.py is the long one."""

from __future__ import annotations

import json

import pytest
from server_process import API_KEY

from tools.checks.fuzz_serve import check, fuzz

EXAMPLES = 15  # per operation and generation mode
TIME_LIMIT_S = 120.0
# llama-server's native routes, Anthropic's and OpenAI's Responses: the run must reach each of them
NEW_ROUTES = {"POST /completion", "POST /infill", "POST /embedding", "POST /apply-template", "GET /props",
              "GET /slots", "POST /slots/{id_slot}", "POST /v1/messages", "POST /v1/messages/count_tokens",
              "POST /v1/responses"}


def test_fuzzing_every_route_finds_no_500_and_no_malformed_error(server):
    report = fuzz(server.url, API_KEY, EXAMPLES, TIME_LIMIT_S)
    assert report.cases > 100, report.summary()
    assert any(status >= 400 for _, status in report.statuses), report.summary()  # invalid bodies were sent
    assert any(status == 200 for _, status in report.statuses), report.summary()
    assert not report.failures, report.summary()
    assert NEW_ROUTES <= {route for route, _ in report.statuses}, report.summary()


class _Response:
    """What ``check`` reads of an HTTP response."""

    def __init__(self, status_code: int, body: object) -> None:
        self.status_code, self._body = status_code, body
        self.text = json.dumps(body)

    def json(self) -> object:
        return self._body


_CTX = {"message": "the request (976 tokens) exceeds the available context size (512 tokens)",
        "type": "exceed_context_size_error", "param": "messages", "code": "context_length_exceeded"}


@pytest.mark.parametrize(("status", "body", "path", "bad"), [
    (400, {"error": {**_CTX, "n_prompt_tokens": 976, "n_ctx": 512}}, "/v1/chat/completions", False),  # llama-server's
    (400, {"error": _CTX}, "/v1/chat/completions", False),
    (400, {"error": {**_CTX, "stack": "..."}}, "/v1/chat/completions", True),  # a field nobody sends
    (400, {"error": {"message": "m", "type": "t"}}, "/v1/chat/completions", True),  # OpenAI's keys missing
    (400, {"detail": "m"}, "/v1/chat/completions", True),
    (500, {"error": _CTX}, "/v1/chat/completions", True),
    (400, {"type": "error", "error": {"type": "invalid_request_error", "message": "m"}}, "/v1/messages", False),
    (400, {"type": "error", "error": {"type": "t", "message": "m", "n_ctx": 1}}, "/v1/messages", True),
    (200, {"choices": []}, "/v1/chat/completions", False),
])
def test_the_fuzzers_error_shapes(status, body, path, bad):
    """An OpenAI error may carry llama-server's extra fields (the context-size error's token counts), nothing else."""
    assert (check(_Response(status, body), path) is not None) == bad
