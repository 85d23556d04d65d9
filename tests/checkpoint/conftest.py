"""Tiny checkpoints of the same seed-0 weights in every layout, written once per session.

`tiny_checkpoint` (tests/conftest.py) is the vendor layout: ModelOpt, experts per expert, 0-d scalars,
`hf_quant_config.json`. Here: its variant with fused experts, [1] scalars and the quantization config
folded into `config.json`; compressed-tensors (no MTP); and the BF16 original (fused experts).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the HF oracle and the sequence driver live with the model tests
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))

FORMATS = ["modelopt", "modelopt-fused", "compressed-tensors", "bf16"]


@pytest.fixture(scope="session")
def format_dirs(tmp_path_factory, tiny_config, tiny_checkpoint) -> dict[str, Path]:
    from vibeqwen.checkpoint.writer import write_checkpoint

    root = tmp_path_factory.mktemp("formats")
    shard = 16 << 20
    return {
        "modelopt": tiny_checkpoint,
        "modelopt-fused": write_checkpoint(tiny_config, root / "modelopt-fused", seed=0, max_shard_bytes=shard,
                                           fused_experts=True, scalar_shape=(1,), quant_config_in="config"),
        "compressed-tensors": write_checkpoint(tiny_config, root / "ct", seed=0, max_shard_bytes=shard,
                                               fmt="compressed-tensors"),
        "bf16": write_checkpoint(tiny_config, root / "bf16", seed=0, max_shard_bytes=shard, fmt="bf16"),
    }


@pytest.fixture(scope="session")
def loaded(format_dirs):
    """Each layout loaded (the BF16 one quantized at load, as `serve` does by default), plus `bf16-none`."""
    from vibeqwen.checkpoint.loader import load_checkpoint

    out = {name: load_checkpoint(path) for name, path in format_dirs.items()}
    out["bf16-none"] = load_checkpoint(format_dirs["bf16"], quantize="none")
    return out
