"""Online serving benchmark: streamed chat requests against a running server, all at once or arriving at a rate.

    vibeqwen serve --weights demo &                      # or any checkpoint
    python bench/serving.py --concurrency 1 8 32 [--max-tokens 64] [--base-url http://127.0.0.1:8000/v1]
    python bench/serving.py --request-rate 4 --num-prompts 64 --prompt-words 300   # Poisson arrivals

Uses the unmodified `openai` SDK. Each request streams `--max-tokens` tokens (ignore_eos) from a distinct prompt at
temperature 0 (`--prompt-words` pads it to about that many words). With `--concurrency`, each level sends that many
requests at once; with `--request-rate R`, `--num-prompts` requests arrive as a Poisson process of R per second
(exponential gaps, seeded), as `vllm bench serve` does, so new prompts keep joining running decodes (the engine's
mixed steps). Reports output tokens/s over the run, and time to first token (TTFT) and time per output token after
the first (TPOT): mean, median and p99. Prints a short table last.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import openai


#: Runs of this process so far: every run's prompts differ from every other's (the server's prefix cache must not
#: serve a later run's prompts from an earlier run's), the warm-up's included.
_RUNS = [0]


def _prompt(i: int, words: int, run: int) -> str:
    text = f"Run {run}, request {i}: write about the number {i * 7919 + run * 104729}."
    pad = " ".join(f"w{(i * 31 + j) % 997}" for j in range(max(words - len(text.split()), 0)))
    return f"{text} {pad}".strip()


async def one(client, model: str, i: int, max_tokens: int, words: int, run: int) -> tuple[float, float | None, int]:
    """(TTFT s, TPOT s or None for fewer than 2 tokens, output tokens) of one streamed request."""
    t0 = time.perf_counter()
    first, n = None, 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": _prompt(i, words, run)}],
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
    return first - t0, (end - first) / (n - 1) if n > 1 else None, n


def _p(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of values, nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _summary(label: str, outcomes: list, secs: float) -> dict:
    """Throughput and TTFT / TPOT statistics of a run's outcomes ((ttft, tpot, n) or the exception a request
    raised); TPOT over the requests that produced at least 2 tokens."""
    results = [r for r in outcomes if not isinstance(r, BaseException)]
    tokens = sum(n for _, _, n in results)
    ttft = [r[0] * 1e3 for r in results]
    tpot = [r[1] * 1e3 for r in results if r[1] is not None]

    def stats(v: list[float]) -> tuple[float, float, float]:
        return (statistics.mean(v), statistics.median(v), _p(v, 0.99)) if v else (float("nan"),) * 3

    return {"label": label, "requests": len(outcomes), "failed": len(outcomes) - len(results),
            "tok_s": tokens / secs, "tokens": tokens, "ttft_ms": stats(ttft), "tpot_ms": stats(tpot)}


async def _client_and_model(base_url: str):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    return client, (await client.models.list()).data[0].id


def _next_run() -> int:
    _RUNS[0] += 1
    return _RUNS[0]


async def run(base_url: str, concurrency: int, max_tokens: int, words: int = 0) -> dict:
    """`concurrency` requests sent at once."""
    client, model = await _client_and_model(base_url)
    r = _next_run()
    t0 = time.perf_counter()
    outcomes = await asyncio.gather(*(one(client, model, i, max_tokens, words, r) for i in range(concurrency)),
                                    return_exceptions=True)
    secs = time.perf_counter() - t0
    await client.close()
    return _summary(f"{concurrency} at once", outcomes, secs)


async def run_rate(base_url: str, rate: float, num: int, max_tokens: int, words: int, seed: int = 0) -> dict:
    """`num` requests arriving as a Poisson process of `rate` per second (no wait after the last)."""
    client, model = await _client_and_model(base_url)
    r = _next_run()
    rng = random.Random(seed)
    t0 = time.perf_counter()
    tasks = []
    for i in range(num):
        if i:
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.create_task(one(client, model, i, max_tokens, words, r)))
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    secs = time.perf_counter() - t0
    await client.close()
    return _summary(f"{rate:g}/s x {num}", outcomes, secs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--request-rate", type=float, nargs="+", default=None,
                    help="requests per second (Poisson arrivals), one run per rate; replaces --concurrency")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per --request-rate run")
    ap.add_argument("--prompt-words", type=int, default=0, help="pad each prompt to about this many words")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrival gaps")
    args = ap.parse_args()
    if args.request_rate is not None and any(r <= 0 for r in args.request_rate):
        ap.error("--request-rate must be > 0")
    if args.num_prompts < 1 or any(n < 1 for n in args.concurrency) or args.max_tokens < 1:
        ap.error("--num-prompts, --concurrency and --max-tokens must be >= 1")
    asyncio.run(run(args.base_url, 1, 4))  # warm-up
    if args.request_rate is not None:
        rows = [asyncio.run(run_rate(args.base_url, r, args.num_prompts, args.max_tokens, args.prompt_words, args.seed))
                for r in args.request_rate]
    else:
        rows = [asyncio.run(run(args.base_url, n, args.max_tokens, args.prompt_words)) for n in args.concurrency]
    print("| requests | failed | output tok/s | TTFT ms mean / median / p99 | TPOT ms mean / median / p99 |")
    print("|---|---|---|---|---|")
    for r in rows:
        t, p = r["ttft_ms"], r["tpot_ms"]
        print(f"| {r['label']} | {r['failed']} | {r['tok_s']:.0f} | {t[0]:.0f} / {t[1]:.0f} / {t[2]:.0f} | "
              f"{p[0]:.1f} / {p[1]:.1f} / {p[2]:.1f} |")


if __name__ == "__main__":
    main()
