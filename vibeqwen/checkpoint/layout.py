"""The tensors of the vendor's NVFP4 checkpoint (ModelOpt MIXED_PRECISION layout), by name.

One table, built from a `ModelConfig`, says which modules exist, their precision and their shapes. The
synthetic writer writes exactly these tensors and the loader checks exactly these, so the two cannot drift.

Precision per module (DESIGN.md section 2):
- NVFP4 W4A16: routed experts, shared experts, lm_head. Tensors: `weight` uint8 [N, K/2],
  `weight_scale` float8_e4m3fn [N, K/16], `weight_scale_2` float32 [], `input_scale` float32 [].
- FP8 per-tensor: attention q/k/v/o, GDN in_proj_qkv/in_proj_z/out_proj. Tensors: `weight`
  float8_e4m3fn [N, K], `weight_scale` float32 [], `input_scale` float32 [].
- BF16: GDN in_proj_a/b, conv1d, A_log, dt_bias, routers, shared_expert_gate, embeddings, norms, all of MTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from vibeqwen.config import ModelConfig

TEXT_PREFIX = "model.language_model."
NVFP4_GROUP = 16


class Precision(str, Enum):
    NVFP4 = "W4A16_NVFP4"
    FP8 = "FP8"
    BF16 = "BF16"


@dataclass(frozen=True)
class Module:
    """One weight-bearing module: a linear layer (N x K), an embedding, a norm or a raw parameter.

    `path` is the module path in the checkpoint (e.g. `model.language_model.layers.0.linear_attn.out_proj`);
    `shape` is the logical (dequantized) shape of its main tensor.
    """

    path: str
    precision: Precision
    shape: tuple[int, ...]
    # name of the main tensor under `path` ("weight" for modules; "" for raw parameters such as A_log)
    leaf: str = "weight"

    @property
    def is_linear(self) -> bool:
        """A 2-D `weight` a quantizer can act on (embeddings and raw parameters cannot)."""
        return self.leaf == "weight" and len(self.shape) == 2 and not self.path.endswith("embed_tokens")

    @property
    def hf_class(self) -> str:
        """The HF transformers module class name, as compressed-tensors' class targets ("Linear") see it."""
        if self.path.endswith("embed_tokens"):
            return "Embedding"
        if self.path.endswith("conv1d"):
            return "Conv1d"
        if self.path.endswith("mlp.gate"):
            return "Qwen3_5MoeTopKRouter"  # holds a weight but is not an nn.Linear
        if self.is_linear:
            return "Linear"
        return "Parameter" if not self.leaf else "RMSNorm"

    def with_precision(self, precision: Precision) -> Module:
        return Module(self.path, precision, self.shape, self.leaf)

    def tensors(self, input_scale: bool = True) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Stored tensor name -> (shape, dtype) for this module, in the ModelOpt layout.

        `input_scale=False` leaves out the activation scale (the weight-only path never reads it, and a
        checkpoint quantized at load has none).
        """
        if self.precision == Precision.NVFP4:
            n, k = self.shape
            out = {
                f"{self.path}.weight": ((n, k // 2), torch.uint8),
                f"{self.path}.weight_scale": ((n, k // NVFP4_GROUP), torch.float8_e4m3fn),
                f"{self.path}.weight_scale_2": ((), torch.float32),
                f"{self.path}.input_scale": ((), torch.float32),
            }
        elif self.precision == Precision.FP8:
            out = {
                f"{self.path}.weight": (self.shape, torch.float8_e4m3fn),
                f"{self.path}.weight_scale": ((), torch.float32),
                f"{self.path}.input_scale": ((), torch.float32),
            }
        else:
            name = f"{self.path}.{self.leaf}" if self.leaf else self.path
            return {name: (self.shape, torch.bfloat16)}
        if not input_scale:
            out.pop(f"{self.path}.input_scale")
        return out


def _decoder_layer(cfg: ModelConfig, prefix: str, layer_type: str, quantized: bool) -> list[Module]:
    """Modules of one decoder layer under `prefix` (ending with '.'). MTP layers are not quantized."""
    h = cfg.hidden_size
    lin8 = Precision.FP8 if quantized else Precision.BF16
    lin4 = Precision.NVFP4 if quantized else Precision.BF16
    bf16 = Precision.BF16
    mods = [Module(prefix + "input_layernorm", bf16, (h,)), Module(prefix + "post_attention_layernorm", bf16, (h,))]
    if layer_type == "linear_attention":
        p = prefix + "linear_attn."
        nv = cfg.linear_num_value_heads
        mods += [
            Module(p + "in_proj_qkv", lin8, (cfg.gdn_conv_dim, h)),
            Module(p + "in_proj_z", lin8, (cfg.gdn_value_dim, h)),
            Module(p + "in_proj_b", bf16, (nv, h)),
            Module(p + "in_proj_a", bf16, (nv, h)),
            Module(p + "conv1d", bf16, (cfg.gdn_conv_dim, 1, cfg.linear_conv_kernel_dim)),
            Module(p + "A_log", bf16, (nv,), leaf=""),
            Module(p + "dt_bias", bf16, (nv,), leaf=""),
            Module(p + "norm", bf16, (cfg.linear_value_head_dim,)),
            Module(p + "out_proj", lin8, (h, cfg.gdn_value_dim)),
        ]
    else:
        p = prefix + "self_attn."
        hd = cfg.head_dim
        mods += [
            # q_proj yields per head [query(head_dim) | gate(head_dim)]
            Module(p + "q_proj", lin8, (2 * cfg.num_attention_heads * hd, h)),
            Module(p + "k_proj", lin8, (cfg.num_key_value_heads * hd, h)),
            Module(p + "v_proj", lin8, (cfg.num_key_value_heads * hd, h)),
            Module(p + "o_proj", lin8, (h, cfg.num_attention_heads * hd)),
            Module(p + "q_norm", bf16, (hd,)),
            Module(p + "k_norm", bf16, (hd,)),
        ]
    p = prefix + "mlp."
    i_moe, i_sh = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    mods.append(Module(p + "gate", bf16, (cfg.num_experts, h)))
    for e in range(cfg.num_experts):
        mods += [
            Module(f"{p}experts.{e}.gate_proj", lin4, (i_moe, h)),
            Module(f"{p}experts.{e}.up_proj", lin4, (i_moe, h)),
            Module(f"{p}experts.{e}.down_proj", lin4, (h, i_moe)),
        ]
    mods += [
        Module(p + "shared_expert.gate_proj", lin4, (i_sh, h)),
        Module(p + "shared_expert.up_proj", lin4, (i_sh, h)),
        Module(p + "shared_expert.down_proj", lin4, (h, i_sh)),
        Module(p + "shared_expert_gate", bf16, (1, h)),
    ]
    return mods


def mtp_layer_type(cfg: ModelConfig) -> str:
    """The MTP decoder layer is a gated full-attention layer with an MoE block."""
    return "full_attention"


def checkpoint_modules(cfg: ModelConfig, include_mtp: bool = True) -> list[Module]:
    """Every module of the vendor NVFP4 checkpoint for `cfg`, in a stable order (layer by layer)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    mods = [Module(TEXT_PREFIX + "embed_tokens", Precision.BF16, (v, h))]
    for i, t in enumerate(cfg.layer_types):
        mods += _decoder_layer(cfg, f"{TEXT_PREFIX}layers.{i}.", t, quantized=True)
    mods.append(Module(TEXT_PREFIX + "norm", Precision.BF16, (h,)))
    mods.append(Module("lm_head", Precision.NVFP4, (v, h)))
    if include_mtp:
        for j in range(cfg.mtp_num_hidden_layers):
            mods += [
                Module("mtp.fc", Precision.BF16, (h, 2 * h)),
                Module("mtp.pre_fc_norm_embedding", Precision.BF16, (h,)),
                Module("mtp.pre_fc_norm_hidden", Precision.BF16, (h,)),
            ] if j == 0 else []
            mods += _decoder_layer(cfg, f"mtp.layers.{j}.", mtp_layer_type(cfg), quantized=False)
        if cfg.mtp_num_hidden_layers:
            mods.append(Module("mtp.norm", Precision.BF16, (h,)))
    return mods


