"""Every route driven from the app's own OpenAPI schema (schemathesis): valid and invalid bodies never give a
500, every error has OpenAI's shape, the server stays healthy. A short run; tools/checks/fuzz_serve.py is the long one."""

from __future__ import annotations

from server_process import API_KEY

from tools.checks.fuzz_serve import fuzz

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
