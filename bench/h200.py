"""The GPU path on an H200, end to end: correctness against HF transformers, then the roofline timings.

    python bench/h200.py --ckpt /tmp/qwen-full [--skip-write] [--stages oracle,decode,prefill,spec]

Stages (each adds to the JSON; the table is printed last):
  write    builds the full-size synthetic checkpoint in the vendor NVFP4 layout on the GPU.
  oracle   HF transformers' Qwen3_5MoeForCausalLM (bf16, the checkpoint's weights dequantized) scores
           prompts; our GPU engine's logits on the same prompts are compared with it, and the engine's
           32-token greedy continuations are checked token by token against the oracle's argmax (a mismatch
           counts as a near-tie when the oracle's own top-2 margin there is under `--tie-margin`). Prompts
           of 64 tokens, and of `--oracle-long-tokens` (960) with each FP8 prefill mode (W8A16, W8A8:
           EngineConfig.fp8_prefill). Also times the oracle's decode step at batch 1.
  decode   the engine's decode step (CUDA graphs) at batch 1, 8, 32, 64 with 1k-token contexts, next to its
           roofline floor (bytes the step must move, the GDN state counted in --gdn-state-dtype, / copy
           bandwidth measured in this run); with async scheduling (step_ms) and without (sync_step_ms), as wall
           time per step over back-to-back steps.
  prefill  1k- and 8k-token prefills next to the FLOP floor (matmul + attention FLOPs / measured bf16 rate).
           With the whole-chunk prefill CUDA graphs (on by default; --no-prefill-graphs): each size timed with
           the graphs and eagerly (the same engine, graphs switched off), and a greedy check of graphs vs
           eager on 1k- and 1000-token prompts (prefill_graphs_check); then, graphed, the other FP8 prefill
           mode (prefill_other_fp8_mode: the prefill graphs captured again for it, and back).
  spec     speculative decoding: step time vs tokens verified per sequence (1..8) at batch 1 and 32, and
           n-gram end-to-end tok/s against no speculation on text where lookup hits.
Every engine this builds keeps its GDN recurrent state in `--gdn-state-dtype` (EngineConfig.gdn_state_dtype,
default float32; recorded as gdn_state_dtype in the JSON): run it once per dtype to compare both.
Writes bench/results/h200.json (and --json-out).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from h200_reference import copy_bandwidth_tbs, decode_floor_bytes  # noqa: E402

from vibeqwen.config import ModelConfig  # noqa: E402
from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from vibeqwen.engine.spec import SpecConfig  # noqa: E402
from vibeqwen.sampling import SamplingParams  # noqa: E402

VOCAB_TEXT = 248044  # ids below the special tokens


def log(*a) -> None:
    print(*a, flush=True)


def bf16_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - t) / 1e12


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """Matmul FLOPs of a prefill (2 per multiply-add; LM head on the last row only) plus causal attention."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    attn = (2 * cfg.num_attention_heads * cfg.head_dim + 2 * cfg.num_key_value_heads * cfg.head_dim) * h \
        + cfg.num_attention_heads * cfg.head_dim * h
    gdn = (cfg.gdn_conv_dim + cfg.gdn_value_dim + 2 * cfg.linear_num_value_heads) * h + cfg.gdn_value_dim * h
    moe = (cfg.num_experts_per_tok + 1) * 3 * h * i + (cfg.num_experts + 1) * h
    per_token = len(cfg.attention_layers) * attn + len(cfg.gdn_layers) * gdn + cfg.num_hidden_layers * moe
    attn_scores = len(cfg.attention_layers) * 2 * 2 * cfg.num_attention_heads * cfg.head_dim * tokens * (tokens + 1) / 2
    return 2 * per_token * tokens + attn_scores + 2 * cfg.vocab_size * h


def make_engine(ckpt: Path, **kw) -> LLMEngine:
    # no prefix caching: the stages rerun prompts of the same seeds, whose prefill must be measured, not cached
    cfg = dict(max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=9216, gpu_memory_utilization=0.9,
               dtype="bfloat16", device="cuda", enable_prefix_caching=False)
    cfg.update(kw)
    t = time.perf_counter()
    engine = LLMEngine.from_checkpoint(ckpt, config=EngineConfig(**cfg))
    torch.cuda.synchronize()
    log(f"engine ready in {time.perf_counter() - t:.1f} s (graphs: {engine.runner.graphs is not None})")
    return engine


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB_TEXT, (length,), generator=g).tolist() for _ in range(n)]


def engine_logits(engine: LLMEngine, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy-decode `steps` tokens; returns (tokens, logits [steps, V] float32 of each sampled row)."""
    runner = engine.runner
    rows: list[torch.Tensor] = []
    orig = runner.model.logits

    def capture(hidden):
        out = orig(hidden)
        rows.append(out[-1].float().cpu())
        return out

    runner.model.logits = capture
    try:
        toks = [t for t, _ in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))]
    finally:
        runner.model.logits = orig
    return toks, torch.stack(rows)


def oracle_entry(args, ref: torch.Tensor, toks: list[int], lg: torch.Tensor) -> dict:
    """Our sampled rows `lg` [steps, V] and greedy tokens against the oracle's logits `ref` of the same rows."""
    diff = (lg - ref).abs()
    scale = ref.std().item()
    top2 = ref.topk(2, dim=-1)
    agree = ref.argmax(-1).tolist() == toks
    first_bad = next((i for i, (a, b) in enumerate(zip(ref.argmax(-1).tolist(), toks)) if a != b), None)
    entry = {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(), "logit_std": scale,
             "rel_fro": ((lg - ref).norm() / ref.norm()).item(),
             "rel_fro_first_row": ((lg[0] - ref[0]).norm() / ref[0].norm()).item(), "greedy_tokens": len(toks),
             "greedy_all_match": agree, "first_mismatch": first_bad}
    if first_bad is not None:
        i = first_bad
        margin = (top2.values[i, 0] - ref[i, toks[i]]).item()
        entry["mismatch_margin"] = margin
        entry["oracle_top2_gap"] = (top2.values[i, 0] - top2.values[i, 1]).item()
        entry["near_tie"] = margin <= args.tie_margin * scale
    return entry


def stage_oracle(args, res, cfg) -> None:
    """Our greedy continuations and their logits against HF transformers on the same weights: prompts of 64
    tokens (the engine's default: they replay the 64-token prefill graph, W8A16 at that size), and
    prompts of `--oracle-long-tokens` with each EngineConfig.fp8_prefill mode (the prompt's FP8 projections
    W8A16 or W8A8; eager, the graphs give the same tokens: prefill_graphs_check)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "model"))
    from oracle import hf_model  # the test suite's oracle builder

    from vibeqwen.checkpoint.loader import load_checkpoint

    ps = prompts(args.oracle_prompts, 64, seed=1)
    long_ps = prompts(args.oracle_prompts, args.oracle_long_tokens, seed=2) if args.oracle_long_tokens else []
    # alone on the GPU (freed before the oracle's bf16 model, ~70 GB, loads): weights ~40 GB with the experts'
    # Triton copy, activations and graphs ~9 GB
    engine = make_engine(args.ckpt, max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=1024,
                         gpu_memory_utilization=0.45, gdn_state_dtype=args.gdn_state_dtype)
    ours = [engine_logits(engine, p, args.greedy_tokens) for p in ps]
    ours_long = {}
    engine.runner.prefill_graphs = None
    for mode in ("w8a16", "w8a8"):
        engine.runner.fp8_prefill_w8a8 = mode == "w8a8"
        ours_long[mode] = [engine_logits(engine, p, args.greedy_tokens) for p in long_ps]
    del engine
    gc.collect()
    torch.cuda.empty_cache()

    t = time.perf_counter()
    ckpt = load_checkpoint(args.ckpt, device="cuda")
    oracle = hf_model(ckpt, torch.bfloat16, meta_init=True)
    del ckpt
    gc.collect()
    torch.cuda.empty_cache()
    log(f"oracle built in {time.perf_counter() - t:.0f} s")

    def ref_rows(model, p, toks):
        with torch.no_grad():
            return model(torch.tensor([p + toks[:-1]], device="cuda")).logits[0, len(p) - 1 :].float().cpu()

    checks = []
    for p, (toks, lg) in zip(ps, ours):
        checks.append(oracle_entry(args, ref_rows(oracle, p, toks), toks, lg))
        log("oracle check:", checks[-1])
    res["oracle"] = {"prompts": len(ps), "prompt_tokens": 64, "checks": checks, "tie_margin_in_std": args.tie_margin}
    if long_ps:
        long_checks = {}
        for mode, runs in ours_long.items():
            long_checks[mode] = []
            for p, (toks, lg) in zip(long_ps, runs):
                long_checks[mode].append(oracle_entry(args, ref_rows(oracle, p, toks), toks, lg))
                log(f"oracle check, {len(p)}-token prompt, fp8_prefill {mode}:", long_checks[mode][-1])
        res["oracle_long_prompts"] = {"prompts": len(long_ps), "prompt_tokens": args.oracle_long_tokens,
                                      "by_fp8_prefill": long_checks}

    # HF decode step at batch 1 (its own cached generate): (N+1 tokens - 1 token) / N
    ids = torch.tensor([ps[0]], device="cuda")
    times = {}
    for n in (1, 9):
        with torch.no_grad():
            oracle.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
            torch.cuda.synchronize()
            t = time.perf_counter()
            oracle.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
            torch.cuda.synchronize()
            times[n] = time.perf_counter() - t
    res["hf_decode_step_ms"] = {"batch_1": (times[9] - times[1]) / 8 * 1e3}
    log("HF decode step:", res["hf_decode_step_ms"])
    del oracle
    gc.collect()
    torch.cuda.empty_cache()


def sync() -> None:
    """Wait for the GPU's queued work (nothing to wait for on a CPU-only host, where the stages' CPU tests run)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def phase_timed(acc: dict[str, float], name: str, fn):
    """`fn` wrapped to add its wall time (ms, between device syncs) to `acc[name]` at every call."""
    def wrapper(*a, **kw):
        sync()
        t = time.perf_counter()
        r = fn(*a, **kw)
        sync()
        acc[name] = acc.get(name, 0.0) + (time.perf_counter() - t) * 1e3
        return r
    return wrapper


