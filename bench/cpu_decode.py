"""Tiny-config decode step time on the CPU reference path, one sequence.

    python bench/cpu_decode.py [--context 64] [--steps 32] [--threads N]

Builds (or reuses) the demo checkpoint, prefills `--context` random tokens through the engine, then times
`--steps` engine steps of one decode token each (schedule + forward + LM head + sample + update). Prints a
short table last.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vibeqwen.checkpoint.demo import demo_checkpoint
from vibeqwen.engine.llm_engine import LLMEngine
from vibeqwen.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine.from_checkpoint(demo_checkpoint())
    prompt = torch.randint(0, 248044, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("bench", prompt, SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    med = statistics.median(times)
    print(f"threads={torch.get_num_threads()} context={args.context} steps={args.steps}")
    print("| phase | ms |")
    print("|---|---|")
    print(f"| prefill {args.context} tokens | {prefill_ms:.1f} |")
    print(f"| decode step (median) | {med:.2f} |")
    print(f"| decode step (min / max) | {min(times):.2f} / {max(times):.2f} |")
    print(f"| decode tokens/s | {1e3 / med:.0f} |")


if __name__ == "__main__":
    main()
