"""FP8 E4M3 weight-only (W8A16) linear layer: Triton kernels and the plain-torch reference (`linear.py`)."""

from vibeqwen_kernels.fp8.linear import FP8Weight, fp8_linear, fp8_linear_ref, pick_config, prepack_fp8

__all__ = ["FP8Weight", "fp8_linear", "fp8_linear_ref", "pick_config", "prepack_fp8"]
