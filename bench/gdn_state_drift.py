"""How far a bf16 GDN recurrent state drifts from a float32 one over a long decode (CPU, the reference path).

    python bench/gdn_state_drift.py [--tokens 1024] [--layers 4] [--residual-scale 0.05]

`EngineConfig.gdn_state_dtype = "bfloat16"` rounds each GDN layer's state once per decoded token (the arithmetic
stays float32). This measures whether those roundings accumulate: the same random-weight model (the real GDN head
shapes, 32 value heads of 128 x 128 state, 16 key heads; small hidden size and experts; the real 3:1 GDN /
attention pattern) decodes the same token ids one at a time (teacher forcing: both runs see identical inputs)
with float32 activations, once with float32 and once with bfloat16 state slots, and prints the relative logit
difference by position window and the argmax agreement. Activations are float32 so the difference is the state
rounding alone. Caveat: the synthetic checkpoint's decay gates (A_log, dt_bias) are random, not the trained
model's; a model whose gates keep memory longer would carry a rounding longer.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "model"))
from seqrun import Sequences

from vibeqwen.checkpoint.loader import load_checkpoint
from vibeqwen.checkpoint.writer import write_checkpoint
from vibeqwen.config import ModelConfig
from vibeqwen.model.qwen import Qwen3_5MoeForCausalLM
from vibeqwen.model.weights import Weights


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--residual-scale", type=float, default=0.05)
    ap.add_argument("--windows", type=int, default=8, help="position windows to report")
    args = ap.parse_args()
    tiny = ModelConfig.named("tiny")
    pattern = tuple(["linear_attention"] * 3 + ["full_attention"]) * 10
    cfg = dataclasses.replace(
        tiny, num_hidden_layers=args.layers, layer_types=pattern[: args.layers], vocab_size=4096, eos_token_id=None,
        hidden_size=256, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, max_position_embeddings=max(4096, args.tokens + 8))
    ckpt = load_checkpoint(write_checkpoint(cfg, Path(tempfile.mkdtemp()) / "ckpt", seed=0,
                                            residual_scale=args.residual_scale))
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    model = Qwen3_5MoeForCausalLM.from_weights(cfg, Weights(ckpt.tensors, ckpt.precisions, torch.float32))
    logits = {}
    for state_dtype in (torch.float32, torch.bfloat16):
        seqs = Sequences(model, num_seqs=1, max_len=args.tokens + 8, state_dtype=state_dtype)
        logits[state_dtype] = torch.cat([seqs.run({0: [t]}) for t in ids]).float()  # one decode step per token
    a, b = logits[torch.bfloat16], logits[torch.float32]
    print(f"{args.layers} layers ({sum(t == 'linear_attention' for t in cfg.layer_types)} GDN), {args.tokens} decode "
          f"steps, residual scale {args.residual_scale:g}, float32 activations")
    print("| positions | bf16-state vs fp32-state logits, relative | worst position (relative) | argmax agreement |")
    print("|---|---|---|---|")
    per_pos = (a - b).norm(dim=-1) / b.norm(dim=-1)
    step = max(1, args.tokens // args.windows)
    for lo in range(0, args.tokens, step):
        hi = min(args.tokens, lo + step)
        rel = ((a[lo:hi] - b[lo:hi]).norm() / b[lo:hi].norm()).item()
        worst = lo + int(per_pos[lo:hi].argmax())
        agree = (a[lo:hi].argmax(-1) == b[lo:hi].argmax(-1)).float().mean().item()
        print(f"| {lo}-{hi - 1} | {rel:.3e} | {worst} ({per_pos[worst].item():.2e}) | {agree:.3f} |", flush=True)


if __name__ == "__main__":
    main()
