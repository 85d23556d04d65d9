"""A/B of decode-step switches in one engine (GPU): each variant's decode CUDA graphs are captured anew and timed.

    python bench/decode_ab.py --ckpt /tmp/qwen-full-rs0.05 [--batches 1,8,32] [--variants on,none,on,none]
        [--profile] [--json-out FILE]

Building the full-size engine takes 35-170 s; re-capturing a few decode graphs takes seconds, so switches that act
when a graph is captured are compared here in one process, interleaved (on, off, on, off: the spread between the
repeats of one variant is the noise). A variant sets:

  on       the defaults: the GDN recurrent kernel loads its state before its PDL wait
           (``VIBEQWEN_GDN_EARLY_STATE``) and the one-launch MoE's router CTAs their whole weight tile
           (``VIBEQWEN_MOE_ROUTER_HOLD``, batch 1)
  no_early the recurrent kernel's state loaded after its PDL wait
  no_hold  two k16 steps of the router's weights before the PDL wait, the rest after it
  none     neither
  NAME=VALUE  an environment switch read when a graph is captured (e.g. VIBEQWEN_ROUTE_WIDE=0: the router at 17-32
           tokens on 16 warps; VIBEQWEN_MOE_CONFIGS=FILE: another MoE config table); parts joined with + combine
           (no_early+VIBEQWEN_ROUTE_WIDE=0). A part that is neither a variant above nor NAME=VALUE (NAME in capitals,
           digits and _) continues the value before it, so a value may hold "+" (VIBEQWEN_X=in+moe:0.5)

The step time is the median wall time per step of back-to-back engine steps with async scheduling (as bench/h200.py's
decode stage), 1k-token contexts. With --profile the "on" variant's smallest- and largest-batch replays are
profiled last (torch.profiler: exclusive time per kernel, two layers' timeline). Prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from h200 import (  # noqa: E402
    _cuda_kernels, abort_all, decode_steps_ms, exclusive_kernel_table, layer_timeline, log, make_engine, prefill_all,
    prompts)
from h200_reference import copy_bandwidth_tbs, decode_floor_bytes  # noqa: E402

from vibeqwen.config import ModelConfig  # noqa: E402
from vibeqwen.model.cuda_graphs import DecodeGraphs  # noqa: E402
from vibeqwen.sampling import SamplingParams  # noqa: E402

VARIANTS = ("on", "no_early", "no_hold", "none")
_set_env: dict[str, str | None] = {}  # the environment switches the current variant set: their values before it


_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def parse_variant(name: str) -> tuple[set[str], dict[str, str]]:
    """Variant `name` (see the module docstring) -> (its named variants, its environment switches in order).

    Parts are split on "+"; a part that is neither a named variant nor NAME=VALUE continues the previous value
    ("VIBEQWEN_X=in+moe:0.5" -> {"VIBEQWEN_X": "in+moe:0.5"}).

    Raises:
        ValueError: an empty part, or a part that is neither a variant nor NAME=VALUE and follows no value."""
    named: set[str] = set()
    env: dict[str, str] = {}
    last = None
    for part in name.split("+"):
        key, eq, value = part.partition("=")
        if eq and _ENV_NAME.fullmatch(key):
            env[key] = value
            last = key
        elif part in VARIANTS:
            named.add(part)
            last = None
        elif last is not None and part:
            env[last] += "+" + part
        else:
            raise ValueError(f"unknown variant part {part!r} in {name!r}: pick from {VARIANTS} or NAME=VALUE")
    return named, env


def apply(name: str) -> None:
    """Set the switches of variant `name` (see the module docstring), undoing the previous variant's."""
    import os

    from vibeqwen_kernels.gdn import recurrent
    from vibeqwen_kernels.moe import decode_cuda, fused

    for key, before in _set_env.items():  # back to the values the shell gave
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
    _set_env.clear()
    try:
        named, env = parse_variant(name)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    for key, value in env.items():
        _set_env.setdefault(key, os.environ.get(key))
        os.environ[key] = value
    recurrent._EARLY_STATE = not named & {"no_early", "none"}
    decode_cuda.ROUTER_HOLD = not named & {"no_hold", "none"}
    fused._tuned_table.cache_clear()  # VIBEQWEN_MOE_CONFIGS may have changed


