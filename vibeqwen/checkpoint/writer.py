"""Synthetic checkpoints (random values) in every layout the loader accepts.

`write_checkpoint(cfg, out_dir, fmt=...)` writes sharded safetensors with the real tensor names, dtypes
and shapes, plus `config.json`, `generation_config.json` and the real Qwen3.6 tokenizer files:

- `modelopt` (default): the vendor's NVFP4 release (ModelOpt MIXED_PRECISION: NVFP4 experts / shared
  experts / lm_head, FP8 attention and GDN projections, BF16 elsewhere including `mtp.*`) with
  `hf_quant_config.json`. Variants: experts fused (`fused_experts=True`), scalars stored as [1]
  (`scalar_shape=(1,)`), the quantization config folded into `config.json` (`quant_config_in="config"`).
- `compressed-tensors`: llm-compressor `nvfp4-pack-quantized` (experts, shared experts and self-attention
  NVFP4 with reciprocal global scales; lm_head, routers and all GDN projections BF16), no `mtp.*` by default.
- `bf16`: the original release (experts fused as `mlp.experts.gate_up_proj` / `down_proj`).

Every layout also carries two tiny `model.visual.*` tensors (the loader must skip them). All layouts of one
`seed` hold the same underlying BF16 weights ("master" weights, random but scaled like a trained network:
unit-variance activations), so they can be compared with each other and with the HF oracle. The ModelOpt
layout is what ModelOpt's exporter makes of those BF16 weights (gate and up share one amax per expert and
in the shared expert), the compressed-tensors layout what llm-compressor makes of them (gate/up and q/k/v
share one global scale). Generation is deterministic in `seed` and independent of shard size and device.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from vibeqwen.checkpoint.formats import CT_NVFP4_FORMAT, LAYOUTS, QUANT_FILE, ct_precision
from vibeqwen.checkpoint.layout import Module, Precision, checkpoint_modules, hf_quant_config
from vibeqwen.checkpoint.quant import ct_nvfp4_quantize, fp8_quantize, input_scale_for, nvfp4_quantize
from vibeqwen.config import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 4 << 30
# Activation range assumed for the `input_scale` tensors (a real export calibrates them).
ASSUMED_INPUT_AMAX = 16.0
# Two stand-ins for the vision tower, which the text-only loader must skip without reading.
VISION_TENSORS = {
    "model.visual.patch_embed.proj.weight": (16, 3, 2, 4, 4),
    "model.visual.merger.norm.weight": (16,),
}

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


# the projections that write a block's output into the residual stream
RESIDUAL_OUTPUTS = ("o_proj", "out_proj", "down_proj")


def _random_dense(m: Module, gen: torch.Generator, device: torch.device, residual_scale: float = 1.0) -> torch.Tensor:
    """A float32 tensor for module `m` with a scale that keeps activations near unit variance (the
    projections into the residual stream times `residual_scale`)."""
    name = m.path.rsplit(".", 1)[-1]
    shape = m.shape
    randn = lambda: torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
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
    w = randn() / math.sqrt(shape[-1])  # linear [N, K]: std 1/sqrt(K)
    return w * residual_scale if name in RESIDUAL_OUTPUTS else w


def master_weight(m: Module, seed: int, device: torch.device | str = "cpu", residual_scale: float = 1.0
                  ) -> torch.Tensor:
    """The BF16 weight of module `m` that every layout of this `seed` encodes (deterministic in seed, path
    and residual_scale)."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(_module_seed(seed, m.path))
    return _random_dense(m, gen, device, residual_scale).to(torch.bfloat16)


def _amax(*ws: torch.Tensor) -> torch.Tensor:
    return torch.stack([w.abs().amax() for w in ws]).amax().float()


def _units(mods: list[Module]) -> list[list[Module]]:
    """Modules grouped as an exporter sees them: all experts of a layer; shared-expert gate+up; q/k/v."""
    def same_unit(prev: str, path: str) -> bool:
        if ".mlp.experts." in path:
            layer = path.split(".mlp.experts.")[0]
            return ".mlp.experts." in prev and prev.split(".mlp.experts.")[0] == layer
        if path.endswith("shared_expert.up_proj"):
            return prev.endswith("shared_expert.gate_proj")
        return path.endswith(("self_attn.k_proj", "self_attn.v_proj")) and prev.endswith(
            ("self_attn.q_proj", "self_attn.k_proj"))

    units: list[list[Module]] = []
    for m in mods:
        if units and same_unit(units[-1][-1].path, m.path):
            units[-1].append(m)
        else:
            units.append([m])
    return units


