"""The sampler of a decode step (`vibeqwen.engine.sampler.sample_rows`) at the model's vocabulary (248320 ids):
as the engine runs it (rows with a top_k, and rows that keep the whole vocabulary, through the fused Triton kernels
of `vibeqwen_kernels.sampling`), with
``VIBEQWEN_FUSED_SAMPLER=0`` (the batched PyTorch ops for every row), and the per-row path the batched one replaced
(each row: its top-k mask, softmax over the whole vocabulary, a sort of the whole vocabulary for top-p,
`torch.multinomial`).

Rows of random logits in float32; per sampling setting and batch: microseconds a step, wall time from the first
launch to the tokens being ready (launch overhead included: the host issues these launches in the step's critical
path), the median of `--iters` steps after warm-up. Settings: Qwen3.6's recommended thinking-mode sampling
(temperature 0.6, top_p 0.95, top_k 20), the same with a seed per request, temperature alone, top_p alone, greedy.

    python bench/kernels/bench_sampler.py [--batches 1,8,32,64] [--iters 50] [--device cuda] [--json PATH]
        [--settings top-p,temperature] [--profile]

``--profile`` then prints, per setting and batch, the device ops of one engine step (torch.profiler: the ten largest
by device time, and the step's device total).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from vibeqwen.engine.sampler import make_generator, sample_rows
from vibeqwen.sampling import SamplingParams

VOCAB = 248320
SETTINGS = {
    "qwen-thinking": dict(temperature=0.6, top_p=0.95, top_k=20),
    "qwen-thinking-seeded": dict(temperature=0.6, top_p=0.95, top_k=20, seed=0),
    "temperature": dict(temperature=1.0),
    "top-p": dict(temperature=1.0, top_p=0.9),
    "greedy": dict(temperature=0.0),
}


def per_row_dense(logits: torch.Tensor, params: list[SamplingParams], gens: list) -> torch.Tensor:
    """The replaced path: one row at a time, over the whole vocabulary."""
    tokens = logits.argmax(-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        x = logits[i] / p.temperature
        if 0 < p.top_k < x.numel():
            x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
        probs = torch.softmax(x, -1)
        if p.top_p < 1.0:
            sp, order = torch.sort(probs, descending=True)
            drop = (sp.cumsum(0) - sp) >= p.top_p
            drop[0] = False
            probs = torch.zeros_like(probs).scatter_(0, order, sp.masked_fill(drop, 0.0))
        tokens[i : i + 1] = torch.multinomial(probs / probs.sum(), 1, generator=gens[i])
    return tokens


def unfused(logits: torch.Tensor, params: list[SamplingParams], gens: list) -> torch.Tensor:
    """sample_rows with the fused kernels switched off."""
    os.environ["VIBEQWEN_FUSED_SAMPLER"] = "0"
    try:
        return sample_rows(logits, params, gens)
    finally:
        del os.environ["VIBEQWEN_FUSED_SAMPLER"]


def time_step(fn, logits, params, gens, iters: int, sync) -> float:
    for _ in range(3):
        fn(logits, params, gens)
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(logits, params, gens).cpu()  # the engine reads the tokens back
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def profile_step(logits, params, gens, sync, title: str) -> None:
    """Print the device ops of one `sample_rows` call: the ten largest by device time (us) and their total."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if logits.is_cuda else [])
    sync()
    with profile(activities=acts) as prof:
        sample_rows(logits, params, gens).cpu()
        sync()
    # the kernels and copies themselves (the device's own events), not the aten ops that launched them
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events)
    print(f"  profile ({title}): {len(events)} device ops, {total:.1f} us of device time")
    for e in events[:10]:
        print(f"    {e.self_device_time_total:9.1f} us  x{e.count:<3} {e.key[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="write the table here as JSON")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names of SETTINGS")
    ap.add_argument("--profile", action="store_true", help="print each step's largest device ops (torch.profiler)")
    args = ap.parse_args()
    names = args.settings.split(",")
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown:
        ap.error(f"unknown settings {unknown}; choose from {list(SETTINGS)}")
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    print(f"{'setting':<22}{'batch':>6}{'engine us':>11}{'unfused us':>12}{'per-row us':>12}{'speed-up':>10}")
    for name, kw in ((n, SETTINGS[n]) for n in names):
        for b in (int(x) for x in args.batches.split(",")):
            torch.manual_seed(b)
            logits = torch.randn(b, VOCAB, device=dev) * 4
            params = [SamplingParams(**{**kw, **({"seed": i} if "seed" in kw else {})}) for i in range(b)]
            gens = [None if p.greedy else make_generator(p, dev) for p in params]
            new = time_step(sample_rows, logits, params, gens, args.iters, sync)
            batched = time_step(unfused, logits, params, gens, args.iters, sync)
            old = time_step(per_row_dense, logits, params, gens, args.iters, sync)
            rows.append({"setting": name, "batch": b, "engine_us": round(new, 1), "unfused_us": round(batched, 1),
                         "per_row_us": round(old, 1)})
            print(f"{name:<22}{b:>6}{new:>11.1f}{batched:>12.1f}{old:>12.1f}{min(batched, old) / new:>9.1f}x")
            if args.profile:
                profile_step(logits, params, gens, sync, f"{name}, batch {b}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                       "vocab": VOCAB, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
