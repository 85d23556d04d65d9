"""How far bf16 drifts from fp32 on a random-weight model, by depth (CPU, the reference path).

    python bench/bf16_depth.py [--residual-scales 1,0.1,0.05]

The synthetic checkpoints have random weights, which make the network chaotic: a rounding difference in
one layer grows in the next. This runs our reference path in float32 and in bfloat16 on the same weights
(tiny dimensions, 4..40 layers of the real 3:1 GDN/attention pattern) and prints the relative logit
difference and the argmax agreement on a 64-token prompt. It is the yardstick for GPU-vs-oracle
comparisons at full depth (bench/results/h200_notes.md, "Accuracy"). With `--residual-scales`, the same for
checkpoints whose residual-stream projections are scaled down (`write_checkpoint(residual_scale=...)`): the
setting the GPU bench uses for token-level comparisons.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "model"))
from seqrun import Sequences  # noqa: E402

from vibeqwen.checkpoint.loader import load_checkpoint  # noqa: E402
from vibeqwen.checkpoint.writer import write_checkpoint  # noqa: E402
from vibeqwen.config import ModelConfig  # noqa: E402
from vibeqwen.model.qwen import Qwen3_5MoeForCausalLM  # noqa: E402
from vibeqwen.model.weights import Weights  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--residual-scales", default="1", type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--depths", default="4,8,16,40", type=lambda s: [int(x) for x in s.split(",")])
    args = ap.parse_args()
    tiny = ModelConfig.named("tiny")
    pattern = tuple(["linear_attention"] * 3 + ["full_attention"]) * 10
    print("| residual scale | layers | bf16 vs fp32 logits, relative | argmax agreement |")
    print("|---|---|---|---|")
    for scale, depth in [(s, d) for s in args.residual_scales for d in args.depths]:
        cfg = dataclasses.replace(tiny, num_hidden_layers=depth, layer_types=pattern[:depth], vocab_size=4096,
                                  eos_token_id=None)
        ckpt = load_checkpoint(write_checkpoint(cfg, Path(tempfile.mkdtemp()) / "ckpt", seed=0,
                                                residual_scale=scale))
        ids = torch.randint(0, 4096, (64,), generator=torch.Generator().manual_seed(1)).tolist()
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            model = Qwen3_5MoeForCausalLM.from_weights(cfg, Weights(ckpt.tensors, ckpt.precisions, dtype))
            out[dtype] = Sequences(model, num_seqs=1).run({0: ids}).float()
        a, b = out[torch.bfloat16], out[torch.float32]
        print(f"| {scale:g} | {depth} | {((a - b).norm() / b.norm()).item():.3e} | "
              f"{(a.argmax(-1) == b.argmax(-1)).float().mean().item():.2f} |", flush=True)


if __name__ == "__main__":
    main()
