"""Prefix caching: time to first token of the requests that reuse a prefix, with the cache on and off.

    python bench/prefix_cache.py [--weights DIR] [--device cpu|cuda] [--turns 6] [--system 2048] [--users 8]

Two workloads, each run on an engine with prefix caching and on one without (the same checkpoint, greedy):
- a multi-turn chat: each turn's prompt is the conversation so far plus a generation prompt (5 tokens), marked
  as the server marks it (`SamplingParams.prefix_cache_point`); the next turn's conversation is the last one, the
  reply rendered as history (a 3-token header instead of the generation prompt, as the chat template does) and
  `--turn-tokens` new tokens, so all but the last reply and the new tokens can come from the cache;
- a shared system prompt: `--users` requests of `--system` shared tokens plus a short distinct question, one after
  another; the second stops its prefill where the prompts branch for a snapshot, the later ones start there.
For each: prefill tokens the engine computed, and the mean time to first token (TTFT, ms) of the requests after
the first (those that can hit the cache). Tokens are checked equal between the two engines. Prints a table last.
Default: the built-in demo checkpoint on the CPU (the ratio, not the times, is what carries over).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vibeqwen.checkpoint.demo import demo_checkpoint
from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
from vibeqwen.sampling import SamplingParams


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 150_000, (n,), generator=g).tolist()


def serve_one(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int,
              point: int | None = None) -> tuple[float, list[int]]:
    """Run one request alone to completion; (TTFT in ms, its output tokens)."""
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    req = engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                         prefix_cache_point=point))
    ttft = None
    while not req.finished:
        engine.step()
        if ttft is None and req.output_token_ids:
            ttft = (time.perf_counter() - t0) * 1e3
    return ttft, req.output_token_ids


def conversation(engine: LLMEngine, args) -> tuple[list[float], list[list[int]], int]:
    before = engine.stats.prompt_tokens_total
    history, ttfts, outs = tokens(args.first_turn, seed=1), [], []
    generation_prompt, header = tokens(5, seed=3), tokens(3, seed=4)
    for turn in range(args.turns):
        ttft, out = serve_one(engine, f"turn{turn}", history + generation_prompt, args.reply_tokens, len(history))
        ttfts.append(ttft)
        outs.append(out)
        history = history + header + out + tokens(args.turn_tokens, seed=100 + turn)
    return ttfts, outs, engine.stats.prompt_tokens_total - before


def shared_system(engine: LLMEngine, args) -> tuple[list[float], list[list[int]], int]:
    before = engine.stats.prompt_tokens_total
    system, ttfts, outs = tokens(args.system, seed=2), [], []
    for user in range(args.users):
        ttft, out = serve_one(engine, f"user{user}", system + tokens(args.turn_tokens, seed=200 + user), 4)
        ttfts.append(ttft)
        outs.append(out)
    return ttfts, outs, engine.stats.prompt_tokens_total - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default=None, help="checkpoint folder (default: the built-in demo checkpoint)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--first-turn", type=int, default=1024, help="tokens of the first turn's prompt")
    ap.add_argument("--turn-tokens", type=int, default=64, help="new tokens per turn / distinct tokens per user")
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--system", type=int, default=2048, help="tokens of the shared system prompt")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    weights = args.weights or demo_checkpoint()
    rows = []
    for name, workload in (("multi-turn chat", conversation), ("shared system prompt", shared_system)):
        results = {}
        for on in (False, True):
            engine = LLMEngine.from_checkpoint(weights, config=EngineConfig(
                device=args.device, dtype="auto", max_num_seqs=8, max_num_batched_tokens=2048,
                max_model_len=16384, enable_prefix_caching=on))
            serve_one(engine, "warm-up", tokens(32, seed=9), 2)
            results[on] = workload(engine, args)
            del engine
        (t_off, o_off, n_off), (t_on, o_on, n_on) = results[False], results[True]
        # the first differing token of each request (None: the same tokens). On the CPU the reference path computes
        # a cached prefix exactly as a whole prefill: no difference allowed. On the GPU another split of the prefill
        # rounds differently in bf16, so outputs may part at near-ties (tests/model/test_gpu_path.py checks the gaps)
        parted = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(o_on, o_off)]
        print(f"{name}: first differing token per request (cache on vs off): {parted}", flush=True)
        if args.device == "cpu":
            assert o_on == o_off, f"{name}: prefix caching changed the tokens"
        later_off, later_on = statistics.mean(t_off[1:]), statistics.mean(t_on[1:])
        rows.append((name, n_off, n_on, later_off, later_on))
        print(f"{name}: TTFT off {[round(t, 1) for t in t_off]} ms, on {[round(t, 1) for t in t_on]} ms", flush=True)
    print()
    print(f"{'workload':<22} {'prefill tok off':>15} {'on':>8} {'TTFT ms off':>12} {'on':>8} {'speed-up':>9}")
    for name, n_off, n_on, a, b in rows:
        print(f"{name:<22} {n_off:>15} {n_on:>8} {a:>12.1f} {b:>8.1f} {a / b:>8.1f}x")


if __name__ == "__main__":
    main()
