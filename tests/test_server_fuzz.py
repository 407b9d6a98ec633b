"""`selfspec serve` fuzzed from its own OpenAPI schema: schemathesis reads the live server's
/openapi.json and sends requests it generates, schema-valid and not, through the key. No request
may get a 5xx or an undocumented status, every answer must match the schema (error bodies
included), schema-valid requests must be served and invalid ones refused; afterwards no slot
is held and a plain request still answers."""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from live_server import ENV, MODEL, openai_client, read_metrics, serving
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import positive_data_acceptance

pytestmark = pytest.mark.slow
KEY = "sk-fuzz-4d1a"
EXAMPLES = 600  # per operation; the POST routes alone make 1200 requests
SENT: Counter = Counter()

# The limits keep each request cheap: 8 tokens, a 4 KiB body (a prompt well inside the context
# window). Schema-valid requests must be served, unless the body is over the limit (413) or the
# prompt holds only characters the tokenizer drops, which no schema can state.
CONFIG = {
    "checks": {
        "negative_data_rejection": {"expected-statuses": ["400", "401", "404", "413"]},
    },
    "headers": {"Authorization": f"Bearer {KEY}"},
}


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    options = ("--max-tokens-cap", "8", "--max-body-kb", "4")
    yield from serving(tmp_path_factory, *options, env=dict(ENV, SELFSPEC_API_KEY=KEY))


@pytest.fixture(scope="module")
def live_schema(fuzzed):
    config = SchemathesisConfig.from_dict(CONFIG)
    return schemathesis.openapi.from_url(fuzzed["base"] + "/openapi.json", config=config)


POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
CASES = [  # the GET routes take no input, so nothing there can be invalid
    ("POST", "/v1/chat/completions", POSITIVE),
    ("POST", "/v1/chat/completions", NEGATIVE),
    ("POST", "/v1/completions", POSITIVE),
    ("POST", "/v1/completions", NEGATIVE),
    ("GET", "/v1/models", POSITIVE),
    ("GET", "/health", POSITIVE),
    ("GET", "/metrics", POSITIVE),
]


@pytest.mark.parametrize("method,path,mode", CASES, ids=lambda v: getattr(v, "value", v))
def test_no_generated_request_breaks_the_server(live_schema, method, path, mode):
    """Each operation's requests, valid by the schema or not, drawn by hypothesis from the
    schema (schemathesis's pytest plugin is not used: it reads a private pytest attribute)."""
    operation = live_schema[path][method]

    @settings(
        max_examples=EXAMPLES // 2,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,  # the same requests every run: a failure here reproduces
        database=None,
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def send(case):
        SENT[case.operation.label] += 1
        response = case.call(headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        case.validate_response(response, excluded_checks=[positive_data_acceptance])
        if mode == POSITIVE:
            assert _served_or_refused_for_cause(response), (
                response.status_code,
                response.text,
                case.body,
            )

    before = SENT[operation.label]
    send()
    if method == "POST":  # hypothesis ran its examples (the GET routes take no input: one)
        assert SENT[operation.label] - before >= EXAMPLES // 2 * 0.8, SENT


def _served_or_refused_for_cause(response) -> bool:
    if response.status_code < 300 or response.status_code == 413:
        return True
    return response.status_code == 400 and "the prompt is empty" in response.text


def test_after_the_fuzzing_the_server_is_whole(fuzzed):
    print(dict(SENT))
    assert sum(SENT.values()) >= 1000, SENT
    assert fuzzed["process"].poll() is None
    metrics = read_metrics(fuzzed)
    assert metrics["requests_running"] == 0 and metrics["queue_depth"] == 0
    reply = openai_client(fuzzed, api_key=KEY).completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0
    )
    assert reply.usage.completion_tokens == 4
