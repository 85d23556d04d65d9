"""NVFP4 weight-only (W4A16) linear layer: reference (`naive.py`) and Triton kernels (`linear.py`)."""

from vibeqwen_kernels.nvfp4.linear import DECODE_MAX_M, NVFP4Weight, nvfp4_linear, prepack_nvfp4
from vibeqwen_kernels.nvfp4.naive import nvfp4_linear_ref

__all__ = ["DECODE_MAX_M", "NVFP4Weight", "nvfp4_linear", "nvfp4_linear_ref", "prepack_nvfp4"]
