"""Continuous batching through HTTP with the real engine on the tiny checkpoint: a live uvicorn server in a
thread, driven by the `openai` SDK. Batched replies must equal the replies each request gets alone
(greedy and seeded sampling, with chunked prefill and with preemption), aborts must give the cache back,
and limits must answer 400 / 503 without losing or duplicating accepted requests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import torch

from openai_scripted import live_server, wait_for
from vibeqwen.config import ModelConfig
from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
from vibeqwen.model.cache import gdn_bytes_per_slot, kv_bytes_per_block
from vibeqwen.server.app import create_app
from vibeqwen.server.async_engine import AsyncEngine

MODEL = "tiny"
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
WORDS = ["alpha", "beta", "gamma", "delta", "一二三", "🚀", "epsilon", "zeta", "eta", "theta"]
MAX_TOKENS = [1, 2, 3, 5, 8, 13, 21, 40]


@dataclass(frozen=True)
class Req:
    """One chat request: the i-th prompt (15 to 57 prompt tokens as i varies) and its sampling fields."""

    i: int
    max_tokens: int
    temperature: float = 0.0
    top_p: float | None = None
    seed: int | None = None

    def kwargs(self) -> dict[str, Any]:
        words = " ".join(WORDS[(self.i + k) % len(WORDS)] for k in range(3 * self.i % 29))
        kw: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Request {self.i}: {words}"}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.top_p is not None:
            kw["top_p"] = self.top_p
        if self.seed is not None:
            kw["seed"] = self.seed
        return kw


# 32 greedy requests with different prompts, prompt lengths and max_tokens, and one seeded sampled one.
GREEDY = [Req(i, MAX_TOKENS[i % len(MAX_TOKENS)]) for i in range(32)]
SEEDED = Req(7, 24, temperature=0.9, top_p=0.9, seed=1234)


@dataclass
class Reply:
    """A streamed reply as the client saw it."""

    id: str = ""
    text: str = ""
    finish_reasons: list[str] = field(default_factory=list)
    usage: Any = None
    status: int = 200
    error: Any = None

    def add(self, chunk) -> None:
        self.id = self.id or chunk.id
        if chunk.usage is not None:
            assert self.usage is None, "usage arrived twice"
            self.usage = chunk.usage
        for choice in chunk.choices:
            self.text += choice.delta.content or ""
            if choice.finish_reason is not None:
                self.finish_reasons.append(choice.finish_reason)

    def same_as(self, alone: Reply) -> bool:
        return (self.text, self.finish_reasons, self.usage.completion_tokens, self.usage.prompt_tokens) == (
            alone.text,
            alone.finish_reasons,
            alone.usage.completion_tokens,
            alone.usage.prompt_tokens,
        )


def chat(client: openai.OpenAI, req: Req) -> Reply:
    reply = Reply()
    for chunk in client.chat.completions.create(**req.kwargs()):
        reply.add(chunk)
    return reply


async def achat(client: openai.AsyncOpenAI, req: Req) -> Reply:
    reply = Reply()
    try:
        async for chunk in await client.chat.completions.create(**req.kwargs()):
            reply.add(chunk)
    except openai.APIStatusError as e:
        reply.status, reply.error = e.status_code, e.body
    return reply


def aclient(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def gather(url: str, reqs: list[Req]) -> list[Reply]:
    """Send `reqs` concurrently; their replies in order."""

    async def main() -> list[Reply]:
        async with aclient(url) as c:
            return await asyncio.gather(*(achat(c, r) for r in reqs))

    return asyncio.run(main())


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.005)


@dataclass
class Served:
    url: str
    engine: LLMEngine
    async_engine: AsyncEngine

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def idle(self) -> bool:
        """No request in the engine, and every KV block and GDN slot free."""
        cm = self.engine.cache_manager
        return (
            not self.engine.has_unfinished_requests()
            and cm.num_free_blocks == cm.config.num_blocks
            and cm.num_free_slots == cm.config.num_slots
        )


@contextmanager
def serve(checkpoint, max_queued: int = 256, **config) -> Iterator[Served]:
    """The real engine behind a live uvicorn server on a free port, in a thread."""
    engine = LLMEngine.from_checkpoint(checkpoint, model_name=MODEL, config=EngineConfig(**config))
    async_engine = AsyncEngine(engine, max_queued=max_queued)
    try:
        with live_server(create_app(async_engine, MODEL)) as url:
            yield Served(url, engine, async_engine)
    finally:
        async_engine.shutdown()


@pytest.fixture(scope="module")
def batching(tiny_checkpoint) -> Iterator[Served]:
    # A token budget of 64 splits prompts into chunks once several requests share a step (alone, every
    # prompt fits one chunk), so batch invariance covers chunked prefill too.
    with serve(
        tiny_checkpoint,
        max_num_seqs=40,
        max_model_len=MAX_MODEL_LEN,
        cache_memory_bytes=4 << 20,
        max_num_batched_tokens=64,
        block_size=BLOCK_SIZE,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def alone(batching) -> dict[Req, Reply]:
    """Every request's reply when it is the only one on the server, sent one after another."""
    client = batching.client()
    replies = {req: chat(client, req) for req in [*GREEDY, SEEDED]}
    assert batching.engine.stats.preemptions_total == 0
    return replies