def _pairs(unit: list[Module]) -> list[list[Module]]:
    """Sub-groups whose quantizers are fused by the exporters: each expert's (gate, up) and (down); the
    shared expert's (gate, up); q/k/v together; everything else alone."""
    if ".mlp.experts." in unit[0].path:
        return [unit[i:i + 2] if unit[i].path.endswith("gate_proj") else [unit[i]]
                for i in range(len(unit)) if not unit[i].path.endswith("up_proj")]
    return [unit]


class _Encoder:
    """Turns one unit's BF16 master weights into stored tensors for one layout."""

    def __init__(self, cfg: ModelConfig, fmt: str, fused_experts: bool, scalar_shape: tuple[int, ...],
                 ct_config: dict | None):
        self.cfg, self.fmt, self.fused, self.scalar_shape, self.ct_config = (
            cfg, fmt, fused_experts, scalar_shape, ct_config)

    def __call__(self, unit: list[Module], w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.fused and ".mlp.experts." in unit[0].path:
            return self._fused_experts(unit, w)
        out: dict[str, torch.Tensor] = {}
        for group in _pairs(unit):
            if self.fmt == "compressed-tensors":
                out.update(self._ct(group, w))
            else:
                out.update(self._modelopt(group, w))
        return out

    def _scalar(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.scalar_shape)

    def _modelopt(self, group: list[Module], w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # ModelOpt fuses NVFP4 layers that share an input (gate/up): one amax, one weight_scale_2.
        # FP8 groups (q/k/v) are not fused: each keeps its own scale. bf16 layout: precision BF16.
        out: dict[str, torch.Tensor] = {}
        amax = _amax(*(w[m.path] for m in group))
        for m in group:
            prec = m.precision if self.fmt == "modelopt" else Precision.BF16
            if prec == Precision.NVFP4:
                packed, block_scale, global_scale = nvfp4_quantize(w[m.path], amax=amax)
                out.update({
                    f"{m.path}.weight": packed,
                    f"{m.path}.weight_scale": block_scale,
                    f"{m.path}.weight_scale_2": self._scalar(global_scale),
                    f"{m.path}.input_scale": self._scalar(input_scale_for(ASSUMED_INPUT_AMAX, kind="nvfp4")),
                })
            elif prec == Precision.FP8:
                q, scale = fp8_quantize(w[m.path])
                out.update({
                    f"{m.path}.weight": q,
                    f"{m.path}.weight_scale": self._scalar(scale),
                    f"{m.path}.input_scale": self._scalar(input_scale_for(ASSUMED_INPUT_AMAX, kind="fp8")),
                })
            else:
                out[f"{m.path}.{m.leaf}" if m.leaf else m.path] = w[m.path]
        return out

    def _ct(self, group: list[Module], w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # llm-compressor gives fused layers (q/k/v, gate/up) one global scale: that of the largest amax.
        out: dict[str, torch.Tensor] = {}
        quantized = [m for m in group if ct_precision(self.ct_config, m) == Precision.NVFP4]
        amax = _amax(*(w[m.path] for m in quantized)) if quantized else None
        input_gs = (6.0 * 448.0 / torch.tensor(ASSUMED_INPUT_AMAX)).reshape(1)
        for m in group:
            if m in quantized:
                packed, block_scale, global_scale = ct_nvfp4_quantize(w[m.path], amax=amax)
                out.update({
                    f"{m.path}.weight_packed": packed,
                    f"{m.path}.weight_scale": block_scale,
                    f"{m.path}.weight_global_scale": global_scale.reshape(1),
                    f"{m.path}.input_global_scale": input_gs.clone(),
                })
            else:
                out[f"{m.path}.{m.leaf}" if m.leaf else m.path] = w[m.path]
        return out

    def _fused_experts(self, unit: list[Module], w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # [E, 2I, H] gate rows then up rows per expert (HF Qwen3_5MoeExperts.gate_up_proj); [E, H, I] down
        prefix = unit[0].path.split(".mlp.experts.")[0] + ".mlp.experts"
        gates = [m for m in unit if m.path.endswith("gate_proj")]
        ups = [m for m in unit if m.path.endswith("up_proj")]
        downs = [m for m in unit if m.path.endswith("down_proj")]
        gate_up = torch.stack([torch.cat([w[g.path], w[u.path]]) for g, u in zip(gates, ups)])
        down = torch.stack([w[d.path] for d in downs])
        prec = gates[0].precision if self.fmt == "modelopt" else Precision.BF16
        out: dict[str, torch.Tensor] = {}
        for name, t in (("gate_up_proj", gate_up), ("down_proj", down)):
            key = f"{prefix}.{name}"
            if prec == Precision.NVFP4:
                # one amax per expert matrix: gate and up share it, as ModelOpt's fused-experts export does
                packed, block_scale, global_scale = nvfp4_quantize(t)
                out.update({
                    key: packed, f"{key}_weight_scale": block_scale, f"{key}_weight_scale_2": global_scale,
                    f"{key}_input_scale": self._scalar(input_scale_for(ASSUMED_INPUT_AMAX, kind="nvfp4")),
                })
            elif prec == Precision.BF16:
                out[key] = t
            else:
                raise ValueError(f"{prefix}: fused experts are written in NVFP4 or BF16, not {prec.value}")
        return out


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


def folded_quant_config(quant: dict) -> dict:
    """`hf_quant_config.json` in the form newer ModelOpt exports fold into `config.json` as
    `quantization_config` (ModelOpt `convert_hf_quant_config_format`): `quant_method: modelopt`,
    `exclude_modules` as `ignore`, one config group per distinct per-layer algorithm."""
    q = quant["quantization"]
    groups: dict[str, list[str]] = {}
    for name, layer in q.get("quantized_layers", {}).items():
        groups.setdefault(layer["quant_algo"], []).append(name)
    bits = {"FP8": 8, "W4A16_NVFP4": 4, "NVFP4": 4}
    config_groups = {
        f"group_{i}": {"targets": sorted(names),
                       "weights": {"dynamic": False, "num_bits": bits.get(algo, 4), "type": "float"}}
        for i, (algo, names) in enumerate(groups.items())
    }
    out = {
        "quant_method": "modelopt",
        "quant_algo": q["quant_algo"],
        "producer": quant["producer"],
        "config_groups": config_groups,
        "quantized_layers": q.get("quantized_layers", {}),
        "ignore": q.get("exclude_modules") or [],
    }
    if q.get("kv_cache_quant_algo") == "FP8":
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    return out


def ct_quant_config(cfg: ModelConfig, include_mtp: bool) -> dict:
    """The `quantization_config` llm-compressor writes for an NVFP4 (W4A4) export of this model with
    routers, shared-expert gates, lm_head and every GDN projection left in BF16 (the usual recipe)."""
    nvfp4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
             "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax",
             "observer_kwargs": {}}
    routers = [f"model.language_model.layers.{i}.mlp.{n}" for i in range(cfg.num_hidden_layers)
               for n in ("gate", "shared_expert_gate")]
    ignore = ["lm_head", *routers, "re:.*linear_attn.*", "re:model.visual.*"]
    if include_mtp:
        ignore.append("re:^mtp.*")  # compressed-tensors' save_mtp_tensors_to_checkpoint adds this
    return {
        "quant_method": "compressed-tensors",
        "format": CT_NVFP4_FORMAT,
        "quantization_status": "compressed",
        "version": "0.12.2",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": nvfp4,
                "input_activations": {**nvfp4, "dynamic": "local"},
                "output_activations": None,
                "format": CT_NVFP4_FORMAT,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
    }


def write_checkpoint(
    cfg: ModelConfig,
    out_dir: str | Path,
    seed: int = 0,
    device: torch.device | str = "cpu",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    fmt: str = "modelopt",
    *,
    fused_experts: bool | None = None,
    include_mtp: bool | None = None,
    scalar_shape: tuple[int, ...] = (),
    quant_config_in: str = "file",
    residual_scale: float = 1.0,
) -> Path:
    """Write a synthetic checkpoint for `cfg` in layout `fmt` into `out_dir` (created; empty or absent).

    fmt: "modelopt" (the vendor release), "compressed-tensors" or "bf16".
    fused_experts: store routed experts as 3-D `mlp.experts.gate_up_proj` / `down_proj` (default: only for
        bf16; compressed-tensors always stores them per expert).
    include_mtp: write `mtp.*` (default: yes, except for compressed-tensors).
    scalar_shape: shape of ModelOpt's scalar scales, () or (1,).
    quant_config_in: ModelOpt only: "file" (`hf_quant_config.json`) or "config" (folded into `config.json`).
    residual_scale: multiplies the projections that write into the residual stream (o_proj, out_proj,
        down_proj). At 1.0 every block adds about unit variance and 40 random blocks make a chaotic network
        (bf16 and fp32 runs part after a token or two); a small value (e.g. 0.05) gives a network whose
        greedy output is stable under rounding, like a trained one, for token-level comparisons.

    Tensors are generated on `device` (a GPU makes the full-size model take minutes) and streamed to
    shards of at most ~`max_shard_bytes`. Raises FileExistsError if `out_dir` holds files, ValueError on a
    bad option. Returns the directory path.
    """
    if fmt not in LAYOUTS:
        raise ValueError(f"format must be one of {LAYOUTS}, got {fmt!r}")
    if scalar_shape not in ((), (1,)):
        raise ValueError(f"scalar_shape must be () or (1,), got {scalar_shape!r}")
    if quant_config_in not in ("file", "config"):
        raise ValueError(f"quant_config_in must be 'file' or 'config', got {quant_config_in!r}")
    if not (isinstance(residual_scale, (int, float)) and math.isfinite(residual_scale) and residual_scale > 0):
        raise ValueError(f"residual_scale must be a positive finite number, got {residual_scale!r}")
    fused = (fmt == "bf16") if fused_experts is None else fused_experts
    if fused and fmt == "compressed-tensors":
        raise ValueError("compressed-tensors checkpoints store experts per expert (llm-compressor unfuses "
                         "them)")
    with_mtp = (fmt != "compressed-tensors") if include_mtp is None else include_mtp
    with_mtp = with_mtp and cfg.mtp_num_hidden_layers > 0

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; choose a new directory for the checkpoint")
    # a folder of this process's own next to `out`, renamed into place once complete: a reader never sees a partial
    # checkpoint, and writers of the same `out` at once do not clear each other's files
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".partial-", dir=out.parent))
    except OSError as e:  # name the folder asked for, not the temporary one next to it
        raise OSError(e.errno, f"cannot create {out}: {e.strerror or e}") from None
    try:
        n, total = _write_files(cfg, tmp, seed, device, max_shard_bytes, fmt, fused, with_mtp, scalar_shape,
                                quant_config_in, residual_scale)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; a checkpoint is meant to be shared
        if out.exists():
            out.rmdir()  # OSError if another writer has filled it since the check above
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"{out} was written by another process meanwhile; choose a new directory for the "
                                  f"checkpoint") from e
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s (%s layout): %d shards, %.1f MB", out, fmt, n, total / 1e6)
    return out


