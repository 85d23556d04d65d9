"""Typed, validated model configuration.

`ModelConfig.from_hf` turns a Hugging Face `config.json` (the multimodal `Qwen3_5MoeConfig` with a
`text_config`, or a bare text config) into one frozen dataclass with our own names. Derived sizes are
properties. Every check names the offending field, so a bad file fails with a message a user can act on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

ARCHITECTURE = "qwen3_5_moe"
CONFIG_NAMES = {"tiny": "tiny.json", "full": "qwen3.6-35b-a3b.json"}


class ConfigError(ValueError):
    """A model config is missing a field or holds a value this engine cannot serve."""


def configs_dir() -> Path:
    """The folder holding the shipped model configs (`configs/` in the repository)."""
    import vibeqwen_configs

    return Path(vibeqwen_configs.__file__).parent


@dataclass(frozen=True)
class ModelConfig:
    """The text tower of Qwen3.6-35B-A3B (or a structurally identical smaller twin).

    Field names follow the Hugging Face text config where one exists; see DESIGN.md section 1.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    rms_norm_eps: float
    mtp_num_hidden_layers: int
    tie_word_embeddings: bool = False
    eos_token_id: int | tuple[int, ...] | None = None

    # ---- derived sizes ----
    @property
    def rotary_dim(self) -> int:
        """Number of leading head dims that RoPE rotates (64 for the real model)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:
        """Channels of GDN q (and of k): key heads x key head dim (2048 for the real model)."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        """Channels of GDN v: value heads x value head dim (4096 for the real model)."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the causal conv1d: q, k and v concatenated (8192 for the real model)."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the gated full-attention layers (i % 4 == 3 for the real model)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    # ---- construction ----
    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config") -> "ModelConfig":
        """Build from a Hugging Face config dict.

        Accepts the multimodal config (`model_type` `qwen3_5_moe` with `text_config`) or the bare text
        config (`qwen3_5_moe_text`). Raises `ConfigError` naming `source` and the bad field.
        """
        if not isinstance(hf, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(hf).__name__}")
        model_type = hf.get("model_type")
        text = hf
        if "text_config" in hf:
            if model_type not in (None, ARCHITECTURE):
                raise ConfigError(
                    f"{source}: model_type {model_type!r} is not served; VibeQwen serves only "
                    f"Qwen3.6-35B-A3B ({ARCHITECTURE!r})"
                )
            text = hf["text_config"]
            if not isinstance(text, dict):
                raise ConfigError(f"{source}: field 'text_config' must be an object")
        elif model_type not in (None, ARCHITECTURE, ARCHITECTURE + "_text"):
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not served; VibeQwen serves only "
                f"Qwen3.6-35B-A3B ({ARCHITECTURE!r})"
            )
        elif model_type == ARCHITECTURE and not any(k in hf for k in _SIZE_FIELDS):
            raise ConfigError(f"{source}: missing field 'text_config' (a {ARCHITECTURE!r} config keeps the text "
                              "model's fields there)")
        if model_type is None and not any(k in text for k in _SIZE_FIELDS):
            raise ConfigError(f"{source}: not a Qwen3.6 config (no model_type, no text_config, no model sizes); "
                              f"VibeQwen serves only Qwen3.6-35B-A3B ({ARCHITECTURE!r})")

        def get(name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
            if name not in text:
                if default is ...:
                    raise ConfigError(f"{source}: missing field {name!r}")
                return default
            value = text[name]
            ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _as_tuple(kind))
            if not ok:
                raise ConfigError(f"{source}: field {name!r} must be {_kind_name(kind)}, got {value!r}")
            return value

        rope = get("rope_parameters", dict, None) or {}
        rope_theta = rope.get("rope_theta", text.get("rope_theta"))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        if rope_theta is None:
            raise ConfigError(f"{source}: missing field 'rope_parameters.rope_theta'")
        if (not isinstance(rope_theta, (int, float)) or isinstance(rope_theta, bool) or not math.isfinite(rope_theta)
                or rope_theta <= 0):
            raise ConfigError(f"{source}: field 'rope_parameters.rope_theta' must be a positive number, "
                              f"got {rope_theta!r}")
        # fields the forward pass does not read because it implements only Qwen3.6's values of them: another
        # value is refused, not served as Qwen3.6 (an absent field means Qwen3.6's)
        for name, value in _FIXED_FIELDS.items():
            got = text.get(name, hf.get(name, value)) if name == "tie_word_embeddings" else text.get(name, value)
            if got != value or type(got) is not type(value):
                raise ConfigError(f"{source}: field {name!r} must be {value!r} (the only value the engine "
                                  f"implements), got {got!r}")
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: field 'rope_parameters.rope_type' must be 'default'")

        n_layers = get("num_hidden_layers", int)
        layer_types = get("layer_types", list, None)
        if layer_types is None:
            interval = get("full_attention_interval", int, 4)
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
            ]
        eos = text.get("eos_token_id", hf.get("eos_token_id"))
        cfg = cls(
            vocab_size=get("vocab_size", int),
            hidden_size=get("hidden_size", int),
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=get("num_attention_heads", int),
            num_key_value_heads=get("num_key_value_heads", int),
            head_dim=get("head_dim", int),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            max_position_embeddings=get("max_position_embeddings", int),
            linear_conv_kernel_dim=get("linear_conv_kernel_dim", int),
            linear_key_head_dim=get("linear_key_head_dim", int),
            linear_value_head_dim=get("linear_value_head_dim", int),
            linear_num_key_heads=get("linear_num_key_heads", int),
            linear_num_value_heads=get("linear_num_value_heads", int),
            num_experts=get("num_experts", int),
            num_experts_per_tok=get("num_experts_per_tok", int),
            moe_intermediate_size=get("moe_intermediate_size", int),
            shared_expert_intermediate_size=get("shared_expert_intermediate_size", int),
            rms_norm_eps=float(get("rms_norm_eps", (int, float))),
            mtp_num_hidden_layers=get("mtp_num_hidden_layers", int, 0),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", hf.get("tie_word_embeddings", False))),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        )
        cfg.validate(source)
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Load and validate a JSON config file. Raises `ConfigError` (bad content) or `FileNotFoundError`."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf(data, source=str(path))

    @classmethod
    def named(cls, name: str) -> "ModelConfig":
        """One of the shipped configs: `tiny` or `full` (Qwen3.6-35B-A3B)."""
        if name not in CONFIG_NAMES:
            raise ConfigError(f"unknown config {name!r}; choose one of {sorted(CONFIG_NAMES)}")
        return cls.from_file(configs_dir() / CONFIG_NAMES[name])

    def validate(self, source: str = "config") -> None:
        """Check structural invariants the forward pass relies on; raise `ConfigError` naming the field."""
        positive = [f.name for f in fields(self) if f.type in ("int",) and f.name != "mtp_num_hidden_layers"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{source}: field {name!r} must be positive, got {getattr(self, name)}")
        if self.mtp_num_hidden_layers < 0:
            raise ConfigError(f"{source}: field 'mtp_num_hidden_layers' must be >= 0")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"{source}: field 'layer_types' has {len(self.layer_types)} entries but "
                f"num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = sorted({t for t in self.layer_types} - {"linear_attention", "full_attention"})
        if bad:
            raise ConfigError(f"{source}: field 'layer_types' holds unknown layer type(s) {bad}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{source}: field 'num_attention_heads' ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"{source}: field 'linear_num_value_heads' ({self.linear_num_value_heads}) must be a multiple "
                f"of linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if not (math.isfinite(self.rms_norm_eps) and 0 < self.rms_norm_eps < 1):
            raise ConfigError(f"{source}: field 'rms_norm_eps' must be a small positive number (0 < eps < 1), "
                              f"got {self.rms_norm_eps}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ConfigError(
                f"{source}: field 'partial_rotary_factor' ({self.partial_rotary_factor}) must give an even "
                f"rotary dim in (0, head_dim]"
            )
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"{source}: field 'num_experts_per_tok' ({self.num_experts_per_tok}) must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        # NVFP4 groups 16 elements along K; FP8 has no constraint. Every quantized K must divide by 16.
        for name in ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(self, name) % 16:
                raise ConfigError(f"{source}: field {name!r} must be a multiple of 16 (NVFP4 group size)")

    def to_hf_text_config(self) -> dict[str, Any]:
        """The Hugging Face text-config dict for this model (as in `config.json` `text_config`)."""
        return {
            "model_type": ARCHITECTURE + "_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "attn_output_gate": True,
            "attention_bias": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_interleaved": True,
                "mrope_section": [11, 11, 10],
            },
            "max_position_embeddings": self.max_position_embeddings,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "mtp_num_hidden_layers": self.mtp_num_hidden_layers,
            "mtp_use_dedicated_embeddings": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "dtype": "bfloat16",
        }


#: fields that say a config has the model's sizes (a text config, or a flat one)
_SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "layer_types")
#: fields whose only implemented value is Qwen3.6-35B-A3B's (the forward pass hard-codes it)
_FIXED_FIELDS = {"hidden_act": "silu", "attention_bias": False, "attn_output_gate": True,
                 "tie_word_embeddings": False}


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", bool: "a boolean", list: "a list", dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in _as_tuple(kind))