def timed_steps(engine: LLMEngine, n: int) -> list[float]:
    out = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        engine.step()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def decode_steps_ms(engine: LLMEngine, n: int) -> list[float]:
    """Wall time of n back-to-back engine steps, one per call (ms), with no device sync between them: with
    async scheduling a step() launches the next decode step before returning the tokens of the one in flight,
    so a sync after every call (`timed_steps`) would drain that overlap. Every call commits one step, so in
    a steady decode each interval is the time per token of the batch, whichever way the engine schedules."""
    out = []
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        engine.step()
        now = time.perf_counter()
        out.append((now - t) * 1e3)
        t = now
    torch.cuda.synchronize()
    return out


def abort_all(engine: LLMEngine) -> None:
    """Abort the running requests until none is left unfinished."""
    while engine.has_unfinished_requests():
        for r in list(engine.scheduler.running):
            engine.abort_request(r.request_id)


def prefill_all(engine: LLMEngine) -> None:
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()


def stage_decode(args, res, cfg, engine) -> None:
    """Decode step time at each batch size, with async scheduling (the engine's default on the GPU path) and
    without it (`sync_step_ms`); both timed the same way (`decode_steps_ms`)."""
    rows = []
    default = engine.async_scheduling  # the engine's choice (auto: on, with CUDA graphs)
    # async scheduling must not change a token: 8 prompts, staggered max_tokens (stops while a step is in
    # flight), greedy, with and without it
    ps = prompts(8, 256, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=24 + 3 * i, ignore_eos=True) for i in range(8)]
    outs = {}
    for overlap in (False, True):
        engine.async_scheduling = overlap
        ahead = engine.stats.async_steps_total
        outs[overlap] = engine.generate_batch(ps, params)
        ahead = engine.stats.async_steps_total - ahead
    res["async_scheduling_check"] = {"outputs_equal": outs[False] == outs[True], "steps_ahead": ahead,
                                     "tokens": sum(map(len, outs[True]))}
    log("async scheduling check:", res["async_scheduling_check"])
    for batch in args.batches:
        row = {"batch": batch, "context_tokens": args.context}
        for overlap in (False, True):
            engine.async_scheduling = overlap
            for i, p in enumerate(prompts(batch, args.context, seed=batch)):
                engine.add_request(f"d{batch}-{int(overlap)}-{i}", p,
                                   SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
            prefill_all(engine)
            ahead = engine.stats.async_steps_total
            times = decode_steps_ms(engine, 24)[4:]
            ahead = engine.stats.async_steps_total - ahead
            abort_all(engine)
            key = "" if overlap else "sync_"
            row[f"{key}step_ms"] = sorted(times)[len(times) // 2]
            row[f"{key}min_ms"] = min(times)
            if overlap:
                row["steps_ahead"] = ahead  # 24 when every timed step went ahead
        # what a served request pays: Qwen3.6's recommended sampling (its generation_config.json) on the device,
        # async scheduling on, against the greedy steps above
        engine.async_scheduling = default
        for i, p in enumerate(prompts(batch, args.context, seed=batch)):
            engine.add_request(f"s{batch}-{i}", p, SamplingParams(temperature=0.6, top_p=0.95, top_k=20,
                                                                  max_tokens=40, ignore_eos=True))
        prefill_all(engine)
        times = decode_steps_ms(engine, 24)[4:]
        abort_all(engine)
        row["sampled_step_ms"] = sorted(times)[len(times) // 2]
        state_bytes = engine.runner.cache.state_dtype.itemsize  # the GDN state as the engine stores it
        row["floor_ms"] = decode_floor_bytes(cfg, batch, args.context, state_bytes) / (
            res["copy_bandwidth_tbs"] * 1e12) * 1e3
        rows.append(row)
        log("decode:", rows[-1])
    engine.async_scheduling = default
    res["decode"] = rows


def kernel_table(prof, n: int, rows: int = 14) -> list[dict]:
    """Top CUDA kernels of a torch.profiler run over n repetitions: name, us per repetition, calls."""
    out = []
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:rows]:
        out.append({"kernel": e.key[:80], "us_per_step": e.device_time_total / n, "calls_per_step": e.count / n})
    return out


def exclusive_kernel_table(kernels: list[tuple[str, float, float]], n: int, rows: int = 14) -> list[dict]:
    """Top kernels of n repetitions of one stream's chain by exclusive time: kernels (name, start, end) in us; a
    kernel's exclusive time is end - max(start, the previous kernel's end), clamped at 0. With early launch
    (vibeqwen_kernels.pdl.early_launch) a kernel's CTAs start, and the profiler's span begins, while the previous
    kernel still runs, so the spans overlap and sum to more than the step; the exclusive times sum to the busy
    time and charge each kernel only for the time it alone was the one running. Returns [{"kernel",
    "us_per_step", "calls_per_step"}], largest first."""
    total: dict[str, list[float]] = {}
    prev_end = None
    for name, a, b in sorted(kernels, key=lambda k: (k[1], k[2])):
        ex = b - (a if prev_end is None else max(a, prev_end))
        t = total.setdefault(name, [0.0, 0])
        t[0] += max(ex, 0.0)
        t[1] += 1
        prev_end = b if prev_end is None else max(prev_end, b)
    top = sorted(total.items(), key=lambda kv: -kv[1][0])[:rows]
    return [{"kernel": k[:80], "us_per_step": v[0] / n, "calls_per_step": v[1] / n} for k, v in top]


def layer_timeline(kernels: list[tuple[str, float, float]], n_layers: int, first_layer: int = 4,
                   n_shown: int = 2) -> list[dict]:
    """The kernels of layers first_layer .. first_layer + n_shown - 1 of the last repetition in a profile of
    decode replays: kernels (name, start, end) in us, a repetition's n_layers layers each ending at its MoE
    kernel's slot sum (a kernel whose name has "moe_decode" or "_moe_sum"). Returns [{"kernel", "start_us", "end_us",
    "exclusive_us"}] with times from the shown window's first kernel's start ([] when the layer ends are not found).
    Shows how the chain overlaps under early launch: a kernel's span starts when its CTAs start, its exclusive time
    is end - max(start, the previous kernel's end)."""
    ks = sorted(kernels, key=lambda k: (k[1], k[2]))
    ends = [i for i, k in enumerate(ks) if "moe_decode" in k[0] or "_moe_sum" in k[0]]
    if len(ends) < n_layers:
        return []
    ends = ends[-n_layers:]  # the last repetition's layer ends
    lo, hi = ends[first_layer - 1] + 1, ends[first_layer + n_shown - 1] + 1
    t0, prev, out = ks[lo][1], ks[lo - 1][2], []
    for name, a, b in ks[lo:hi]:
        out.append({"kernel": name[:80], "start_us": a - t0, "end_us": b - t0, "exclusive_us": max(b - max(a, prev), 0.0)})
        prev = max(prev, b)
    return out


def _cuda_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of a torch.profiler run's CUDA kernels (memcpy / memset left out)."""
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset"))]


def stage_profile(args, res, cfg, engine) -> None:
    """Where a decode step's time goes: graph replay alone vs the whole engine step, and the top kernels
    of one replay (torch.profiler); the same for a 1k prefill."""
    from torch.profiler import ProfilerActivity, profile

    prof_res = {}
    graphs = engine.runner.graphs
    for batch in (1, 32):
        for i, p in enumerate(prompts(batch, args.context, seed=50 + batch)):
            engine.add_request(f"pr{batch}-{i}", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        prefill_all(engine)
        step = sorted(decode_steps_ms(engine, 10))[5]
        g = graphs.graphs[next(s for s in graphs.sizes if s >= batch)]
        for _ in range(3):
            g.graph.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            g.graph.replay()
        torch.cuda.synchronize()
        replay = (time.perf_counter() - t) / 20 * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                g.graph.replay()
            torch.cuda.synchronize()
        prof_res[f"decode_b{batch}"] = {"step_ms": step, "graph_replay_ms": replay,
                                        "kernels": kernel_table(prof, 5),
                                        "kernels_exclusive": exclusive_kernel_table(_cuda_kernels(prof), 5),
                                        "timeline": layer_timeline(_cuda_kernels(prof), cfg.num_hidden_layers)}
        log(f"decode b{batch}: step {step:.2f} ms, graph replay {replay:.2f} ms; exclusive kernel time (spans "
            f"overlap under early launch):")
        for k in prof_res[f"decode_b{batch}"]["kernels_exclusive"]:
            log(f"   {k['us_per_step']:8.1f} us  x{k['calls_per_step']:.0f}  {k['kernel']}")
        log(f"decode b{batch}: two layers of the last replay (us from the first kernel's start):")
        for k in prof_res[f"decode_b{batch}"]["timeline"]:
            log(f"   {k['start_us']:7.2f} {k['end_us']:7.2f} {k['end_us'] - k['start_us']:6.2f} "
                f"excl {k['exclusive_us']:6.2f}  {k['kernel'][:60]}")
        abort_all(engine)
    engine.add_request("prof-prefill", prompts(1, 1024, seed=77)[0],
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    prof_res["prefill_1k"] = {"kernels": kernel_table(prof, 1, 40)}
    log("prefill 1k:")
    for k in prof_res["prefill_1k"]["kernels"]:
        log(f"   {k['us_per_step']:8.1f} us  x{k['calls_per_step']:.0f}  {k['kernel']}")
    prof_res["prefill_1k_host"] = prefill_host_profile(engine)
    res["profile"] = prof_res


#: (module, attribute) of the GPU path's pieces, labelled in the host profile of a prefill
_HOST_LABELS = [
    ("vibeqwen.model.gdn", "GatedDeltaNet.forward_gpu"),
    ("vibeqwen.model.attention", "GatedAttention.forward_gpu"),
    ("vibeqwen.model.moe", "SparseMoE.forward_gpu"),
    ("vibeqwen_kernels.moe.fused", "fused_moe"),
    ("vibeqwen_kernels.moe.fused", "fused_router"),
    ("vibeqwen_kernels.moe.fused", "moe_align"),
    ("vibeqwen_kernels.gdn.chunk_fla", "gdn_chunk_prefill"),
    ("vibeqwen_kernels.conv1d.causal", "causal_conv1d"),
    ("vibeqwen_kernels.attention.paged", "paged_attention"),
    ("vibeqwen_kernels.norm_fused", "rms_norm"),
    ("vibeqwen_kernels.norm_fused", "gated_rms_norm"),
    ("vibeqwen.model.quant_linear", "FP8Linear.__call__"),
    ("vibeqwen.model.quant_linear", "DenseLinear.__call__"),
    ("vibeqwen.engine.runner", "ModelRunner.execute"),
    ("vibeqwen.model.qwen", "Qwen3_5MoeForCausalLM.forward"),
]


def prefill_host_profile(engine: LLMEngine, tokens: int = 1024, rows: int = 20) -> dict:
    """A 1k-token prefill step under torch.profiler (CPU and CUDA) with the model's pieces labelled: host
    time per piece (a piece's CPU time includes the launches it makes), the top host ops by self time, and
    the step's wall time without the profiler, to see how much of a prefill is host work."""
    import importlib

    from torch.profiler import record_function

    def timed_prefill(seed):
        engine.add_request(f"host-{seed}", prompts(1, tokens, seed=seed)[0],
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        return timed_steps(engine, 1)[0]

    wall = sorted(timed_prefill(300 + i) for i in range(3))[1]
    patched = []
    for mod_name, attr in _HOST_LABELS:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        owner, name = mod, attr
        if "." in attr:
            cls_name, name = attr.split(".")
            owner = getattr(mod, cls_name, None)
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            continue

        def wrap(fn=fn, label=attr):
            def labelled(*a, **k):
                with record_function("vq::" + label):
                    return fn(*a, **k)
            return labelled

        setattr(owner, name, wrap())
        patched.append((owner, name, fn))
    try:
        engine.add_request("host-prof", prompts(1, tokens, seed=310)[0],
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        prof, prof_wall = profiled_step(engine)
    finally:
        for owner, name, fn in patched:
            setattr(owner, name, fn)
    ev = prof.key_averages()
    labels = [{"piece": e.key[4:], "cpu_ms": e.cpu_time_total / 1e3, "calls": e.count,
               "cuda_ms": e.device_time_total / 1e3}
              for e in sorted(ev, key=lambda e: -e.cpu_time_total) if e.key.startswith("vq::")]
    host = [{"op": e.key[:70], "self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count}
            for e in sorted(ev, key=lambda e: -e.self_cpu_time_total) if not e.key.startswith("vq::")][:rows]
    kernels_ms = sum(e.self_device_time_total for e in ev if e.device_type.name == "CUDA") / 1e3
    timeline = step_timeline(prof)
    log(f"prefill {tokens}: wall {wall:.1f} ms (profiled {prof_wall:.1f} ms), kernel time {kernels_ms:.1f} ms; "
        f"timeline {timeline}")
    for r in labels:
        log(f"   piece {r['cpu_ms']:8.2f} ms host x{r['calls']:<4} {r['piece']}")
    for h in host:
        log(f"   host  {h['self_cpu_ms']:8.2f} ms self x{h['calls']:<5} {h['op']}")
    return {"wall_ms": wall, "profiled_wall_ms": prof_wall, "kernel_ms": kernels_ms, "timeline": timeline,
            "pieces": labels, "host_ops": host}


def step_timeline(prof) -> dict:
    """Where a profiled step's GPU time goes between kernels (ms): the span from the first kernel's start to
    the last one's end, the kernels' busy time in it (overlaps merged), the gaps, the host time of the largest
    cudaGraphLaunch and how long after that launch began the first kernel after it started."""
    kern, launch = [], None
    for e in prof.events():
        if e.device_type.name == "CUDA" and not e.name.startswith("Memcpy"):
            kern.append((e.time_range.start, e.time_range.end))
        elif e.name == "cudaGraphLaunch" and (launch is None or e.time_range.elapsed_us() > launch[1] - launch[0]):
            launch = (e.time_range.start, e.time_range.end)
    if not kern:
        return {}
    kern.sort()
    busy, cur_s, cur_e = 0.0, kern[0][0], kern[0][1]
    for a, b in kern[1:]:
        if a > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    busy += cur_e - cur_s
    span = max(b for _, b in kern) - kern[0][0]
    out = {"gpu_span_ms": span / 1e3, "kernel_busy_ms": busy / 1e3, "gaps_ms": (span - busy) / 1e3,
           "kernels": len(kern)}
    if launch is not None:
        after = [a for a, _ in kern if a >= launch[0]]
        out["graph_launch_host_ms"] = (launch[1] - launch[0]) / 1e3
        if after:
            out["graph_launch_to_first_kernel_ms"] = (min(after) - launch[0]) / 1e3
            out["last_kernel_end_after_launch_ms"] = (max(b for a, b in kern if a >= launch[0]) - launch[0]) / 1e3
    return {k: round(v, 3) for k, v in out.items()}


def stage_prefill(args, res, cfg, engine) -> None:
    """Prefill step times; with prefill graphs captured, both ways (rows say `graphed`), after a greedy check
    that the graphs give the eager prefill's tokens (`prefill_graphs_check`)."""
    rows = []
    runner = engine.runner
    graphs = runner.prefill_graphs
    if graphs is not None:
        prefill_graphs_check(args, res, engine)
    mode = engine.config.fp8_prefill
    res["fp8_prefill"] = mode

    def timed(n: int, use, tag: str) -> dict:
        runner.prefill_graphs = use
        times, graphed = [], []
        for rep in range(3):
            engine.add_request(f"p{n}-{rep}-{use is not None}-{tag}", prompts(1, n, seed=100 + rep)[0],
                               SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            times += timed_steps(engine, 1)
            graphed.append(runner.last_graphed)
            assert not engine.has_unfinished_requests()
        floor = prefill_flops(cfg, n) / (res["bf16_tflops"] * 1e12) * 1e3
        row = {"tokens": n, "ms": sorted(times)[1], "floor_ms": floor, "all_ms": times, "graphed": all(graphed),
               "fp8_prefill": tag}
        log("prefill:", row)
        return row

    for n in args.prefill_tokens:
        for use in ([graphs, None] if graphs is not None else [None]):
            rows.append(timed(n, use, mode))
    res["prefill"] = rows
    # the other FP8 prefill mode (EngineConfig.fp8_prefill), graphed, at the long prompts: the prefill graphs record
    # the FP8 layers' choice, so they are captured again for it, and once more for the engine's own mode afterwards
    if graphs is not None and any(n >= 1024 for n in args.prefill_tokens):
        other = "w8a16" if mode == "w8a8" else "w8a8"
        alt = []
        for m in (other, mode):
            runner.prefill_graphs = graphs = None
            gc.collect()
            torch.cuda.empty_cache()
            runner.fp8_prefill_w8a8 = m == "w8a8"
            runner.capture_prefill_graphs(engine.config.max_num_batched_tokens, engine.max_model_len)
            graphs = runner.prefill_graphs
            if m == other:
                alt = [timed(n, graphs, other) for n in args.prefill_tokens if n >= 1024]
        res["prefill_other_fp8_mode"] = alt
    runner.prefill_graphs = graphs


def stage_mixed(args, res, cfg, engine) -> None:
    """The step in which a new prompt of n tokens (--prefill-tokens) joins B decoding sequences (--batches, at
    --context tokens): one graph replay per piece (ModelRunner._graph_pieces) against one eager pass
    (VIBEQWEN_MIXED_GRAPHS=0), each next to a plain decode step of the same batch. Synchronous steps (async
    scheduling off), the median of 3."""
    rows = []
    overlap = engine.async_scheduling
    engine.async_scheduling = False
    try:
        for batch in args.batches:
            for n in args.prefill_tokens:
                if batch + n > engine.config.max_num_batched_tokens:
                    continue
                for mode in ("1", "0"):
                    os.environ["VIBEQWEN_MIXED_GRAPHS"] = mode
                    mixed, plain, graphed = [], [], []
                    for rep in range(3):
                        for i, p in enumerate(prompts(batch, args.context, seed=1000 * batch + 10 * rep)):
                            engine.add_request(f"m{batch}-{n}-{mode}-{rep}-{i}", p,
                                               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
                        prefill_all(engine)
                        plain += timed_steps(engine, 3)[1:]
                        engine.add_request(f"m{batch}-{n}-{mode}-{rep}-new", prompts(1, n, seed=7000 + rep + n)[0],
                                           SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
                        mixed += timed_steps(engine, 1)
                        graphed.append(engine.runner.last_graphed)
                        abort_all(engine)
                    row = {"batch": batch, "prompt_tokens": n, "mixed_graphs": mode == "1",
                           "step_ms": sorted(mixed)[1], "all_ms": mixed, "graphed": all(graphed),
                           "decode_step_ms": sorted(plain)[len(plain) // 2]}
                    rows.append(row)
                    log("mixed step:", row)
    finally:
        os.environ.pop("VIBEQWEN_MIXED_GRAPHS", None)
        engine.async_scheduling = overlap
    res["mixed"] = rows


def prefill_graphs_check(args, res, engine, steps: int = 16) -> None:
    """Greedy continuations of a 1024- and a 1000-token prompt (one chunk each: buckets 1024 exactly and
    1024 with 24 padding tokens) with the prefill graphs and eagerly (the same engine, graphs off): the prefill
    row's relative logit error and the first divergence (None: equal; else the eager top-2 margin there, in
    logit stds: a near-tie is under --tie-margin)."""
    runner = engine.runner
    graphs = runner.prefill_graphs
    out = []
    for n, seed in ((1024, 71), (1000, 72)):
        p = prompts(1, n, seed=seed)[0]
        runner.prefill_graphs = None
        ref_toks, ref = engine_logits(engine, p, steps)
        runner.prefill_graphs = graphs
        toks, lg = engine_logits(engine, p, steps)
        first = next((i for i, (a, b) in enumerate(zip(ref_toks, toks)) if a != b), None)
        margin = None
        if first is not None:
            margin = ((ref[first].max() - ref[first][toks[first]]) / ref[first].std()).item()
        out.append({"tokens": n, "rel_logits_prefill_row": ((lg[0] - ref[0]).norm() / ref[0].norm()).item(),
                    "first_divergence": first, "margin_std": margin,
                    "ok": first is None or margin < args.tie_margin})
        log("prefill graphs check:", out[-1])
    res["prefill_graphs_check"] = out


def set_spec(engine: LLMEngine, method: str, k: int = 7, **kw) -> None:
    """Switch drafting on or off on a live engine (the scheduler keeps its k-token lookahead); `kw`: other
    SpecConfig fields (adaptive=False: every step verifies its drafts, whatever they are worth)."""
    import dataclasses

    spec = SpecConfig(method, k, **kw)
    engine.config = dataclasses.replace(engine.config, spec=spec)
    engine.runner.spec = spec


def stage_spec(args, res, cfg, engine) -> None:
    """Step cost vs tokens verified, and n-gram end to end against no speculation (same engine)."""
    out: dict = {"step_cost": []}
    set_spec(engine, "ngram")
    # the step-cost curve sets each step's drafts by hand: every step synchronous (async scheduling would leave
    # a plain step in flight whose commit clears them); the end-to-end runs below use the engine's default
    overlap, engine.async_scheduling = engine.async_scheduling, False
    batches = (1, 8, 32) if args.spec_curve else ()
    if args.spec_curve:
        t = time.perf_counter()
        engine.runner.capture_verify_graphs(64, engine.max_model_len, max_tokens=128, query_lens=list(range(2, 9)))
        log(f"verification graphs for 2..8 tokens captured in {time.perf_counter() - t:.1f} s")
    for batch in batches:
        for i, p in enumerate(prompts(batch, args.context, seed=7 + batch)):
            engine.add_request(f"s{batch}-{i}", p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        prefill_all(engine)
        for k in range(0, 8):
            times = []
            for _ in range(5):
                for r in engine.scheduler.running:
                    r.spec_token_ids = [1] * k  # k drafts (wrong ones: the cost of verifying, not accepting)
                times += timed_steps(engine, 1)
            vg = engine.runner.verify_graphs.get(k + 1)
            graphed = k == 0 or (vg is not None and batch <= vg.max_batch)
            out["step_cost"].append({"batch": batch, "tokens_verified": k + 1, "step_ms": sorted(times)[2],
                                     "cuda_graph": graphed})
            log("spec step cost:", out["step_cost"][-1])
        if batch == 1:
            out["verify_step_profile_b1_q8"] = profile_step(engine, 7)
        if batch == 32:  # 160 tokens: above the verification graphs, eager
            out["verify_step_profile_b32_q5"] = profile_step(engine, 4)
        abort_all(engine)

    engine.async_scheduling = overlap
    # n-gram end to end on text where lookup could hit: random weights do not follow a "repeat this"
    # instruction, so feed the model its own output back (prompt + output + prompt); a real model copies there,
    # a random one rarely does, so this mostly measures what missed lookups cost
    base = prompts(1, 64, seed=3)[0]
    set_spec(engine, "off")
    first = engine.generate_batch([base], [SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)])[0]
    out["ngram_e2e"] = e2e_compare(engine, [base + first + base], "ngram", None)
    log("ngram e2e:", out["ngram_e2e"])
    # a perfect drafter (the continuation plain decoding produced): the upper bound of what verification
    # buys at k = 7, and a losslessness check with every draft accepted
    for batch in (1, 8):
        ps = prompts(batch, 256, seed=40 + batch)
        out[f"perfect_drafts_b{batch}"] = e2e_compare(engine, ps, "ngram", "oracle")
        r = out[f"perfect_drafts_b{batch}"]
        log(f"perfect drafts b{batch}:", {k: v for k, v in r.items() if k != "ngram"},
            {k: v for k, v in r["ngram"].items() if k != "policy_log"})
        for entry in r["ngram"]["policy_log"]:
            log("   policy (n, q, graphed, c_plain, c_spec, gain, drafting, waiting, verified):", entry)
    set_spec(engine, "off")
    if args.spec_curve:
        out["gdn_rollback"] = gdn_rollback_costs(cfg, engine.runner.cache.state_dtype)
    res["spec"] = out


def stage_spec_phases(args, res, cfg, engine) -> None:
    """Where a synchronous engine step's time goes with k = 0, 1, 3, 7 (wrong) drafts per sequence at batch 1 and
    8: the forward pass (a CUDA-graph replay where one fits), the LM head, the GDN rollback
    (`ForwardBatch.commit_gdn_states`), the rest of `ModelRunner.execute` (acceptance, sampling, host lists) and of
    the step (scheduling, drafting, bookkeeping), each timed between device syncs (medians of 5 steps, ms)."""
    from vibeqwen.model.state import ForwardBatch

    set_spec(engine, "ngram")
    overlap, engine.async_scheduling = engine.async_scheduling, False
    engine.runner.capture_verify_graphs(64, engine.max_model_len, max_tokens=128, query_lens=[2, 4, 8])
    acc: dict[str, float] = {}

    def timed(name, fn):
        return phase_timed(acc, name, fn)

    runner, model = engine.runner, engine.runner.model
    saved = (runner.forward, model.logits, ForwardBatch.commit_gdn_states, runner.execute)
    runner.forward, model.logits = timed("forward", saved[0]), timed("lm_head", saved[1])
    ForwardBatch.commit_gdn_states = timed("gdn_rollback", saved[2])
    runner.execute = timed("execute", saved[3])
    out = []
    try:
        for batch in (1, 8):
            for i, p in enumerate(prompts(batch, args.context, seed=70 + batch)):
                engine.add_request(f"p{batch}-{i}", p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
            prefill_all(engine)
            for k in (0, 1, 3, 7):
                runs = []
                for _ in range(5):
                    for r in engine.scheduler.running:
                        r.spec_token_ids = [1] * k
                    acc.clear()
                    step = timed_steps(engine, 1)[0]
                    runs.append(dict(acc, step=step, graphed=float(runner.last_graphed)))
                keys = sorted({key for r in runs for key in r})
                row = {key: sorted(r.get(key, 0.0) for r in runs)[2] for key in keys}
                row["execute_rest"] = row.get("execute", 0.0) - sum(row.get(x, 0.0) for x in
                                                                   ("forward", "lm_head", "gdn_rollback"))
                row["step_rest"] = row["step"] - row.get("execute", 0.0)
                row.update(batch=batch, tokens_verified=k + 1)
                out.append(row)
                log("spec step phases:", {key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()})
            abort_all(engine)
    finally:
        ForwardBatch.commit_gdn_states = saved[2]
        del runner.forward, model.logits, runner.execute  # the instance wrappers: back to the class methods
        engine.async_scheduling = overlap
        set_spec(engine, "off")
    res["spec_step_phases"] = out


def stage_spec_mtp(args, res, cfg, engine) -> None:
    """What MTP drafting costs a step on the GPU path: synchronous engine steps at batch 1 and 8 with k = 1, 2, 3
    MTP drafts a sequence (method 'mtp', cost-aware speculation off, so every step verifies its k drafts) next to
    plain steps (k = 0, drafting off), each timed between device syncs, medians of 7 steps (ms). Columns: `step`;
    `forward` (the target's pass: a CUDA-graph replay where one fits, `graphed`); `mtp` (`ModelRunner._mtp`: the
    MTP layer over the step's kept positions, then k - 1 draft passes, each with the LM head; the drafted ids read
    back once); `execute` (the runner's whole step); `drafts` (drafts verified in the step, all sequences).
    On the GPU path, where the MTP layer's MoE runs the GPU kernels (NVFP4 experts), each drafting row runs twice:
    drafting eagerly (`mtp_graphs` false) and from CUDA graphs of the draft passes captured for that batch and k
    (`vibeqwen.model.mtp_graphs`, true). With BF16 MTP experts (the vendors' layout) the graphed rows are left
    out and `spec_mtp_graphs` says why; a capture that fails is recorded in its row (`mtp_graphs_error`).
    The synthetic weights' drafts are almost never accepted, so a step verifies k + 1 tokens a sequence and keeps
    about one: the rows are costs, not speed-ups. Needs the MTP head (main builds the engine with 'mtp+ngram'
    when this stage is asked for); raises RuntimeError without it."""
    runner = engine.runner
    if runner.model.mtp is None:
        raise RuntimeError("stage spec_mtp needs an engine built with the MTP head (speculative method mtp)")
    if runner.graphs is not None:  # the verification graphs a 'mtp' engine with k = 1, 2, 3 would capture
        runner.capture_verify_graphs(64, engine.max_model_len, max_tokens=128, query_lens=[2, 3, 4])
    acc: dict[str, float] = {}

    def timed(name, fn):
        return phase_timed(acc, name, fn)

    overlap, engine.async_scheduling = engine.async_scheduling, False
    runner.forward, runner._mtp = timed("forward", runner.forward), timed("mtp", runner._mtp)
    runner.execute = timed("execute", runner.execute)
    out = []
    graphable = runner.model.fast and runner.graphs is not None and runner.model.mtp.layer.mlp.fast
    if runner.model.fast and not runner.model.mtp.layer.mlp.fast:
        res["spec_mtp_graphs"] = "not capturable: the MTP layer's experts are BF16, its MoE runs the reference loop"
    drafts_seen: dict = {}  # (batch, k) -> the eager row's drafts before each timed step
    try:
        for batch, k, graphed in [(b, k, g) for b in (1, 8) for k in (0, 1, 2, 3)
                                  for g in ((False, True) if k and graphable else (False,))]:
            set_spec(engine, "mtp" if k else "off", max(k, 1), adaptive=False)
            runner.mtp_graphs = None
            if graphed:
                from vibeqwen.model.mtp_graphs import MTPDraftGraphs

                try:
                    runner.mtp_graphs = MTPDraftGraphs(runner.model, runner.cache,
                                                       runner._table_width(engine.max_model_len), [batch], k,
                                                       pool=runner.graphs.pool)
                except Exception as e:  # noqa: BLE001 - the row says why; the eager rows stand
                    out.append({"batch": batch, "mtp_drafts": k, "mtp_graphs": True, "mtp_graphs_error": repr(e)})
                    res["spec_mtp"] = out
                    log("spec mtp step:", out[-1])
                    torch.cuda.empty_cache()
                    continue
            for i, p in enumerate(prompts(batch, args.context, seed=90 + batch)):
                engine.add_request(f"mtp{batch}-{k}-{i}", p,
                                   SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
            prefill_all(engine)
            timed_steps(engine, 2)  # warm-up: the first steps of a shape
            runs, seen = [], []
            for _ in range(7):
                seen.append([list(r.spec_token_ids) for r in engine.scheduler.running])
                drafts = sum(len(d) for d in seen[-1])
                acc.clear()
                step = timed_steps(engine, 1)[0]
                runs.append(dict(acc, step=step, graphed=float(runner.last_graphed), drafts=float(drafts)))
            keys = sorted({key for r in runs for key in r})
            row = {key: sorted(r.get(key, 0.0) for r in runs)[len(runs) // 2] for key in keys}
            row.update(batch=batch, mtp_drafts=k, mtp_graphs=graphed)
            if graphed:  # the same prompts and greedy steps: the graphs must draft what eager drafting did
                row["drafts_equal_eager"] = seen == drafts_seen.get((batch, k))
            else:
                drafts_seen[(batch, k)] = seen
            out.append(row)
            res["spec_mtp"] = out  # each row kept as it comes: a later row's failure keeps the earlier ones
            log("spec mtp step:", {key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()})
            abort_all(engine)
    finally:
        del runner.forward, runner._mtp, runner.execute  # the instance wrappers: back to the class methods
        runner.mtp_graphs = None
        engine.async_scheduling = overlap
        set_spec(engine, "off")
    res["spec_mtp"] = out


def profiled_step(engine: LLMEngine):
    """One engine step under torch.profiler (CPU and CUDA activities): (the profiler, wall ms incl. the sync)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    return prof, (time.perf_counter() - t) * 1e3


def profile_step(engine: LLMEngine, k: int, rows: int = 18) -> dict:
    """One engine step with k (wrong) drafts per running sequence under torch.profiler (CPU and CUDA): the
    host ops by self CPU time and the CUDA kernels by device time, to see where a verification step goes."""

    for r in engine.scheduler.running:
        r.spec_token_ids = [1] * k
    prof, wall = profiled_step(engine)
    ev = prof.key_averages()
    host = [{"op": e.key[:70], "self_cpu_us": e.self_cpu_time_total, "calls": e.count}
            for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:rows]]
    dev = [{"kernel": e.key[:70], "us": e.device_time_total, "calls": e.count}
           for e in sorted(ev, key=lambda e: -e.device_time_total)[:rows]]
    log(f"verify step b{len(engine.scheduler.running)} x {k + 1} tokens under the profiler: {wall:.1f} ms")
    for h in host:
        log(f"   host {h['self_cpu_us']:9.0f} us x{h['calls']:<5} {h['op']}")
    for d in dev:
        log(f"   cuda {d['us']:9.0f} us x{d['calls']:<5} {d['kernel']}")
    return {"wall_ms": wall, "host": host, "cuda": dev}


def e2e_compare(engine: LLMEngine, ps: list[list[int]], method: str, drafter: str | None) -> dict:
    """Greedy tok/s of `ps` without and with speculation; drafter "oracle" proposes the plain run's own
    continuation (every draft right). Returns tok/s, drafted/accepted, mean acceptance length, equality."""
    from vibeqwen.engine import llm_engine

    params = [SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)] * len(ps)
    res, outs = {}, {}
    orig = llm_engine.ngram_propose
    for m in ("off", method):
        set_spec(engine, m)
        if m != "off" and drafter == "oracle":
            n_prompt = len(ps[0])
            assert all(len(p) == n_prompt for p in ps), "the oracle drafter keys prompts of one length"
            plain = {tuple(p): o for p, o in zip(ps, outs["off"])}

            def propose(tokens, k, lo, hi):
                # the plain run's continuation while the output still equals it (after a near-tie divergence
                # nothing: plain decoding, as a lookup miss would); one dict lookup, so the drafter's host
                # time stays small next to the step
                o = plain.get(tuple(tokens[:n_prompt]))
                if o is None:
                    return []
                done = len(tokens) - n_prompt
                return o[done : done + k] if tokens[n_prompt:] == o[:done] else []

            llm_engine.ngram_propose = propose
        st = engine.stats
        # an untimed run first: shapes not run before (speculation's above all) compile kernels on first use
        engine.generate_batch(ps, params)
        s0 = (st.spec_steps_total, st.spec_accepted_total, st.spec_drafted_total, st.steps_total)
        engine.spec_policy_log.clear()
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs[m] = engine.generate_batch(ps, params)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        llm_engine.ngram_propose = orig
        steps, acc, drafted = (st.spec_steps_total - s0[0], st.spec_accepted_total - s0[1],
                               st.spec_drafted_total - s0[2])
        res[m] = {"tok_s": sum(len(o) for o in outs[m]) / dt, "spec_steps": steps, "drafted": drafted,
                  "accepted": acc, "mean_acceptance_length": acc / steps + 1 if steps else None,
                  "engine_steps": st.steps_total - s0[3]}
        if m != "off":  # the cost-aware policy's decisions in this run (LLMEngine.spec_policy_log)
            res[m]["policy_log"] = [list(x) for x in engine.spec_policy_log]
    res["outputs_equal"] = outs["off"] == outs[method]
    res["speedup"] = res[method]["tok_s"] / res["off"]["tok_s"]
    # where the speculative output first differs from plain decoding of that prompt alone (batch 1, its logits
    # kept): both agree on every earlier token, so the plain logits there tell a near-tie (bf16 rounding of two
    # batch shapes) from a real bug (a clear margin), as tests/model/test_gpu_path.py does. The plain run of
    # the same batch is compared the same way: batching alone changes kernel shapes and so rounding, and
    # speculation should part from batch 1 no earlier and at no larger gaps than batching does.
    res["divergences"], res["plain_batch_divergences"] = [], []
    set_spec(engine, "off")
    for p, b, o in zip(ps, outs[method], outs["off"]):
        c, lg = engine_logits(engine, p, len(b))
        for key, seq in (("divergences", b), ("plain_batch_divergences", o)):
            i = next((j for j, (x, y) in enumerate(zip(c, seq)) if x != y), None)
            if i is not None:
                row = lg[i]
                res[key].append({"token": i, "plain": c[i], "spec" if key == "divergences" else "batched": seq[i],
                                 "gap_in_std": ((row.max() - row[seq[i]]) / row.std()).item()})
    for key in ("divergences", "plain_batch_divergences"):
        res[f"max_{key[:-1]}_gap_in_std"] = max((d["gap_in_std"] for d in res[key]), default=None)
    set_spec(engine, "off")
    return res


def gdn_rollback_costs(cfg: ModelConfig, state_dtype: torch.dtype = torch.float32) -> list[dict]:
    """Two ways to end a GDN layer's state at the last accepted token, per layer, timed on the GPU:
    keep the state after every verified token (the recurrent kernel writes [T, Hv, Dk, Dv]; rollback is one
    copy), or save the state before the pass and, on a partial accept, recompute the accepted prefix from it.
    States (slots, per-token, saved) in `state_dtype` (the engine's EngineConfig.gdn_state_dtype)."""
    import triton.testing

    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent

    hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    rows = []
    for b in (1, 8, 32):
        for q in (2, 4, 8):
            t = b * q
            dev = "cuda"
            qk = torch.randn(t, 2 * hk, dk, device=dev, dtype=torch.bfloat16)
            v = torch.randn(t, hv, dv, device=dev, dtype=torch.bfloat16)
            ab = torch.randn(t, 2 * hv, device=dev, dtype=torch.bfloat16)
            a_log = torch.rand(hv, device=dev)
            dt_bias = torch.rand(hv, device=dev)
            states = torch.randn(b + 1, hv, dk, dv, device=dev).to(state_dtype)
            slots = torch.arange(b, device=dev)
            init = torch.ones(b, dtype=torch.bool, device=dev)

            def run(qlen, inter=None):
                qsl = torch.arange(0, b * qlen + 1, qlen, dtype=torch.int32, device=dev)
                n = b * qlen
                return lambda: gdn_recurrent(qk[:n, :hk], qk[:n, hk:], v[:n], ab[:n, :hv], ab[:n, hv:], a_log,
                                             dt_bias, states, slots, qsl, init, qlen, intermediate_states=inter)

            inter = torch.empty(t, hv, dk, dv, device=dev, dtype=state_dtype)
            saved = torch.empty(b, hv, dk, dv, device=dev, dtype=state_dtype)
            keep_us = triton.testing.do_bench(run(q, inter)) * 1e3
            plain_us = triton.testing.do_bench(run(q)) * 1e3
            save_us = triton.testing.do_bench(lambda: saved.copy_(states[:b])) * 1e3
            half = max(1, q // 2)
            recompute_us = triton.testing.do_bench(run(half)) * 1e3 + save_us  # restore + replay the prefix
            rows.append({"batch": b, "tokens_verified": q, "verify_keep_states_us": keep_us,
                         "verify_plain_us": plain_us, "save_state_us": save_us,
                         "recompute_half_us": recompute_us,
                         "keep_total_us": keep_us, "recompute_total_us": plain_us + save_us + recompute_us})
            log("gdn rollback:", rows[-1])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, default=None, help="default /tmp/qwen-full-rs<residual scale>")
    ap.add_argument("--skip-write", action="store_true", help="use --ckpt as it is (never write it)")
    ap.add_argument("--residual-scale", type=float, default=0.05,
                    help="write_checkpoint(residual_scale=...): 1 is chaotic at 40 layers (bf16 and fp32 part "
                         "at once); 0.05 keeps greedy output stable under rounding (bench/bf16_depth.py)")
    ap.add_argument("--stages", default="oracle,decode,prefill")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    ap.add_argument("--oracle-prompts", type=int, default=4)
    ap.add_argument("--prefill-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 8192],
                    help="prompt lengths of the prefill stage (each graphed and eager when prefill graphs are on; a 1-token "
                         "prompt replays a decode graph either way)")
    ap.add_argument("--oracle-long-tokens", type=int, default=960,
                    help="oracle stage: also prompts of this many tokens, with each fp8_prefill mode (0: none)")
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--tie-margin", type=float, default=0.05, help="near-tie: margin below this many logit stds")
    ap.add_argument("--spec-curve", action=argparse.BooleanOptionalAction, default=True,
                    help="spec stage: the step-cost curve, its profiles and the GDN rollback costs (else only "
                         "the end-to-end runs)")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="build the engine with the whole-chunk prefill CUDA graphs (the prefill stage then times "
                         "each size both ways)")
    ap.add_argument("--gdn-state-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="EngineConfig.gdn_state_dtype of every engine built here (the decode floor counts the "
                         "state's bytes in it)")
    args = ap.parse_args()
    if args.ckpt is None:
        args.ckpt = Path(f"/tmp/qwen-full-rs{args.residual_scale:g}")
    cfg = ModelConfig.named("full")
    stages = args.stages.split(",")
    import triton

    res: dict = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": triton.__version__,
                 # the device copy's .git may be stale: the caller's GIT_REV wins
                 "git_rev": os.environ.get("GIT_REV") or subprocess.run(
                     ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()}
    res["copy_bandwidth_tbs"] = copy_bandwidth_tbs("cuda")
    res["bf16_tflops"] = bf16_tflops()
    log(f"copy bandwidth {res['copy_bandwidth_tbs']:.2f} TB/s, bf16 matmul {res['bf16_tflops']:.0f} TFLOP/s")
    res["residual_scale"] = args.residual_scale
    res["gdn_state_dtype"] = args.gdn_state_dtype
    marker = args.ckpt / "synthetic_checkpoint.json"  # how this bench wrote it (seed, residual_scale)
    if args.skip_write:
        res["residual_scale"] = json.loads(marker.read_text())["residual_scale"] if marker.exists() else None
    elif (args.ckpt / "config.json").exists():
        written = json.loads(marker.read_text()) if marker.exists() else {}
        if written.get("residual_scale") != args.residual_scale:
            sys.exit(f"{args.ckpt} holds a checkpoint written with residual_scale "
                     f"{written.get('residual_scale')}, not {args.residual_scale}: pick another --ckpt")
        log(f"{args.ckpt} exists (residual_scale {args.residual_scale}): reusing it")
    else:
        from vibeqwen.checkpoint.writer import write_checkpoint

        t = time.perf_counter()
        write_checkpoint(cfg, args.ckpt, seed=0, device="cuda", residual_scale=args.residual_scale)
        marker.write_text(json.dumps({"seed": 0, "residual_scale": args.residual_scale}))
        res["write_s"] = time.perf_counter() - t
        log(f"checkpoint written in {res['write_s']:.0f} s")

    def save():
        text = json.dumps(res, indent=2) + "\n"
        Path("bench/results").mkdir(parents=True, exist_ok=True)
        Path("bench/results/h200.json").write_text(text)
        if args.json_out:
            args.json_out.write_text(text)

    if "oracle" in stages:
        stage_oracle(args, res, cfg)
        save()
    if any(x in stages for x in ("decode", "prefill", "mixed", "profile", "spec", "spec_phases", "spec_mtp")):
        # drafting's GDN history reserve (~32 GB at 64 sequences x 8 tokens) only where a stage drafts: without
        # it the other stages fit an 80 GB card too
        drafts = bool({"spec", "spec_phases", "spec_mtp"} & set(stages))
        method = "mtp+ngram" if "spec_mtp" in stages else "ngram" if drafts else "off"  # mtp: the head's weights
        engine = make_engine(args.ckpt, spec=SpecConfig(method, 7), max_num_seqs=64,
                             prefill_graphs=args.prefill_graphs, gdn_state_dtype=args.gdn_state_dtype)
        res["prefill_graphs"] = engine.runner.prefill_graphs is not None
        set_spec(engine, "off")  # the spec stage turns drafting on for its own runs; every other stage times without
        from vibeqwen.engine import llm_engine

        baseline = (llm_engine.ngram_propose, engine.async_scheduling, engine.runner.prefill_graphs)
        stage_fns = {"decode": stage_decode, "prefill": stage_prefill, "mixed": stage_mixed, "spec": stage_spec,
                     "profile": stage_profile, "spec_phases": stage_spec_phases, "spec_mtp": stage_spec_mtp}
        for name in stages:  # in the order given; a failing stage is recorded and the next one still runs
            if name not in stage_fns:
                continue
            try:
                stage_fns[name](args, res, cfg, engine)
            except Exception:  # noqa: BLE001 - a bench stage's failure must not cost the other stages' figures
                import traceback

                res.setdefault("stage_errors", {})[name] = traceback.format_exc()
                log(f"stage {name} failed:\n{res['stage_errors'][name]}")
                # what a stage may have changed when it stopped: the drafter, drafting, async scheduling, the
                # prefill graphs, requests (a step in flight under async scheduling commits and finishes)
                llm_engine.ngram_propose = baseline[0]
                engine.async_scheduling, engine.runner.prefill_graphs = baseline[1], baseline[2]
                set_spec(engine, "off")
                try:
                    for r in list(engine.scheduler.running) + list(engine.scheduler.waiting):
                        engine.abort_request(r.request_id)
                    for _ in range(4):
                        if engine.has_unfinished_requests():
                            engine.step()
                except Exception:  # noqa: BLE001
                    log("could not drain the engine after the failure; the remaining stages are skipped")
                    save()
                    break
            save()
        del engine
        gc.collect()
        torch.cuda.empty_cache()

    log(f"\ncopy bandwidth {res['copy_bandwidth_tbs']:.2f} TB/s, bf16 {res['bf16_tflops']:.0f} TFLOP/s, "
        f"HF decode step b1 {res.get('hf_decode_step_ms', {}).get('batch_1', float('nan')):.1f} ms")
    for c in res.get("oracle", {}).get("checks", []):
        log(f"oracle: rel_fro {c['rel_fro']:.3e} max|d| {c['max_abs_diff']:.3f} (logit std {c['logit_std']:.2f}) "
            f"greedy match {c['greedy_all_match']} first mismatch {c['first_mismatch']} near_tie {c.get('near_tie')}")
    for mode, cs in res.get("oracle_long_prompts", {}).get("by_fp8_prefill", {}).items():
        for c in cs:
            log(f"oracle {res['oracle_long_prompts']['prompt_tokens']}-token prompt, fp8_prefill {mode}: rel_fro "
                f"{c['rel_fro']:.3e} (prefill row {c['rel_fro_first_row']:.3e}) max|d| {c['max_abs_diff']:.3f} "
                f"first mismatch {c['first_mismatch']} near_tie {c.get('near_tie')}")
    log("| phase | batch/tokens | ms | floor ms | ratio |")
    log("|---|---|---|---|---|")
    for r in res.get("decode", []):
        sampled = f", sampled {r['sampled_step_ms']:.2f}" if "sampled_step_ms" in r else ""
        log(f"| decode | {r['batch']} @ {r['context_tokens']} | {r['step_ms']:.2f} (sync {r['sync_step_ms']:.2f}{sampled}) | "
            f"{r['floor_ms']:.2f} | {r['step_ms'] / r['floor_ms']:.2f}x |")
    for r in res.get("prefill", []) + res.get("prefill_other_fp8_mode", []):
        kind = (" (graph)" if r.get("graphed") else "") + f" {r.get('fp8_prefill', '')}"
        log(f"| prefill{kind} | {r['tokens']} | {r['ms']:.1f} | {r['floor_ms']:.2f} | "
            f"{r['ms'] / r['floor_ms']:.2f}x |")
    for r in res.get("spec", {}).get("step_cost", []):
        log(f"| verify | b{r['batch']} x {r['tokens_verified']} tok | {r['step_ms']:.2f} | | |")
    for key in ("ngram_e2e", "perfect_drafts_b1", "perfect_drafts_b8"):
        r = res.get("spec", {}).get(key)
        if r:
            log(f"spec {key}: plain {r['off']['tok_s']:.1f} tok/s, speculative {r['ngram']['tok_s']:.1f} tok/s, "
                f"{r['speedup']:.2f}x, acceptance length {r['ngram']['mean_acceptance_length']}, "
                f"equal {r['outputs_equal']}, max gap spec {r['max_divergence_gap_in_std']} "
                f"plain batch {r['max_plain_batch_divergence_gap_in_std']}")
    for name, tb in res.get("stage_errors", {}).items():
        log(f"stage {name} FAILED: {tb.strip().splitlines()[-1]}")


if __name__ == "__main__":
    main()