def _write_files(cfg: ModelConfig, tmp: Path, seed: int, device: torch.device | str, max_shard_bytes: int, fmt: str,
                 fused: bool, with_mtp: bool, scalar_shape: tuple[int, ...], quant_config_in: str,
                 residual_scale: float) -> tuple[int, int]:
    """write_checkpoint's files (shards, index, configs, tokenizer) into the empty folder `tmp`. Returns the number
    of shards and the tensor bytes."""
    from vibeqwen.tokenizer import write_tokenizer_files

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

    def add(tensors: dict[str, torch.Tensor]) -> None:
        nonlocal shard_bytes, total
        tensors = {k: v.contiguous().cpu() for k, v in tensors.items()}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
        shard.update(tensors)
        shard_bytes += size
        total += size

    ct_config = ct_quant_config(cfg, with_mtp) if fmt == "compressed-tensors" else None
    encode = _Encoder(cfg, fmt, fused, scalar_shape, ct_config)
    for unit in _units(checkpoint_modules(cfg, include_mtp=with_mtp)):
        add(encode(unit, {m.path: master_weight(m, seed, device, residual_scale) for m in unit}))
    gen = torch.Generator().manual_seed(_module_seed(seed, "model.visual"))
    add({n: torch.randn(shape, generator=gen).to(torch.bfloat16) for n, shape in VISION_TENSORS.items()})
    flush()

    weight_map = {}
    n = len(shard_files)
    for i, (tmp_name, names) in enumerate(shard_files):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(tmp / tmp_name, tmp / final)
        os.chmod(tmp / final, 0o644)  # safetensors writes 0600; a checkpoint is meant to be shared
        weight_map.update({k: final for k in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = hf_config(cfg)
    if fmt == "modelopt" and quant_config_in == "file":
        (tmp / QUANT_FILE).write_text(json.dumps(hf_quant_config(cfg), indent=2) + "\n")
    elif fmt == "modelopt":
        config["quantization_config"] = folded_quant_config(hf_quant_config(cfg))
    elif fmt == "compressed-tensors":
        config["quantization_config"] = ct_config
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    write_tokenizer_files(tmp)
    return n, total
