"""Access to a loaded checkpoint's tensors by module path, dequantized into the compute dtype."""

from __future__ import annotations

import os

import torch

from vibeqwen.checkpoint.layout import Precision
from vibeqwen.model.layers import Linear, dequantize_module


class Weights:
    """tensors: stored name -> tensor (as on disk); precisions: module path -> Precision.

    `dtype` is the compute dtype; `device` where weights are placed. `fast` (a CUDA device, unless the
    environment sets VIBEQWEN_REFERENCE=1) makes the layers build the GPU path (packed weights, Triton
    kernels) instead of dense dequantized weights.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], precisions: dict[str, Precision], dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.tensors = tensors
        self.precisions = precisions
        self.dtype = dtype
        self.device = torch.device(device)
        # the GPU path (Triton kernels over packed weights); VIBEQWEN_REFERENCE=1 keeps the reference path
        # (VIBEQWEN_FAST=1 forces the GPU path elsewhere: with TRITON_INTERPRET=1 it runs on the CPU, for tests)
        self.fast = ((self.device.type == "cuda" or os.environ.get("VIBEQWEN_FAST", "0") == "1")
                     and os.environ.get("VIBEQWEN_REFERENCE", "0") != "1")

    def dense(self, path: str) -> torch.Tensor:
        """Dense [N, K] weight of module `path`, dequantized on `device` (a GPU does it in milliseconds)."""
        prec = self.precisions.get(path, Precision.BF16)
        parts = {k: self.tensors[k].to(self.device) for k in (f"{path}.weight", f"{path}.weight_scale",
                                                               f"{path}.weight_scale_2") if k in self.tensors}
        return dequantize_module(parts, path, prec, self.dtype)

    def linear(self, path: str) -> Linear:
        """A `Linear` over the dense weight of module `path` (see `dense`)."""
        return Linear(self.dense(path), self.precisions.get(path, Precision.BF16))

    def param(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A raw (unquantized) tensor by stored name, e.g. `...norm.weight` or `...A_log`."""
        return self.tensors[name].to(device=self.device, dtype=dtype or self.dtype)
