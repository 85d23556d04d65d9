"""Synthetic checkpoints in the exact on-disk layout of the vendor's NVFP4 release (random values).

`write_checkpoint(cfg, out_dir)` writes sharded safetensors with the real tensor names, dtypes and
shapes (ModelOpt MIXED_PRECISION: NVFP4 experts / shared experts / lm_head, FP8 attention and GDN
projections, BF16 elsewhere), plus `config.json`, `hf_quant_config.json`, `generation_config.json` and the
real Qwen3.6 tokenizer files. Values are random but scaled like a trained network (unit-variance
activations), so the forward pass is numerically well behaved. Generation is deterministic in `seed` and
independent of shard size and device.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from vibeqwen.checkpoint.layout import Module, Precision, checkpoint_modules, hf_quant_config
from vibeqwen.checkpoint.quant import fp8_quantize, input_scale_for, nvfp4_quantize
from vibeqwen.config import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 4 << 30
# Activation range assumed for the `input_scale` tensors (a real export calibrates them).
ASSUMED_INPUT_AMAX = 16.0

GENERATION_CONFIG = {
    "bos_token_id": 248044,
    "pad_token_id": 248044,
    "eos_token_id": [248046, 248044],
    "do_sample": True,
    "temperature": 1.0,
    "top_p": 0.95,
    "top_k": 20,
}


def _module_seed(seed: int, path: str) -> int:
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _random_dense(m: Module, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """A float32 tensor for module `m` with a scale that keeps activations near unit variance."""
    name = m.path.rsplit(".", 1)[-1]
    shape = m.shape
    randn = lambda: torch.randn(shape, generator=gen, device=device, dtype=torch.float32)  # noqa: E731
    if name == "A_log":
        # decay rates A in [1, 16], as the model's init draws them
        return torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen).log()
    if name == "dt_bias":
        return 1.0 + 0.5 * randn()
    if name == "conv1d":
        return randn() / math.sqrt(shape[-1])
    if name == "embed_tokens":
        return randn()
    if name == "norm" and ".linear_attn." in m.path:
        return 1.0 + 0.1 * randn()  # gated RMSNorm: plain weight around 1
    if len(shape) == 1:
        return 0.1 * randn()  # zero-centred RMSNorm weights: y = norm(x) * (1 + w)
    return randn() / math.sqrt(shape[-1])  # linear [N, K]: std 1/sqrt(K)


def module_tensors(m: Module, seed: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The stored tensors of module `m` (CPU), quantized per its precision. Deterministic in (seed, path)."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(_module_seed(seed, m.path))
    w = _random_dense(m, gen, device)
    if m.precision == Precision.NVFP4:
        packed, block_scale, global_scale = nvfp4_quantize(w)
        out = {
            f"{m.path}.weight": packed,
            f"{m.path}.weight_scale": block_scale,
            f"{m.path}.weight_scale_2": global_scale.reshape(()),
            f"{m.path}.input_scale": input_scale_for(ASSUMED_INPUT_AMAX, kind="nvfp4").reshape(()),
        }
    elif m.precision == Precision.FP8:
        q, scale = fp8_quantize(w)
        out = {
            f"{m.path}.weight": q,
            f"{m.path}.weight_scale": scale.reshape(()),
            f"{m.path}.input_scale": input_scale_for(ASSUMED_INPUT_AMAX, kind="fp8").reshape(()),
        }
    else:
        name = f"{m.path}.{m.leaf}" if m.leaf else m.path
        out = {name: w.to(torch.bfloat16)}
    return {k: v.contiguous().cpu() for k, v in out.items()}


def hf_config(cfg: ModelConfig) -> dict:
    """The multimodal `config.json` of the release: text config nested under `text_config`."""
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": cfg.to_hf_text_config(),
        "vision_config": {"model_type": "qwen3_5_moe_vision", "out_hidden_size": cfg.hidden_size},
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }


def write_checkpoint(
    cfg: ModelConfig,
    out_dir: str | Path,
    seed: int = 0,
    device: torch.device | str = "cpu",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write a synthetic vendor-layout checkpoint for `cfg` into `out_dir` (created; must be empty or absent).

    Tensors are generated on `device` (a GPU makes the full-size model take minutes) and streamed to
    shards of at most ~`max_shard_bytes`. Raises FileExistsError if `out_dir` holds files.
    Returns the directory path.
    """
    from vibeqwen.tokenizer import write_tokenizer_files

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; choose a new directory for the checkpoint")
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    shard_files: list[tuple[str, list[str]]] = []
    total = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if not shard:
            return
        name = f"shard-{len(shard_files):05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        shard_files.append((name, list(shard)))
        shard, shard_bytes = {}, 0

    for m in checkpoint_modules(cfg):
        tensors = module_tensors(m, seed, device)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
        shard.update(tensors)
        shard_bytes += size
        total += size
    flush()

    weight_map = {}
    n = len(shard_files)
    for i, (tmp_name, names) in enumerate(shard_files):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(tmp / tmp_name, tmp / final)
        weight_map.update({k: final for k in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    (tmp / "hf_quant_config.json").write_text(json.dumps(hf_quant_config(cfg), indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    write_tokenizer_files(tmp)
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    log.info("wrote %s: %d shards, %.1f MB", out, n, total / 1e6)
    return out