def expected_tensors(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Stored tensor name -> (shape, dtype) for the whole checkpoint."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for m in checkpoint_modules(cfg, include_mtp):
        out.update(m.tensors())
    return out


def hf_quant_config(cfg: ModelConfig, modelopt_version: str = "0.37.0") -> dict:
    """The `hf_quant_config.json` a ModelOpt MIXED_PRECISION export writes for this model.

    Experts are listed by their parent module (`...mlp.experts`), which covers every child expert.
    """
    layers: dict[str, dict] = {}
    for i, t in enumerate(cfg.layer_types):
        p = f"{TEXT_PREFIX}layers.{i}."
        if t == "linear_attention":
            for name in ("in_proj_qkv", "in_proj_z", "out_proj"):
                layers[f"{p}linear_attn.{name}"] = {"quant_algo": "FP8"}
        else:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                layers[f"{p}self_attn.{name}"] = {"quant_algo": "FP8"}
        nvfp4 = {"quant_algo": Precision.NVFP4.value, "group_size": NVFP4_GROUP}
        layers[f"{p}mlp.experts"] = dict(nvfp4)
        for name in ("gate_proj", "up_proj", "down_proj"):
            layers[f"{p}mlp.shared_expert.{name}"] = dict(nvfp4)
    layers["lm_head"] = {"quant_algo": Precision.NVFP4.value, "group_size": NVFP4_GROUP}
    return {
        "producer": {"name": "modelopt", "version": modelopt_version},
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": "FP8",
            "exclude_modules": [
                "model.visual*",
                "mtp*",
                "*linear_attn.in_proj_a",
                "*linear_attn.in_proj_b",
                "*linear_attn.conv1d",
                "*mlp.gate",
                "*shared_expert_gate",
            ],
            "quantized_layers": layers,
        },
    }


