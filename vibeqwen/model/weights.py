"""Access to a loaded checkpoint's tensors by module path, dequantized into the compute dtype."""

from __future__ import annotations

import torch

from vibeqwen.checkpoint.layout import Precision
from vibeqwen.model.layers import Linear, dequantize_module


class Weights:
    """tensors: stored name -> tensor (as on disk); precisions: module path -> Precision.

    `dtype` is the compute dtype of the reference path; `device` where dense weights are placed.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], precisions: dict[str, Precision], dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.tensors = tensors
        self.precisions = precisions
        self.dtype = dtype
        self.device = torch.device(device)

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
