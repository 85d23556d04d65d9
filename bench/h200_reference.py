"""Full-size synthetic checkpoint on an H200: build it, load it, and time the reference forward pass.

    python bench/h200_reference.py --out /tmp/qwen-full [--skip-write]

1. Builds the full-size Qwen3.6-35B-A3B checkpoint in the vendor NVFP4 layout, generating and quantizing on
   the GPU (`write_checkpoint(..., device="cuda")`), and reports the time and size.
2. Loads it with the validating loader: time, MB/s, peak host memory (ru_maxrss).
3. Builds the PyTorch reference model on the GPU in bf16 (weights dequantized once) and times one engine
   step: decode at batch 1 and 8 with 1k-token contexts, and a 1k-token prefill. This is the reference path
   (per-expert loops, no fused kernels, no CUDA graphs), the baseline the GPU issue's kernels replace; the
   roofline floor printed beside it is bytes the step must move / measured copy bandwidth (DESIGN.md s3).
Prints a short table last and writes bench/results/h200_reference.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import time
from pathlib import Path

import torch

from vibeqwen.checkpoint.loader import load_checkpoint
from vibeqwen.checkpoint.writer import write_checkpoint
from vibeqwen.config import ModelConfig
from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
from vibeqwen.model.qwen import Qwen3_5MoeForCausalLM
from vibeqwen.model.weights import Weights
from vibeqwen.sampling import SamplingParams
from vibeqwen.tokenizer import Tokenizer


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth_tbs(dev: str) -> float:
    x = torch.empty((2 << 30) if dev == "cuda" else (64 << 20), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(dev)
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(dev)
    return 2 * x.numel() * 10 / (time.perf_counter() - t) / 1e12


def decode_floor_bytes(cfg: ModelConfig, batch: int, ctx: int, state_bytes: int = 4) -> float:
    """Bytes one decode step moves (DESIGN.md section 3), vendor mixed layout. state_bytes: bytes per element of
    the GDN recurrent state, read and written once per sequence and layer (4: float32, 2: EngineConfig
    gdn_state_dtype "bfloat16")."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    expert = 3 * h * i * 0.5625
    distinct = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch)
    routed = distinct * expert * cfg.num_hidden_layers
    shared = expert * cfg.num_hidden_layers
    attn = len(cfg.attention_layers) * (2 * cfg.num_attention_heads * cfg.head_dim * h + 2 * cfg.num_key_value_heads
                                        * cfg.head_dim * h + cfg.num_attention_heads * cfg.head_dim * h)
    gdn = len(cfg.gdn_layers) * (cfg.gdn_conv_dim * h + 2 * cfg.gdn_value_dim * h)
    lm = cfg.vocab_size * h * 0.5625
    routers = cfg.num_hidden_layers * cfg.num_experts * h * 2
    state = (batch * len(cfg.gdn_layers) * cfg.linear_num_value_heads * cfg.linear_key_head_dim
             * cfg.linear_value_head_dim * state_bytes * 2)
    kv = batch * ctx * len(cfg.attention_layers) * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    return routed + shared + attn + gdn + lm + routers + state + kv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/qwen-full")
    ap.add_argument("--skip-write", action="store_true")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--config", default="full", help="'full', or 'tiny' for a CPU smoke test of this script")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    cfg = ModelConfig.named(args.config)
    dev = args.device
    res: dict = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
                 "git_rev": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()}
    res["copy_bandwidth_tbs"] = bw = copy_bandwidth_tbs(dev)
    out = Path(args.out)
    if not args.skip_write:
        t = time.perf_counter()
        write_checkpoint(cfg, out, seed=0, device=dev)
        res["write_s"] = time.perf_counter() - t
    res["checkpoint_gb"] = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e9
    print(f"checkpoint: {res['checkpoint_gb']:.1f} GB, written in {res.get('write_s', 0):.0f} s", flush=True)

    t = time.perf_counter()
    ckpt = load_checkpoint(out)
    res["load_s"] = time.perf_counter() - t
    res["load_gb_s"] = res["checkpoint_gb"] / res["load_s"]
    res["peak_host_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"loaded in {res['load_s']:.1f} s ({res['load_gb_s']:.2f} GB/s), peak RSS {res['peak_host_rss_gb']:.1f} GB",
          flush=True)

    t = time.perf_counter()
    model = Qwen3_5MoeForCausalLM.from_weights(cfg, Weights(ckpt.tensors, ckpt.precisions, torch.bfloat16, dev))
    del ckpt
    sync(dev)
    res["build_s"] = time.perf_counter() - t
    engine = LLMEngine(model, Tokenizer.from_dir(out), "full", EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=8192, gpu_memory_utilization=0.85, dtype="bfloat16", device=dev))
    print(f"model built in {res['build_s']:.0f} s", flush=True)

    g = torch.Generator().manual_seed(0)
    rows = []
    for batch in (1, 8):
        for i in range(batch):
            prompt = torch.randint(0, 248044, (args.context,), generator=g).tolist()
            engine.add_request(f"b{batch}-{i}", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        sync(dev)
        t = time.perf_counter()
        while engine.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running):
            engine.step()
        sync(dev)
        prefill_s = time.perf_counter() - t
        times = []
        while engine.has_unfinished_requests():
            sync(dev)
            t = time.perf_counter()
            engine.step()
            sync(dev)
            times.append(time.perf_counter() - t)
        step_ms = sorted(times)[len(times) // 2] * 1e3
        floor_ms = decode_floor_bytes(cfg, batch, args.context) / (bw * 1e12) * 1e3
        rows.append({"batch": batch, "context_tokens": args.context, "step_ms": step_ms, "floor_ms": floor_ms,
                     "prefill_ms_total": prefill_s * 1e3})
        print(rows[-1], flush=True)
    res["decode_reference"] = rows
    if dev == "cuda" and args.config == "full":
        Path("bench/results").mkdir(parents=True, exist_ok=True)
        Path("bench/results/h200_reference.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"\ncopy bandwidth {bw:.2f} TB/s; checkpoint {res['checkpoint_gb']:.1f} GB written in "
          f"{res.get('write_s', 0):.0f} s, loaded in {res['load_s']:.1f} s, peak host RSS {res['peak_host_rss_gb']:.1f} GB")
    print("| batch | context | reference step ms | floor ms | ratio | prefill (all seqs) ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['context_tokens']} | {r['step_ms']:.1f} | {r['floor_ms']:.2f} | "
              f"{r['step_ms'] / r['floor_ms']:.0f}x | {r['prefill_ms_total']:.0f} |")


if __name__ == "__main__":
    main()
