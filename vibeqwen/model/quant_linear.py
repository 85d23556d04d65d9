"""Linear layers of the GPU path, reading the checkpoint's packed NVFP4 / FP8 weights directly.

Several modules that read the same input are fused into one weight at load time (concatenated along the
output features), and the result is split back into views:

    GDN:        in_proj_qkv | in_proj_z (FP8) and in_proj_b | in_proj_a (BF16)
                                                                  -> [8192 + 4096, 2048] and [32 + 32, 2048]
    attention:  q_proj | k_proj | v_proj                          -> [8192 + 512 + 512, 2048]

Modules of different precisions fuse by runs of one precision (`ConcatLinear`); `split_outputs` hands each
module its output as a view, without a concatenation copy.

FP8 (E4M3, one scale per tensor, weight-only "W8A16"): few rows (decode) run the Triton kernel that streams
the FP8 weight and widens it in registers; many rows (prefill) run cuBLAS on a bf16 copy dequantized once
at load (exact: E4M3 x fp32 scale rounds once to bf16, the same value the kernel forms). Concatenated
modules keep their own scales as a per-row scale vector. NVFP4: `vibeqwen_kernels.nvfp4.nvfp4_linear`.
BF16 weights: cuBLAS.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from vibeqwen.checkpoint.layout import Precision

#: Rows (tokens) up to which FP8 layers stream the FP8 weight; above, cuBLAS on the bf16 copy.
FP8_DECODE_MAX_M = int(os.environ.get("VIBEQWEN_FP8_DECODE_MAX_M", "64"))


def _nvfp4_global(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(()).float()


class DenseLinear:
    """y = x W^T with W [N, K] dense (bf16 on the GPU)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FP8Linear:
    """y = x (W_fp8 * scale)^T; scale float32 [N] (one value per output row, so fused modules keep their
    own per-tensor scales). Keeps a bf16 copy for many-row inputs (see module docstring)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        from vibeqwen_kernels.fp8 import prepack_fp8

        self.out_features = weight.shape[0]
        self.packed = prepack_fp8(weight, scale, weight.device)
        self.dense = (weight.float() * scale.float()[:, None]).to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from vibeqwen_kernels.fp8 import fp8_linear

        if x.shape[0] <= FP8_DECODE_MAX_M:
            return fp8_linear(x, self.packed)
        return F.linear(x, self.dense)


class NVFP4Linear:
    """y = x W^T with W in NVFP4 (W4A16 Triton kernels)."""

    def __init__(self, packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor):
        from vibeqwen_kernels.nvfp4 import prepack_nvfp4

        self.weight = prepack_nvfp4(packed, block_scale, _nvfp4_global(global_scale))
        self.out_features = packed.shape[0]

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x [M, K] -> [M, N] of `out_dtype` (fp32 accumulation either way; fp32 keeps the LM head's logits
        unrounded, so near-equal logits do not become exact bf16 ties)."""
        from vibeqwen_kernels.nvfp4 import nvfp4_linear

        return nvfp4_linear(x, self.weight, out_dtype=out_dtype)


class ConcatLinear:
    """Modules of several precisions reading one input: consecutive FP8 modules share one FP8 weight (per-row
    scales), consecutive BF16 modules one dense weight, NVFP4 modules (one global scale each) run alone.
    `split` returns each module's output as a view of its group's output (no concatenation copy); calling
    the layer concatenates them.

    GDN's input projection in the vendor layout is qkv | z (FP8) and b | a (BF16): two launches, not four
    plus a concatenation."""

    def __init__(self, groups: list, group_sizes: list[list[int]]):
        self.groups = groups
        self.group_sizes = group_sizes
        self.out_features = sum(sum(g) for g in group_sizes)

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [M, K] -> one [M, N_i] output per module, in order (views into each group's output)."""
        outs = []
        for layer, sizes in zip(self.groups, self.group_sizes):
            outs += list(torch.split(layer(x), sizes, dim=-1))
        return outs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(x) for layer in self.groups], dim=-1)


def split_outputs(layer, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Each fused module's output as a view: x [M, K] (the activation dtype) -> [M, sizes[i]] for i in order.
    layer: what `fused_linear` returned for those modules, sizes its out_features list."""
    if isinstance(layer, ConcatLinear):
        return layer.split(x)
    return list(torch.split(layer(x), sizes, dim=-1))


def fused_linear(w, paths: list[str]):
    """One linear layer over the modules `paths` (same input features), outputs concatenated in order.

    w: `vibeqwen.model.weights.Weights` on a CUDA device. Returns (layer, [out_features per path]).
    Raises KeyError naming a missing tensor.
    """
    precs = [w.precisions.get(p, Precision.BF16) for p in paths]
    dev, dtype = w.device, w.dtype

    def raw(p: str, leaf: str) -> torch.Tensor:
        return w.tensors[f"{p}.{leaf}"].to(dev)

    sizes = [w.tensors[f"{p}.weight"].shape[0] for p in paths]
    if all(pr == Precision.FP8 for pr in precs):
        weight = torch.cat([raw(p, "weight") for p in paths])
        scale = torch.cat([raw(p, "weight_scale").float().reshape(1).expand(n) for p, n in zip(paths, sizes)])
        return FP8Linear(weight.contiguous(), scale.contiguous(), dtype), sizes
    if all(pr == Precision.BF16 for pr in precs):
        return DenseLinear(torch.cat([raw(p, "weight").to(dtype) for p in paths]).contiguous()), sizes
    if len(paths) > 1:
        # runs of one precision (FP8 or BF16) fuse; NVFP4 modules stay one layer each
        runs: list[list[int]] = []
        for i, pr in enumerate(precs):
            if runs and pr == precs[runs[-1][0]] and pr != Precision.NVFP4:
                runs[-1].append(i)
            else:
                runs.append([i])
        return ConcatLinear([fused_linear(w, [paths[i] for i in r])[0] for r in runs],
                            [[sizes[i] for i in r] for r in runs]), sizes
    p = paths[0]
    return NVFP4Linear(raw(p, "weight"), raw(p, "weight_scale"), raw(p, "weight_scale_2")), sizes


def gpu_linear(w, path: str):
    """The GPU layer for one module `path` (see `fused_linear`)."""
    return fused_linear(w, [path])[0]
