"""FP8 E4M3 linear layers: weight-only W8A16 Triton kernels (`linear.py`) and W8A8 with per-token activation
scales on FP8 tensor cores (`w8a8.py`), each with its plain-torch reference."""

from vibeqwen_kernels.fp8.linear import FP8Weight, fp8_linear, fp8_linear_ref, pick_config, prepack_fp8
from vibeqwen_kernels.fp8.w8a8 import (
    QuantizedRows,
    fp8_w8a8_linear,
    fp8_w8a8_linear_ref,
    quantize_rows_fp8,
    quantize_rows_fp8_ref,
    weight_scale_row,
)

__all__ = ["FP8Weight", "QuantizedRows", "fp8_linear", "fp8_linear_ref", "fp8_w8a8_linear", "fp8_w8a8_linear_ref", "pick_config",
           "prepack_fp8", "quantize_rows_fp8", "quantize_rows_fp8_ref", "weight_scale_row"]
