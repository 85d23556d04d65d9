"""The correctness oracle: HF transformers' Qwen3_5MoeForCausalLM on our checkpoint's dequantized weights."""

from __future__ import annotations

import torch

from vibeqwen.checkpoint.loader import Checkpoint
from vibeqwen.model.layers import dequantize_module


def hf_state_dict(ckpt: Checkpoint, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Map the vendor-layout tensors onto HF's `Qwen3_5MoeForCausalLM` parameter names.

    model.language_model.* -> model.*; per-expert gate/up/down -> fused experts.gate_up_proj [E, 2I, H]
    and experts.down_proj [E, H, I]; quantized modules are dequantized. MTP is not part of the oracle.
    """
    cfg = ckpt.config
    out: dict[str, torch.Tensor] = {}
    dense = lambda p: dequantize_module(ckpt.tensors, p, ckpt.precisions[p], dtype)  # noqa: E731
    for path, prec in ckpt.precisions.items():
        if path.startswith("mtp.") or ".mlp.experts." in path:
            continue
        hf = path.replace("model.language_model.", "model.")
        if path.endswith(("A_log", "dt_bias")):
            out[hf] = ckpt.tensors[path].to(dtype)
        else:
            out[hf + ".weight"] = dense(path)
    for i in range(cfg.num_hidden_layers):
        p = f"model.language_model.layers.{i}.mlp.experts."
        e = range(cfg.num_experts)
        gate_up = [torch.cat([dense(f"{p}{j}.gate_proj"), dense(f"{p}{j}.up_proj")]) for j in e]
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([dense(f"{p}{j}.down_proj") for j in e])
    return out


def hf_model(ckpt: Checkpoint, dtype=torch.float32, meta_init: bool = False):
    """An eager-attention HF model holding exactly our checkpoint's (dequantized) weights."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    text = ckpt.config.to_hf_text_config()
    text.pop("model_type")
    text.pop("dtype")
    hf_cfg = Qwen3_5MoeTextConfig(**text)
    hf_cfg._attn_implementation = "eager"
    if not meta_init:
        model = Qwen3_5MoeForCausalLM(hf_cfg).to(dtype).eval()
        missing, unexpected = model.load_state_dict(hf_state_dict(ckpt, dtype), strict=False)
    else:
        # full size: no random init and no second copy; the weights are assigned where hf_state_dict made
        # them (the checkpoint tensors' device), and the rotary buffers are rebuilt there
        with torch.device("meta"):
            model = Qwen3_5MoeForCausalLM(hf_cfg)
        missing, unexpected = model.load_state_dict(hf_state_dict(ckpt, dtype), strict=False, assign=True)
        device = ckpt.tensors[next(iter(ckpt.tensors))].device
        model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_cfg).to(device)
        model = model.eval()
    if missing or unexpected:
        raise AssertionError(f"oracle weights do not line up: missing={missing} unexpected={unexpected}")
    return model