def test_alone_replies_are_well_formed(alone):
    for req, reply in alone.items():
        assert reply.finish_reasons in (["length"], ["stop"]), req
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
        if reply.finish_reasons == ["length"]:
            assert reply.usage.completion_tokens == req.max_tokens
    assert len({r.usage.prompt_tokens for r in alone.values()}) > 20
    assert {r.usage.completion_tokens for r in alone.values()} >= {1, 40}
    # seeded sampling really samples: it is not the start of the greedy reply to the same prompt
    assert not alone[GREEDY[SEEDED.i]].text.startswith(alone[SEEDED].text)


def test_concurrent_streams_match_alone(batching, alone):
    peak = 0
    polling = True

    def poll() -> None:
        nonlocal peak
        while polling:
            peak = max(peak, batching.engine.stats.num_running)
            time.sleep(0.005)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    reqs = [*GREEDY, SEEDED]
    try:
        replies = gather(batching.url, reqs)
    finally:
        polling = False
        poller.join()
    mismatched = [req for req, reply in zip(reqs, replies) if not reply.same_as(alone[req])]
    assert mismatched == []
    assert len({r.id for r in replies}) == len(reqs)
    assert peak >= 8, f"requests did not run together (at most {peak} at once)"
    assert batching.engine.stats.preemptions_total == 0
    wait_for(batching.idle)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_client_disconnect_frees_the_cache(batching, alone, stream):
    engine = batching.engine
    long = Req(0, 200).kwargs() | {"stream": stream}
    if not stream:
        long.pop("stream_options")
    wait_for(batching.idle)
    if stream:
        with (
            httpx.Client(base_url=batching.url, timeout=30) as http,
            http.stream("POST", "/v1/chat/completions", json=long) as r,
        ):
            contents = (line for line in r.iter_lines() if '"content":"' in line)
            assert [next(contents) for _ in range(3)]
            assert not batching.idle(), "the request should hold cache while it streams"
    else:
        with httpx.Client(base_url=batching.url, timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json=long)
    wait_for(batching.idle, timeout=3)
    last = engine.stats.finished[-1]
    assert last.finish_reason == "abort" and 0 < last.output_tokens < 200
    assert chat(batching.client(), GREEDY[5]).same_as(alone[GREEDY[5]])


def test_over_long_request_is_400_naming_the_limit(batching, alone):
    client = batching.client()
    with pytest.raises(openai.BadRequestError, match=str(MAX_MODEL_LEN)) as e:
        client.chat.completions.create(**Req(0, MAX_MODEL_LEN - 10).kwargs())
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
    # a prompt alone over the limit (max_tokens unset fills the context, at least one token)
    long_prompt = [{"role": "user", "content": " ".join(WORDS * 40)}]
    with pytest.raises(openai.BadRequestError, match=str(MAX_MODEL_LEN)):
        client.chat.completions.create(model=MODEL, messages=long_prompt)
    assert batching.idle()
    assert chat(client, GREEDY[3]).same_as(alone[GREEDY[3]])


def stop_request(alone: dict[Req, Reply]) -> tuple[dict[str, Any], str]:
    """GREEDY[7] (40 tokens alone) with a stop string taken from the middle of its reply."""
    full = alone[GREEDY[7]].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip() and full.index(stop) > 0
    return GREEDY[7].kwargs() | {"stop": [stop]}, full[: full.index(stop)]


def test_stop_string_ends_the_request_in_the_engine(batching, alone):
    kwargs, expected = stop_request(alone)
    reply = Reply()
    for chunk in batching.client().chat.completions.create(**kwargs):
        reply.add(chunk)
    assert (reply.text, reply.finish_reasons) == (expected, ["stop"])
    assert reply.usage.completion_tokens < 40
    wait_for(batching.idle)
    assert batching.engine.stats.finished[-1].output_tokens == reply.usage.completion_tokens


def test_stop_string_finish_is_recorded_as_stop(batching, alone):
    kwargs, _ = stop_request(alone)
    reply = Reply()
    for chunk in batching.client().chat.completions.create(**kwargs):
        reply.add(chunk)
    wait_for(batching.idle)
    last = batching.engine.stats.finished[-1]
    assert last.request_id == reply.id and last.finish_reason == reply.finish_reasons[0] == "stop"