def quant_algo_precision(algo: object, where: str) -> Precision:
    """The precision of a ModelOpt `quant_algo` name (W4A16_NVFP4 / NVFP4 -> NVFP4, FP8 -> FP8).

    Raises:
        ValueError: another name (the message starts with `where`)."""
    if algo in ("W4A16_NVFP4", "NVFP4"):
        return Precision.NVFP4
    if algo == "FP8":
        return Precision.FP8
    raise ValueError(
        f"{where}: unsupported quant_algo {algo!r}; this engine loads NVFP4 (W4A16_NVFP4) and "
        "FP8 per-tensor ModelOpt layers"
    )


def precision_from_quant_config(quant: dict, module_path: str, quantizable: bool = True) -> Precision:
    """Resolve a module's precision from a ModelOpt quantization config.

    Accepts `hf_quant_config.json` (`{"producer", "quantization": {...}}`) and the form ModelOpt folds into
    `config.json` as `quantization_config` (flat, `quant_method: "modelopt"`, `ignore` for
    `exclude_modules`). Exclusions are fnmatch patterns. With `quant_algo: MIXED_PRECISION` a
    `quantized_layers` key covers its children (`...mlp.experts` covers `...mlp.experts.3.up_proj`) and
    unlisted modules stay BF16; with a single `quant_algo` (e.g. `NVFP4`) every quantizable module that
    is not excluded gets it. `quantizable=False` (embeddings, norms, raw parameters) is always BF16.
    Raises ValueError on an unknown `quant_algo`, the top-level one included (checked whatever module is asked
    about: with every module listed in `quantized_layers` it is never the one that applies).
    """
    import fnmatch

    q = quant.get("quantization", quant)
    algo = q.get("quant_algo")
    if algo not in (None, "MIXED_PRECISION"):
        quant_algo_precision(algo, "quantization.quant_algo")
    if not quantizable:
        return Precision.BF16
    excluded = list(q.get("exclude_modules") or []) + list(q.get("ignore") or [])
    for pattern in excluded:
        if fnmatch.fnmatchcase(module_path, pattern):
            return Precision.BF16
    layers = q.get("quantized_layers") or {}
    path = module_path
    while path:
        if path in layers:
            return quant_algo_precision(layers[path].get("quant_algo"), f"module {module_path}")
        path = path.rpartition(".")[0]
    if algo in (None, "MIXED_PRECISION"):
        return Precision.BF16
    return quant_algo_precision(algo, f"module {module_path}")
