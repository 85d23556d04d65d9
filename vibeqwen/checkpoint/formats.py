"""The checkpoint layouts a user may hold, and how each one becomes the vendor layout the model reads.

Three layouts are recognised from the config files alone (DESIGN.md section 2):

- `modelopt`: NVIDIA ModelOpt export (`hf_quant_config.json`, or the same information folded into
  `config.json` as `quantization_config` with `quant_method: "modelopt"`). The vendor's NVFP4 release is
  this layout. Experts may be stored per expert (`mlp.experts.{e}.gate_proj.weight`, the release) or fused
  (`mlp.experts.gate_up_proj` [E, 2I, K/2] with `gate_up_proj_weight_scale`, `gate_up_proj_weight_scale_2`
  [E], as ModelOpt's keep-fused export writes them); scalars may be stored 0-d or [1].
- `compressed-tensors`: llm-compressor's `nvfp4-pack-quantized` format: `weight_packed` u8 [N, K/2] (low
  nibble = even element, as ModelOpt), `weight_scale` e4m3 [N, K/16], `weight_global_scale` f32 [1] and
  `input_global_scale` f32 [1]. Its global scales are RECIPROCALS (2688 / amax): compressed-tensors
  dequantizes with `scale / global_scale`, so here `weight_scale_2 = 1 / weight_global_scale`. Usually
  ships without `mtp.*`.
- `bf16`: the original release (`model.language_model.*`, experts fused as `mlp.experts.gate_up_proj`
  [E, 2I, H] with gate rows first, then up, and `mlp.experts.down_proj` [E, H, I]), quantized at load to the
  vendor mix (`quantize="nvfp4"`, ModelOpt math) or kept BF16 (`quantize="none"`).

Whatever the layout, `plan_checkpoint` returns one `Recipe` per module (or fused expert projection): which
on-disk tensors to read, with their expected dtype and shape, and a function that turns them into tensors
named and typed as in the vendor layout (`layout.Module.tensors`). The loader validates every recipe input
against the safetensors headers before reading a byte, then reads and builds; `inspect` uses the same plan
without reading.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vibeqwen.checkpoint.layout import (
    NVFP4_GROUP,
    Module,
    Precision,
    checkpoint_modules,
    precision_from_quant_config,
    quant_algo_precision,
)
from vibeqwen.checkpoint.quant import fp8_quantize, nvfp4_quantize
from vibeqwen.config import ConfigError, ModelConfig

LAYOUTS = ("modelopt", "compressed-tensors", "bf16")
QUANTIZE_CHOICES = ("nvfp4", "none")
SERVED_ARCHITECTURES = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
# Never read: the vision tower is not served.
IGNORED_PREFIXES = ("model.visual.", "visual.")
QUANT_FILE = "hf_quant_config.json"
CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
# Quantization at load works on chunks of about this many elements (whole experts, or rows of a large
# matrix), so the quantizer's float32 temporaries stay ~100 MB however large the tensor.
_QUANT_CHUNK_ELEMENTS = 1 << 22

_ST_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint directory cannot be served; the message names the file and tensor at fault."""


def st_dtype(name: str) -> torch.dtype | None:
    """torch dtype of a safetensors header dtype string (None if unknown)."""
    return _ST_DTYPES.get(name)


def fmt_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    """`U8[32, 16]`: how dtypes and shapes appear in messages (safetensors dtype names)."""
    return f"{_ST_NAMES.get(dtype, str(dtype))}{list(shape)}"


