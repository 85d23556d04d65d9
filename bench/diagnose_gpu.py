"""Module-by-module comparison of the GPU path with the reference path, at the real shapes, on a GPU.

    python bench/diagnose_gpu.py [--layers 4]

Builds the full model's shapes cut to `--layers` layers, loads it twice (GPU path and, with
VIBEQWEN_REFERENCE=1, the PyTorch reference path, both bf16 on the GPU), and feeds each module the same
input: every mixer (prefill of 64 tokens, then one decode token, then a 3-token extend), every MoE block,
the LM head and the whole forward pass. Prints the relative (Frobenius) difference of each; bf16 rounding
gives ~1e-2, a bug O(1).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

import torch

from vibeqwen.checkpoint.loader import load_checkpoint
from vibeqwen.checkpoint.writer import write_checkpoint
from vibeqwen.config import ModelConfig
from vibeqwen.model.cache import ModelCache
from vibeqwen.model.layers import rotary_cos_sin
from vibeqwen.model.qwen import Qwen3_5MoeForCausalLM
from vibeqwen.model.state import ForwardBatch
from vibeqwen.model.weights import Weights


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--oracle", action="store_true",
                    help="also score against HF transformers in float32 (and our reference path in float32)")
    ap.add_argument("--skip-modules", action="store_true")
    args = ap.parse_args()
    full = ModelConfig.named("full")
    cfg = dataclasses.replace(full, num_hidden_layers=args.layers, layer_types=tuple(full.layer_types[: args.layers]))
    path = write_checkpoint(cfg, tempfile.mkdtemp() + "/mini", seed=0, device="cuda")
    ckpt = load_checkpoint(path, device="cuda")
    models = {}
    for ref in ("1", "0"):
        os.environ["VIBEQWEN_REFERENCE"] = ref
        models["ref" if ref == "1" else "gpu"] = Qwen3_5MoeForCausalLM.from_weights(
            cfg, Weights(ckpt.tensors, ckpt.precisions, torch.bfloat16, "cuda"))
    assert models["gpu"].fast and not models["ref"].fast
    torch.manual_seed(0)
    dev = "cuda"
    passes = [(64, 0), (1, 64), (3, 65)]  # (new tokens, context)
    xs = [torch.randn(n, cfg.hidden_size, device=dev, dtype=torch.bfloat16) for n, _ in passes]
    with torch.inference_mode():
        for i in range(0 if args.skip_modules else cfg.num_hidden_layers):
            outs = {}
            for name, m in models.items():
                cache = ModelCache(cfg, 16, 16, 2, torch.bfloat16, dev)
                layer = m.layers[i]
                res = []
                for (n, c), x in zip(passes, xs):
                    b = ForwardBatch(cache, [n], [c], [[3, 5, 7, 9, 11]], [1])
                    if name == "gpu":
                        res.append(layer.mixer.forward_gpu(x, b))
                    elif layer.is_attention:
                        cos, sin = rotary_cos_sin(b.positions(dev), cfg.rotary_dim, cfg.rope_theta, x.dtype)
                        res.append(layer.mixer(x, cos, sin, b))
                    else:
                        res.append(layer.mixer(x, b))
                outs[name] = res
            kind = "attention" if models["ref"].layers[i].is_attention else "gdn"
            print(f"layer {i} {kind:9s} mixer: " + ", ".join(
                f"{n}@{c} {rel(g, r):.2e}" for (n, c), g, r in zip(passes, outs["gpu"], outs["ref"])), flush=True)
            x = xs[0]
            print(f"layer {i} moe: {rel(models['gpu'].layers[i].mlp(x), models['ref'].layers[i].mlp(x)):.2e}; "
                  f"decode row {rel(models['gpu'].layers[i].mlp(x[:1]), models['ref'].layers[i].mlp(x[:1])):.2e}",
                  flush=True)
        h = xs[0]
        print(f"lm_head: {rel(models['gpu'].logits(h), models['ref'].logits(h)):.2e}")
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 248044, (64,), generator=g).to(dev)
        logits = {}
        for name, m in models.items():
            cache = ModelCache(cfg, 16, 16, 2, torch.bfloat16, dev)
            b = ForwardBatch(cache, [64], [0], [[3, 5, 7, 9]], [1])
            logits[name] = m.logits(m.forward(ids, b.positions(dev), b))
        print(f"whole forward (64-token prefill) logits: {rel(logits['gpu'], logits['ref']):.2e}; "
              f"argmax agree {(logits['gpu'].argmax(-1) == logits['ref'].argmax(-1)).float().mean():.2f}")
    if not args.oracle:
        return
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "model"))
    from oracle import hf_model

    os.environ["VIBEQWEN_REFERENCE"] = "1"
    ref32 = Qwen3_5MoeForCausalLM.from_weights(cfg, Weights(ckpt.tensors, ckpt.precisions, torch.float32, "cuda"))
    with torch.inference_mode():
        cache = ModelCache(cfg, 16, 16, 2, torch.float32, dev)
        b = ForwardBatch(cache, [64], [0], [[3, 5, 7, 9]], [1])
        logits["ref_fp32"] = ref32.logits(ref32.forward(ids, b.positions(dev), b))
        del ref32
        oracle = hf_model(ckpt, torch.float32, meta_init=True)
        hf = oracle(ids[None]).logits[0].float()
    for name in ("ref_fp32", "ref", "gpu"):
        print(f"vs HF fp32 oracle: {name:8s} rel {rel(logits[name], hf):.2e} "
              f"argmax agree {(logits[name].argmax(-1) == hf.argmax(-1)).float().mean():.2f}")


if __name__ == "__main__":
    main()