@pytest.fixture(scope="module")
def small_cache(tiny_checkpoint, tiny_config: ModelConfig) -> Iterator[Served]:
    """8 KV blocks (128 tokens): two of PREEMPTED's requests at their longest fit, four running do not."""
    budget = (4 + 2) * gdn_bytes_per_slot(tiny_config, torch.float32) + 8 * kv_bytes_per_block(
        tiny_config, BLOCK_SIZE, torch.float32
    )
    with serve(
        tiny_checkpoint,
        max_num_seqs=4,
        max_model_len=MAX_MODEL_LEN,
        cache_memory_bytes=budget,
        prefix_cache_slots=2,
        max_num_batched_tokens=64,
        block_size=BLOCK_SIZE,
    ) as s:
        assert s.engine.cache_manager.config.num_blocks == 8
        yield s


# 28 to 55 prompt tokens + 24 generated: 4 or 5 blocks each
PREEMPTED = [Req(i, 24) for i in (3, 5, 6, 7, 9)] + [Req(10, 24, temperature=0.9, top_p=0.9, seed=1234)]


def test_preempted_requests_match_alone(small_cache):
    engine = small_cache.engine
    client = small_cache.client()
    alone = [chat(client, req) for req in PREEMPTED]
    assert engine.stats.preemptions_total == 0
    replies = gather(small_cache.url, PREEMPTED)
    assert engine.stats.preemptions_total > 0
    assert [r.same_as(a) for r, a in zip(replies, alone)] == [True] * len(PREEMPTED)
    wait_for(small_cache.idle)


def test_request_larger_than_the_cache_is_400(small_cache):
    # 200 tokens fit max_model_len (256) but never the 128-token cache: refused up front, not left waiting
    with pytest.raises(openai.BadRequestError, match="128"):
        small_cache.client().chat.completions.create(**Req(0, 200).kwargs())
    assert small_cache.idle()


def test_advertised_context_fits_the_cache(small_cache):
    card = httpx.get(small_cache.url + "/v1/models", timeout=10).json()["data"][0]
    cm = small_cache.engine.cache_manager
    assert card["max_model_len"] <= cm.config.num_blocks * cm.block_size


@pytest.fixture(scope="module")
def one_seq(tiny_checkpoint) -> Iterator[Served]:
    """One running request and one queued: a third in flight is refused."""
    with serve(
        tiny_checkpoint,
        max_queued=1,
        max_num_seqs=1,
        max_model_len=MAX_MODEL_LEN,
        cache_memory_bytes=1 << 20,
        max_num_batched_tokens=64,
        block_size=BLOCK_SIZE,
    ) as s:
        yield s


def test_overload_is_503_and_accepted_requests_complete_once(one_seq, alone):
    engine = one_seq.engine
    finished_before = len(engine.stats.finished)
    fill = [GREEDY[7], GREEDY[15]]  # 40 tokens each: capacity stays full for over a second
    burst = [r for r in GREEDY if 5 <= r.max_tokens <= 21][:6]
    later = [GREEDY[6], GREEDY[14]]

    def held() -> int:
        return len(engine.scheduler.running) + len(engine.scheduler.waiting)

    async def main() -> tuple[list[Reply], list[Reply], list[Reply]]:
        async with aclient(one_seq.url) as c:
            # Fill both places first: a burst that races for the last place is
            # test_api.py::test_simultaneous_burst_over_capacity_gets_503 (a known bug).
            filling = [asyncio.create_task(achat(c, r)) for r in fill]
            await until(lambda: held() == 2)
            refused = await asyncio.gather(*(achat(c, r) for r in burst))
            accepted = await asyncio.gather(*filling)
            await until(one_seq.idle)
            return accepted, refused, await asyncio.gather(*(achat(c, r) for r in later))

    accepted, refused, served_later = asyncio.run(main())
    for reply in refused:
        assert reply.status == 503, reply
        assert reply.error["type"] == "service_unavailable" and reply.error["code"] == "overloaded"
        assert reply.id == "" and reply.text == ""
    replies = dict(zip([*fill, *later], [*accepted, *served_later]))
    assert [r.same_as(alone[req]) for req, r in replies.items()] == [True] * 4
    wait_for(one_seq.idle)
    # Each accepted request ran in the engine exactly once, with the token counts its client was told;
    # refused ones never reached it.
    finished = list(engine.stats.finished)[finished_before:]
    by_id = {r.id: r for r in replies.values()}
    assert sorted(f.request_id for f in finished) == sorted(by_id)
    for f in finished:
        reply = by_id[f.request_id]
        assert (f.finish_reason, f.prompt_tokens, f.output_tokens) == (
            reply.finish_reasons[0],
            reply.usage.prompt_tokens,
            reply.usage.completion_tokens,
        )