@dataclass(frozen=True)
class DiskTensor:
    """One tensor a recipe reads: its on-disk name and the dtype/shape it must have.

    A 0-d `shape` also accepts [1] (scalars appear both ways in the wild).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    optional: bool = False

    def matches(self, dtype: torch.dtype | None, shape: list[int]) -> bool:
        if dtype != self.dtype:
            return False
        if self.shape == ():
            return list(shape) in ([], [1])
        return tuple(shape) == self.shape


Build = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass
class Recipe:
    """How one module (or one fused expert projection) is read and normalised to the vendor layout.

    module: module path for messages; disk: its precision on disk; target: the precision the model sees;
    build: on-disk tensors by name -> vendor-named tensors (may return views of its inputs).
    """

    module: str
    disk: Precision
    target: Precision
    inputs: list[DiskTensor]
    build: Build
    kind: str = ""


@dataclass
class Plan:
    """Everything known about a checkpoint from its config files and safetensors headers alone."""

    layout: str
    source: str  # where the layout was read from, e.g. "hf_quant_config.json"
    recipes: list[Recipe]
    precisions: dict[str, Precision]  # module path -> precision the model sees (vendor naming)
    disk_precisions: dict[str, Precision]  # module path -> precision as stored
    has_mtp: bool
    fused_experts: int = 0  # expert groups stored fused on disk
    quantize: str | None = None  # bf16 layout only: "nvfp4" or "none"


# ---- layout detection ---------------------------------------------------------------------------


def check_architecture(hf: dict, source: str) -> None:
    """Refuse a config whose `architectures` names a model this engine does not serve."""
    archs = hf.get("architectures")
    if isinstance(archs, list) and archs and not set(archs) & set(SERVED_ARCHITECTURES):
        raise ConfigError(
            f"{source}: architecture {', '.join(map(str, archs))} is not served; VibeQwen serves only "
            f"Qwen3.6-35B-A3B ({' or '.join(SERVED_ARCHITECTURES)}, model_type 'qwen3_5_moe')"
        )


def model_config_of(hf: dict, source: str) -> ModelConfig:
    """The ModelConfig of a checkpoint's parsed config.json `hf` (read from `source`, which messages name): its
    `architectures` checked first (:func:`check_architecture`), then every field (`ModelConfig.from_hf`).

    Raises:
        ConfigError: another model, or a field missing or malformed."""
    check_architecture(hf, source)
    return ModelConfig.from_hf(hf, source=source)


def check_modelopt_quantization(q: dict, source: str) -> None:
    """Check the shape of a ModelOpt quantization section (`hf_quant_config.json`'s `quantization`, or
    config.json's `quantization_config` with `quant_method: "modelopt"`) before any module's precision is read
    from it: `quant_algo` a supported name or MIXED_PRECISION, `quantized_layers` an object of objects each with
    a supported `quant_algo`, `exclude_modules` / `ignore` lists of strings, and at least one quantized module
    (a single `quant_algo`, or `quantized_layers` entries): a section that quantizes nothing would otherwise be
    reported as hundreds of tensors of the wrong dtype.

    Raises:
        CheckpointError: naming `source` and the field."""
    def check_algo(algo: object, where: str) -> None:
        try:
            quant_algo_precision(algo, f"{source}: {where}")
        except ValueError as e:
            raise CheckpointError(str(e)) from None

    algo = q.get("quant_algo")
    if algo not in (None, "MIXED_PRECISION"):
        check_algo(algo, "quant_algo")
    for key in ("exclude_modules", "ignore"):
        v = q.get(key)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise CheckpointError(f"{source}: field {key!r} must be a list of module name patterns, got {v!r}")
    layers = q.get("quantized_layers")
    if layers is not None:
        if not isinstance(layers, dict):
            raise CheckpointError(f"{source}: field 'quantized_layers' must be an object (module -> "
                                  f"{{\"quant_algo\": ...}}), got {type(layers).__name__}")
        for name, entry in layers.items():
            if not isinstance(entry, dict):
                raise CheckpointError(f"{source}: quantized_layers[{name!r}] must be an object with a quant_algo, "
                                      f"got {entry!r}")
            check_algo(entry.get("quant_algo"), f"quantized_layers[{name!r}]")
    if algo in (None, "MIXED_PRECISION") and not layers:
        raise CheckpointError(f"{source}: quantizes no module (no quant_algo such as 'NVFP4', and no "
                              "quantized_layers entries); a bf16 checkpoint has no ModelOpt quantization config")


def detect_layout(ckpt: Path, hf: dict) -> tuple[str, dict | None, str]:
    """(layout, quantization config, where it came from) from `hf_quant_config.json` / `config.json`.

    Raises CheckpointError for a quantization method this engine cannot load.
    """
    qfile = ckpt / QUANT_FILE
    if qfile.exists():
        quant = read_json(qfile)
        if not isinstance(quant, dict):
            raise CheckpointError(f"{qfile}: expected a JSON object, got {type(quant).__name__}")
        if not isinstance(quant.get("quantization"), dict):
            raise CheckpointError(f"{qfile}: field 'quantization' must be an object (ModelOpt's "
                                  f"{{\"producer\", \"quantization\": {{\"quant_algo\", ...}}}}), got "
                                  f"{quant.get('quantization')!r}")
        check_modelopt_quantization(quant["quantization"], str(qfile))
        return "modelopt", quant, QUANT_FILE
    qc = hf.get("quantization_config")
    if qc is None:
        return "bf16", None, "config.json (no quantization_config)"
    if not isinstance(qc, dict):
        raise CheckpointError(f"{ckpt / 'config.json'}: quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "modelopt":
        check_modelopt_quantization(qc, f"{ckpt / 'config.json'} quantization_config")
        return "modelopt", qc, "config.json quantization_config (quant_method modelopt)"
    if method == "compressed-tensors":
        return "compressed-tensors", qc, "config.json quantization_config (quant_method compressed-tensors)"
    raise CheckpointError(
        f"{ckpt / 'config.json'}: quantization_config.quant_method {method!r} is not supported; VibeQwen "
        "loads ModelOpt NVFP4 (hf_quant_config.json or quant_method 'modelopt'), compressed-tensors "
        f"'{CT_NVFP4_FORMAT}', or the BF16 original"
    )


# ---- compressed-tensors config ------------------------------------------------------------------


def _ct_name_match(path: str, target: str) -> bool:
    # compressed-tensors `match_name`: "re:" prefix = re.match on the module name, else exact name
    if target.startswith("re:"):
        return re.match(target[3:], path) is not None
    return target == path


def _ct_matches(m: Module, target: str) -> bool:
    return _ct_name_match(m.path, target) or target == m.hf_class


def ct_precision(qc: dict, m: Module) -> Precision:
    """A module's precision under a compressed-tensors `quantization_config`.

    `ignore` wins; otherwise the first config group whose `targets` match (module name, `re:` regex or
    class name such as "Linear") decides. Raises CheckpointError for a scheme other than NVFP4
    (`nvfp4-pack-quantized`: 4-bit float weights, groups of 16, E4M3 block scales).
    """
    if not m.is_linear:
        return Precision.BF16
    if any(_ct_matches(m, t) for t in qc.get("ignore") or []):
        return Precision.BF16
    for gname, group in (qc.get("config_groups") or {}).items():
        if not any(_ct_matches(m, t) for t in group.get("targets") or []):
            continue
        w = group.get("weights")
        if not w:
            return Precision.BF16
        fmt = group.get("format") or qc.get("format")
        ok = (
            w.get("num_bits") == 4 and w.get("type") == "float" and w.get("group_size") == NVFP4_GROUP
            and w.get("strategy", "tensor_group") in ("tensor_group", None)
            and w.get("scale_format", "e4m3") in ("e4m3", None)
            and fmt in (CT_NVFP4_FORMAT, "mixed-precision", None)
        )
        if not ok:
            summary = {k: w.get(k) for k in ("num_bits", "type", "strategy", "group_size", "scale_format")}
            raise CheckpointError(
                f"module {m.path}: compressed-tensors config group {gname!r} (format {fmt!r}, weights "
                f"{summary}) is not supported; VibeQwen loads '{CT_NVFP4_FORMAT}' (NVFP4: 4-bit float "
                "weights, groups of 16, FP8 E4M3 block scales) and BF16 modules"
            )
        return Precision.NVFP4
    return Precision.BF16


# ---- recipes ------------------------------------------------------------------------------------


def _scalar(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(())


def _vendor_recipe(m: Module, kind: str) -> Recipe:
    """A module stored as in the vendor layout: read as is (0-d scalars normalised)."""
    inputs = [
        DiskTensor(name, dtype, shape, optional=name.endswith(".input_scale"))
        for name, (shape, dtype) in m.tensors().items()
    ]

    def build(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {d.name: t[d.name].reshape(d.shape) for d in inputs if d.name in t}

    return Recipe(m.path, m.precision, m.precision, inputs, build, kind)


def _ct_recipe(m: Module, kind: str) -> Recipe:
    """compressed-tensors NVFP4 -> vendor NVFP4: rename, and invert the reciprocal global scales."""
    if m.precision != Precision.NVFP4:
        return _vendor_recipe(m, kind)
    n, k = m.shape
    p = m.path
    inputs = [
        DiskTensor(f"{p}.weight_packed", torch.uint8, (n, k // 2)),
        DiskTensor(f"{p}.weight_scale", torch.float8_e4m3fn, (n, k // NVFP4_GROUP)),
        DiskTensor(f"{p}.weight_global_scale", torch.float32, ()),
        DiskTensor(f"{p}.input_global_scale", torch.float32, (), optional=True),
    ]

    def build(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {
            f"{p}.weight": t[f"{p}.weight_packed"],
            f"{p}.weight_scale": t[f"{p}.weight_scale"],
            # compressed-tensors dequantizes with block_scale / global_scale
            f"{p}.weight_scale_2": torch.reciprocal(_scalar(t[f"{p}.weight_global_scale"]).float()),
        }
        if f"{p}.input_global_scale" in t:
            out[f"{p}.input_scale"] = torch.reciprocal(_scalar(t[f"{p}.input_global_scale"]).float())
        return out

    return Recipe(p, Precision.NVFP4, Precision.NVFP4, inputs, build, kind)


def _quantized(path: str, w: torch.Tensor, target: Precision, amax: torch.Tensor | None = None) -> dict:
    """Vendor tensors of module `path` from its BF16 weight, quantized with ModelOpt's math.

    Large matrices (lm_head) are quantized in row chunks under their whole-matrix amax: the result is
    identical (blocks never span rows) and the float32 temporaries stay small.
    """
    if target == Precision.NVFP4:
        if w.numel() <= _QUANT_CHUNK_ELEMENTS:
            packed, block_scale, global_scale = nvfp4_quantize(w, amax=amax)
        else:
            amax = _amax(w) if amax is None else amax
            rows = max(1, _QUANT_CHUNK_ELEMENTS // w.shape[-1])
            parts = [nvfp4_quantize(w[r:r + rows], amax=amax) for r in range(0, w.shape[0], rows)]
            packed = torch.cat([p[0] for p in parts])
            block_scale = torch.cat([p[1] for p in parts])
            global_scale = parts[0][2]
        return {f"{path}.weight": packed, f"{path}.weight_scale": block_scale,
                f"{path}.weight_scale_2": global_scale}
    if target == Precision.FP8:
        q, scale = fp8_quantize(w, amax=amax)
        return {f"{path}.weight": q, f"{path}.weight_scale": scale}
    return {f"{path}.weight": w}


def _amax(*ws: torch.Tensor) -> torch.Tensor:
    """One amax over several tensors (ModelOpt gives fused gate/up one weight_scale_2)."""
    return torch.stack([torch.maximum(w.amax().abs(), w.amin().abs()) for w in ws]).amax().float()


def _bf16_recipe(m: Module, target: Precision, kind: str) -> Recipe:
    """An unquantized module of the BF16 original, quantized at load to `target`."""
    name = f"{m.path}.{m.leaf}" if m.leaf else m.path
    inputs = [DiskTensor(name, torch.bfloat16, m.shape)]
    if target == Precision.BF16:
        return Recipe(m.path, Precision.BF16, target, inputs, lambda t: {name: t[name]}, kind)
    return Recipe(m.path, Precision.BF16, target, inputs, lambda t: _quantized(m.path, t[name], target), kind)


def _bf16_pair_recipe(gate: Module, up: Module, target: Precision, kind: str) -> Recipe:
    """gate_proj + up_proj of one MLP, quantized together: NVFP4 shares one amax (ModelOpt fuses them)."""
    gname, uname = f"{gate.path}.weight", f"{up.path}.weight"
    inputs = [DiskTensor(gname, torch.bfloat16, gate.shape), DiskTensor(uname, torch.bfloat16, up.shape)]

    def build(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        amax = _amax(t[gname], t[uname]) if target == Precision.NVFP4 else None
        gate_out = _quantized(gate.path, t[gname], target, amax)
        return {**gate_out, **_quantized(up.path, t[uname], target, amax)}

    return Recipe(gate.path.rpartition(".")[0], Precision.BF16, target, inputs, build, kind)


# ---- experts ------------------------------------------------------------------------------------


@dataclass
class _ExpertGroup:
    """The routed experts of one layer: `prefix` = `...mlp.experts`; modules[e] = (gate, up, down)."""

    prefix: str
    modules: list[tuple[Module, Module, Module]]

    @property
    def num(self) -> int:
        return len(self.modules)

    @property
    def gate_up_shape(self) -> tuple[int, int, int]:
        (gate, _, _) = self.modules[0]
        return (self.num, 2 * gate.shape[0], gate.shape[1])

    @property
    def down_shape(self) -> tuple[int, int, int]:
        (_, _, down) = self.modules[0]
        return (self.num, *down.shape)


def _fused_inputs(name: str, prec: Precision, shape: tuple[int, int, int]) -> list[DiskTensor]:
    """On-disk tensors of a fused [E, N, K] expert projection (ModelOpt keep-fused naming)."""
    e, n, k = shape
    if prec == Precision.NVFP4:
        return [
            DiskTensor(name, torch.uint8, (e, n, k // 2)),
            DiskTensor(f"{name}_weight_scale", torch.float8_e4m3fn, (e, n, k // NVFP4_GROUP)),
            DiskTensor(f"{name}_weight_scale_2", torch.float32, (e,)),
            DiskTensor(f"{name}_input_scale", torch.float32, (), optional=True),
        ]
    if prec == Precision.FP8:
        return [
            DiskTensor(name, torch.float8_e4m3fn, (e, n, k)),
            DiskTensor(f"{name}_weight_scale", torch.float32, (e,)),
            DiskTensor(f"{name}_input_scale", torch.float32, (), optional=True),
        ]
    return [DiskTensor(name, torch.bfloat16, (e, n, k))]


def _split_fused(t: dict[str, torch.Tensor], name: str, prec: Precision, parts: list[list[tuple[str, int, int]]]
                 ) -> dict[str, torch.Tensor]:
    """Per-expert vendor tensors as views of a stored fused projection (no copy).

    parts[e] = [(module path, first row, end row)] within expert e's [N, K] matrix.
    """
    out: dict[str, torch.Tensor] = {}
    w = t[name]
    scale = t.get(f"{name}_weight_scale")
    scale_2 = t.get(f"{name}_weight_scale_2")
    input_scale = t.get(f"{name}_input_scale")
    for e, rows in enumerate(parts):
        for path, r0, r1 in rows:
            out[f"{path}.weight"] = w[e, r0:r1]
            if prec == Precision.NVFP4:
                out[f"{path}.weight_scale"] = scale[e, r0:r1]
                out[f"{path}.weight_scale_2"] = scale_2[e]
            elif prec == Precision.FP8:
                out[f"{path}.weight_scale"] = scale[e]
            if input_scale is not None and prec != Precision.BF16:
                out[f"{path}.input_scale"] = _scalar(input_scale)
    return out


def _quantize_fused(w: torch.Tensor, target: Precision, parts: list[list[tuple[str, int, int]]]) -> dict:
    """Quantize a BF16 fused [E, N, K] projection per expert (one amax per expert matrix, so a fused
    gate_up shares weight_scale_2 between gate and up, as ModelOpt exports it), split into vendor names."""
    out: dict[str, torch.Tensor] = {}
    step = max(1, _QUANT_CHUNK_ELEMENTS // (w.shape[1] * w.shape[2]))
    for e0 in range(0, w.shape[0], step):
        chunk = w[e0:e0 + step]
        if target == Precision.NVFP4:
            packed, block_scale, global_scale = nvfp4_quantize(chunk)
        for j in range(chunk.shape[0]):
            for path, r0, r1 in parts[e0 + j]:
                if target == Precision.NVFP4:
                    out[f"{path}.weight"] = packed[j, r0:r1]
                    out[f"{path}.weight_scale"] = block_scale[j, r0:r1]
                    out[f"{path}.weight_scale_2"] = global_scale[j]
                elif target == Precision.FP8:
                    out.update(_quantized(path, chunk[j, r0:r1], target))
                else:
                    out[f"{path}.weight"] = chunk[j, r0:r1]
    return out


def _fused_build(name: str, disk: Precision, target: Precision, parts, quantize: bool) -> Build:
    if quantize:
        return lambda t: _quantize_fused(t[name], target, parts)
    return lambda t: _split_fused(t, name, disk, parts)


def _expert_recipes(g: _ExpertGroup, layout: str, disk: Precision, target: Precision, fused: bool
                    ) -> list[Recipe]:
    kind = module_kind(g.prefix + ".0.gate_proj")
    i = g.modules[0][0].shape[0]
    h_out = g.modules[0][2].shape[0]
    gate_up_parts = [[(gate.path, 0, i), (up.path, i, 2 * i)] for gate, up, _ in g.modules]
    down_parts = [[(down.path, 0, h_out)] for _, _, down in g.modules]
    if fused:
        recipes = []
        for proj, shape, parts in (("gate_up_proj", g.gate_up_shape, gate_up_parts),
                                   ("down_proj", g.down_shape, down_parts)):
            name = f"{g.prefix}.{proj}"
            quantize = disk == Precision.BF16 and target != Precision.BF16
            build = _fused_build(name, disk, target, parts, quantize)
            recipes.append(Recipe(name, disk, target, _fused_inputs(name, disk, shape), build, kind))
        return recipes
    recipes = []
    for gate, up, down in g.modules:
        if layout == "bf16":
            recipes.append(_bf16_pair_recipe(gate, up, target, kind))
            recipes.append(_bf16_recipe(down, target, kind))
        elif layout == "compressed-tensors":
            recipes += [_ct_recipe(m, kind) for m in (gate, up, down)]
        else:
            recipes += [_vendor_recipe(m, kind) for m in (gate, up, down)]
    return recipes


# ---- the plan -----------------------------------------------------------------------------------


def module_kind(path: str) -> str:
    """A coarse part name for reports: routed experts, attention, GDN, router, ..."""
    if path.startswith("mtp."):
        return "mtp"
    if ".mlp.experts." in path:
        return "routed experts"
    if ".mlp.shared_expert." in path:
        return "shared expert"
    if path.endswith(("shared_expert_gate", "mlp.gate")):
        return "routers"
    if ".self_attn." in path:
        return "attention norms" if path.endswith("_norm") else "attention"
    if ".linear_attn." in path:
        return "GDN projections" if path.endswith(("in_proj_qkv", "in_proj_z", "out_proj")) else "GDN other"
    if path == "lm_head":
        return "lm_head"
    if path.endswith("embed_tokens"):
        return "embedding"
    return "norms"


def _disk_precision(layout: str, quant: dict | None, m: Module) -> Precision:
    if layout == "modelopt":
        try:
            return precision_from_quant_config(quant or {}, m.path, quantizable=m.is_linear)
        except ValueError as e:
            raise CheckpointError(f"{e} (layout modelopt)") from None
    if layout == "compressed-tensors":
        return ct_precision(quant or {}, m)
    return Precision.BF16


def plan_checkpoint(
    cfg: ModelConfig, layout: str, quant: dict | None, names: set[str], quantize: str = "nvfp4"
) -> Plan:
    """The recipes that turn the checkpoint's on-disk tensors (`names`, from the headers) into the vendor
    layout. MTP is planned only if `mtp.*` tensors exist; fused vs per-expert storage is decided per layer
    from the names. `quantize` applies to the bf16 layout only."""
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {QUANTIZE_CHOICES}, got {quantize!r}")
    has_mtp = cfg.mtp_num_hidden_layers > 0 and any(n.startswith("mtp.") for n in names)
    recipes: list[Recipe] = []
    precisions: dict[str, Precision] = {}
    disk_precisions: dict[str, Precision] = {}
    groups: dict[str, _ExpertGroup] = {}
    fused_groups = 0
    pending_gate: dict[str, Module] = {}
    for vendor in checkpoint_modules(cfg, include_mtp=has_mtp):
        disk = _disk_precision(layout, quant, vendor)
        if layout == "bf16":
            target = vendor.precision if quantize == "nvfp4" else Precision.BF16
        else:
            target = disk
        precisions[vendor.path] = target
        disk_precisions[vendor.path] = disk
        m = vendor.with_precision(disk)
        if ".mlp.experts." in m.path:
            prefix, _, rest = m.path.partition(".mlp.experts.")
            g = groups.setdefault(prefix, _ExpertGroup(prefix + ".mlp.experts", []))
            e, proj = rest.split(".")
            if proj == "gate_proj":
                g.modules.append((m, None, None))  # type: ignore[arg-type]
            else:
                gate, up, down = g.modules[int(e)]
                g.modules[int(e)] = (gate, m, down) if proj == "up_proj" else (gate, up, m)
            continue
        kind = module_kind(m.path)
        if layout == "bf16":
            # the shared expert's gate and up share an amax, so they are quantized in one recipe
            if m.path.endswith("shared_expert.gate_proj") and target == Precision.NVFP4:
                pending_gate[m.path.rpartition(".")[0]] = m
                continue
            if m.path.endswith("shared_expert.up_proj") and m.path.rpartition(".")[0] in pending_gate:
                gate = pending_gate.pop(m.path.rpartition(".")[0])
                recipes.append(_bf16_pair_recipe(gate, m, target, kind))
                continue
            recipes.append(_bf16_recipe(m, target, kind))
        elif layout == "compressed-tensors":
            recipes.append(_ct_recipe(m, kind))
        else:
            recipes.append(_vendor_recipe(m, kind))
    for g in groups.values():
        disk = g.modules[0][0].precision
        target = precisions[g.modules[0][0].path]
        fused = f"{g.prefix}.gate_up_proj" in names
        if fused and layout == "compressed-tensors" and disk != Precision.BF16:
            raise CheckpointError(
                f"{g.prefix}: fused NVFP4 experts (gate_up_proj) in a compressed-tensors checkpoint are not "
                "supported; llm-compressor stores experts per expert "
                "(mlp.experts.{e}.gate_proj.weight_packed)"
            )
        fused_groups += fused
        recipes += _expert_recipes(g, layout, disk, target, fused)
    return Plan(layout, "", recipes, precisions, disk_precisions, has_mtp, fused_groups,
                quantize if layout == "bf16" else None)


def read_json(path: Path) -> Any:
    """The parsed JSON file at `path` (UTF-8). Raises CheckpointError naming the file: not valid JSON (or not
    UTF-8, or nested more deeply than Python's recursion limit), or unreadable (permissions, an I/O error)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None


def hf_checkpoint_config(ckpt: Path) -> dict:
    """The parsed `config.json` of a checkpoint directory.

    Raises:
        CheckpointError: `ckpt` does not exist or is not a directory, or its config.json is missing, unreadable,
            not JSON or not a JSON object (each message names the path)."""
    if not ckpt.exists():
        raise CheckpointError(f"{ckpt}: no such directory")
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: not a directory (a checkpoint is a folder holding config.json and the "
                              "safetensors shards)")
    cfg_file = ckpt / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{cfg_file}: missing ({ckpt} is not a Hugging Face checkpoint folder: it needs "
                              "config.json beside the safetensors shards)")
    hf = read_json(cfg_file)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{cfg_file}: expected a JSON object, got {type(hf).__name__}")
    return hf


__all__ = [
    "IGNORED_PREFIXES",
    "LAYOUTS",
    "QUANTIZE_CHOICES",
    "SERVED_ARCHITECTURES",
    "CheckpointError",
    "DiskTensor",
    "Plan",
    "Recipe",
    "check_architecture",
    "model_config_of",
    "ct_precision",
    "detect_layout",
    "fmt_tensor",
    "hf_checkpoint_config",
    "module_kind",
    "plan_checkpoint",
    "read_json",
    "st_dtype",
]
