"""Offline throughput of the engine core at several concurrencies, and the scheduler's own overhead.

    python bench/offline.py [--concurrency 1 8 32] [--prompt-len 32] [--max-tokens 32] [--threads N]

For each concurrency N: N requests with random prompts (fixed seed) and `ignore_eos`, run to completion
with `engine.step()`. Reports output tokens/s and, per step, the time spent outside the model runner
(scheduling, request updates, bookkeeping), measured by timing `runner.execute` inside each step.
"""

from __future__ import annotations

import argparse
import time

import torch

from vibeqwen.checkpoint.demo import demo_checkpoint
from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
from vibeqwen.sampling import SamplingParams


def run(engine: LLMEngine, n: int, prompt_len: int, max_tokens: int) -> dict:
    g = torch.Generator().manual_seed(n)
    for i in range(n):
        prompt = torch.randint(0, 248044, (prompt_len,), generator=g).tolist()
        engine.add_request(f"b{n}-{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    inner = 0.0
    execute = engine.runner.execute

    def timed(out):
        nonlocal inner
        t = time.perf_counter()
        try:
            return execute(out)
        finally:
            inner += time.perf_counter() - t

    engine.runner.execute = timed
    steps, tokens = 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    total = time.perf_counter() - t0
    engine.runner.execute = execute
    return {"n": n, "tokens": tokens, "secs": total, "tok_s": tokens / total, "steps": steps,
            "overhead_ms": (total - inner) / steps * 1e3, "step_ms": total / steps * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # no prefix caching: the warm-up's prompt comes back, and every prompt is to be prefilled
    engine = LLMEngine.from_checkpoint(demo_checkpoint(), config=EngineConfig(max_num_seqs=max(args.concurrency),
                                                                               enable_prefix_caching=False))
    run(engine, 1, 8, 2)  # warm-up
    rows = [run(engine, n, args.prompt_len, args.max_tokens) for n in args.concurrency]
    print(f"tiny config, CPU, threads={torch.get_num_threads()}, prompt {args.prompt_len}, {args.max_tokens} "
          f"output tokens per request")
    print("| concurrent | output tok/s | steps | step ms | scheduler+bookkeeping ms/step |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['tok_s']:.0f} | {r['steps']} | {r['step_ms']:.1f} | {r['overhead_ms']:.3f} |")


if __name__ == "__main__":
    main()
