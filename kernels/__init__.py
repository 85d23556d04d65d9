"""VibeQwen's ops, installed as `vibeqwen_kernels`.

Each op family has a plain PyTorch reference (`naive.py`, or `*_ref` functions) that is the specification
and runs anywhere; GPU kernels (Triton in this folder, CUDA in csrc/) sit beside their reference and are
tested against it on fresh random inputs.
"""

from vibeqwen_kernels.attention.naive import attention_ref
from vibeqwen_kernels.conv1d.naive import causal_conv1d_ref
from vibeqwen_kernels.gdn.naive import gdn_chunk_ref, gdn_recurrent_ref
from vibeqwen_kernels.moe.naive import moe_experts_ref, route_topk_ref, swiglu_mlp_ref
from vibeqwen_kernels.norm import gated_rms_norm_ref, rms_norm_ref
from vibeqwen_kernels.nvfp4 import NVFP4Weight, nvfp4_linear, nvfp4_linear_ref, prepack_nvfp4

__all__ = [
    "NVFP4Weight",
    "attention_ref",
    "causal_conv1d_ref",
    "gated_rms_norm_ref",
    "gdn_chunk_ref",
    "gdn_recurrent_ref",
    "moe_experts_ref",
    "nvfp4_linear",
    "nvfp4_linear_ref",
    "prepack_nvfp4",
    "rms_norm_ref",
    "route_topk_ref",
    "swiglu_mlp_ref",
]
