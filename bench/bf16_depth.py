"""How far bf16 drifts from fp32 on a random-weight model, by depth (CPU, the reference path).

    python bench/bf16_depth.py

The synthetic checkpoints have random weights, which make the network chaotic: a rounding difference in
one layer grows in the next. This runs our reference path in float32 and in bfloat16 on the same weights
(tiny dimensions, 4..40 layers of the real 3:1 GDN/attention pattern) and prints the relative logit
difference and the argmax agreement on a 64-token prompt. It is the yardstick for GPU-vs-oracle
comparisons at full depth (bench/results/h200_notes.md, "Accuracy").
"""

from __future__ import annotations

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
    tiny = ModelConfig.named("tiny")
    pattern = tuple(["linear_attention"] * 3 + ["full_attention"]) * 10
    print("| layers | bf16 vs fp32 logits, relative | argmax agreement |")
    print("|---|---|---|")
    for depth in (4, 8, 16, 40):
        cfg = dataclasses.replace(tiny, num_hidden_layers=depth, layer_types=pattern[:depth], vocab_size=4096,
                                  eos_token_id=None)
        ckpt = load_checkpoint(write_checkpoint(cfg, Path(tempfile.mkdtemp()) / "ckpt", seed=0))
        ids = torch.randint(0, 4096, (64,), generator=torch.Generator().manual_seed(1)).tolist()
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            model = Qwen3_5MoeForCausalLM.from_weights(cfg, Weights(ckpt.tensors, ckpt.precisions, dtype))
            out[dtype] = Sequences(model, num_seqs=1).run({0: ids}).float()
        a, b = out[torch.bfloat16], out[torch.float32]
        print(f"| {depth} | {((a - b).norm() / b.norm()).item():.3e} | "
              f"{(a.argmax(-1) == b.argmax(-1)).float().mean().item():.2f} |", flush=True)


if __name__ == "__main__":
    main()
