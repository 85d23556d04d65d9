"""Schemathesis against `/openapi.json`: generated requests, valid and invalid, for every operation of the
real server (tiny checkpoint) must never get a 5xx. Bounded: few examples per operation, and generated
bodies are capped to a couple of tokens and choices so the engine answers in milliseconds."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
from vibeqwen.server.app import ServerConfig, create_app
from vibeqwen.server.async_engine import AsyncEngine

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode

MODEL = "tiny-fuzz"
EXAMPLES = {GenerationMode.POSITIVE: 12, GenerationMode.NEGATIVE: 8}
BUDGET_S = 4.0  # per operation, whatever the example count


@pytest.fixture(scope="module")
def app(tiny_checkpoint):
    engine = LLMEngine.from_checkpoint(tiny_checkpoint, model_name=MODEL, config=EngineConfig(
        max_model_len=128, max_num_seqs=8, cache_memory_bytes=8 << 20))
    async_engine = AsyncEngine(engine)
    yield create_app(async_engine, MODEL, ServerConfig(reasoning=True, max_body_bytes=1 << 20))
    async_engine.shutdown()


def _cap(body):
    """Keep generated requests cheap: at most 2 new tokens and 2 choices, no slow grammars."""
    if not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > 2:
            body[key] = 2
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 2
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 4:
        body["prompt"] = body["prompt"][:4]
    if isinstance(body.get("min_tokens"), int) and not isinstance(body.get("min_tokens"), bool):
        body["min_tokens"] = min(body["min_tokens"], 2)
    return body


def _fuzz(op, mode, examples: int, deadline: float, failures: list[str]) -> None:
    """Send `examples` generated requests for one operation; record 5xx replies."""

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        if time.monotonic() > deadline:
            return
        case.body = _cap(case.body)
        response = case.call()
        if response.status_code >= 500:
            failures.append(f"{op.label} [{mode.value}] {response.status_code}: {response.text[:300]}\n"
                            f"  body: {str(case.body)[:300]}")

    try:
        run()
    except Unsatisfiable:
        pass  # nothing to generate in this mode (e.g. invalid data for an operation without inputs)


@pytest.mark.slow
def test_no_server_errors(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/chat/completions", "POST /v1/completions",
                                                "GET /v1/models", "GET /health", "GET /metrics"}
    failures: list[str] = []
    for op in operations:
        for mode, examples in EXAMPLES.items():
            _fuzz(op, mode, examples, time.monotonic() + BUDGET_S / len(EXAMPLES), failures)
    assert not failures, "\n".join(failures)