def recapture(engine, sizes: list[int]) -> None:
    """Replace the engine's decode CUDA graphs by new captures for batch sizes `sizes` (the switches as set now)."""
    runner = engine.runner
    width = runner.graphs.width
    runner.graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    runner.graphs = DecodeGraphs(runner.model, runner.cache, width, sizes)


def step_ms(engine, batch: int, context: int, tag: str) -> float:
    """Median ms per step of 20 back-to-back decode steps of `batch` sequences with `context`-token prompts."""
    for i, p in enumerate(prompts(batch, context, seed=batch)):
        engine.add_request(f"{tag}-{batch}-{i}", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    prefill_all(engine)
    times = decode_steps_ms(engine, 24)[4:]
    abort_all(engine)
    return sorted(times)[len(times) // 2]


def profile_batch(engine, batch: int, context: int, n_layers: int) -> dict:
    """Exclusive kernel time of a batch-`batch` decode replay and two layers' timeline (bench/h200.py's tables)."""
    from torch.profiler import ProfilerActivity, profile

    for i, p in enumerate(prompts(batch, context, seed=50 + batch)):
        engine.add_request(f"prof-{batch}-{i}", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    prefill_all(engine)
    decode_steps_ms(engine, 6)
    g = engine.runner.graphs.graphs[next(s for s in engine.runner.graphs.sizes if s >= batch)]
    for _ in range(3):
        g.graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            g.graph.replay()
        torch.cuda.synchronize()
    abort_all(engine)
    ks = _cuda_kernels(prof)
    out = {"kernels_exclusive": exclusive_kernel_table(ks, 5, rows=16), "timeline": layer_timeline(ks, n_layers)}
    log(f"decode b{batch}, exclusive kernel time per step:")
    for k in out["kernels_exclusive"]:
        log(f"   {k['us_per_step']:8.1f} us  x{k['calls_per_step']:.0f}  {k['kernel']}")
    log(f"decode b{batch}, two layers of the last replay (us):")
    for k in out["timeline"]:
        log(f"   {k['start_us']:7.2f} {k['end_us']:7.2f} excl {k['exclusive_us']:6.2f}  {k['kernel'][:70]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--variants", default="on,none,no_early,no_hold,on,none")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    cfg = ModelConfig.named("full")
    bw = copy_bandwidth_tbs("cuda")
    engine = make_engine(args.ckpt, max_num_seqs=max(args.batches), prefill_graphs=False)
    log(f"copy bandwidth {bw:.2f} TB/s")
    rows = []
    for name in args.variants.split(","):
        apply(name)
        recapture(engine, sorted(set(args.batches)))
        row = {"variant": name}
        for b in args.batches:
            row[b] = step_ms(engine, b, args.context, name)
        rows.append(row)
        log(f"{name}: " + ", ".join(f"b{b} {row[b]:.3f} ms" for b in args.batches))
    res = {"copy_bandwidth_tbs": bw, "context": args.context, "rows": rows,
           "floor_ms": {b: decode_floor_bytes(cfg, b, args.context, 4) / (bw * 1e12) * 1e3 for b in args.batches}}
    if args.profile:
        apply("on")
        recapture(engine, sorted(set(args.batches)))
        # the smallest and largest batch asked for (a batch without its own graph would replay a larger one)
        for b in sorted({min(args.batches), max(args.batches)}):
            res[f"profile_on_b{b}"] = profile_batch(engine, b, args.context, cfg.num_hidden_layers)
    if args.json_out:
        args.json_out.write_text(json.dumps(res, indent=2) + "\n")
    log("| variant | " + " | ".join(f"b{b} ms" for b in args.batches) + " |")
    log("|---|" + "---|" * len(args.batches))
    for r in rows:
        log(f"| {r['variant']} | " + " | ".join(f"{r[b]:.3f}" for b in args.batches) + " |")
    log("| floor | " + " | ".join(f"{res['floor_ms'][b]:.3f}" for b in args.batches) + " |")


if __name__ == "__main__":
    main()
