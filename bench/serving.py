"""Online serving benchmark: N concurrent streamed chat requests against a running server.

    vibeqwen serve --weights demo &                      # or any checkpoint
    python bench/serving.py --concurrency 1 8 32 [--max-tokens 64] [--base-url http://127.0.0.1:8000/v1]

Uses the unmodified `openai` SDK. Each request streams `--max-tokens` tokens (ignore_eos) from a distinct
prompt at temperature 0. Reports output tokens/s over the whole batch, mean time to first token (TTFT)
and mean time per output token after the first (TPOT). Prints a short table last.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import openai


async def one(client, model: str, i: int, max_tokens: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    first, n = None, 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Request {i}: write about the number {i * 7919}."}],
        max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
        delta = chunk.choices[0].delta if chunk.choices else None
        if first is None and delta is not None and (delta.content or getattr(delta, "reasoning_content", None)):
            first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    return first - t0, (end - first) / max(n - 1, 1), n


async def run(base_url: str, concurrency: int, max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(client, model, i, max_tokens) for i in range(concurrency)))
    secs = time.perf_counter() - t0
    await client.close()
    tokens = sum(n for _, _, n in results)
    return {"n": concurrency, "tok_s": tokens / secs, "ttft_ms": statistics.mean(r[0] for r in results) * 1e3,
            "tpot_ms": statistics.mean(r[1] for r in results) * 1e3, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    asyncio.run(run(args.base_url, 1, 4))  # warm-up
    rows = [asyncio.run(run(args.base_url, n, args.max_tokens)) for n in args.concurrency]
    print("| concurrent streams | output tok/s | mean TTFT ms | mean TPOT ms |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['tok_s']:.0f} | {r['ttft_ms']:.0f} | {r['tpot_ms']:.1f} |")


if __name__ == "__main__":
    main()
