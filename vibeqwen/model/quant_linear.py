"""Linear layers of the GPU path, reading the checkpoint's packed NVFP4 / FP8 weights directly.

Several modules that read the same input are fused into one weight at load time (concatenated along the
output features), and the result is split back into views:

    GDN:        in_proj_qkv | in_proj_z (FP8) and in_proj_b | in_proj_a (BF16)
                                                                  -> [8192 + 4096, 2048] and [32 + 32, 2048]
    attention:  q_proj | k_proj | v_proj                          -> [8192 + 512 + 512, 2048]

Modules of different precisions fuse by runs of one precision (`ConcatLinear`); `split_outputs` hands each
module its output as a view, without a concatenation copy.

FP8 (E4M3, one scale per tensor). Few rows (decode, up to FP8_DECODE_MAX_M) run weight-only ("W8A16") kernels
that stream the FP8 weight and widen it in registers: bf16 inputs of 1-64 rows on an sm_90+ GPU the CUDA MMA kernel
(`vibeqwen_kernels.fp8.mma`, its own copy of the codes), others the Triton kernel. Many rows run one of:

* W8A16: cuBLAS on a bf16 copy dequantized once at load (exact: E4M3 x fp32 scale rounds once to bf16, the
  same value the kernel forms). The oracle's numerics.
* W8A8: the activations quantized per token to E4M3 and FP8 tensor cores (`vibeqwen_kernels.fp8.w8a8`):
  ~1.4x cuBLAS bf16 on these shapes, at ~2.5% relative noise on the projection's output. Only inside
  `prompt_pass(w8a8=True)`, which the runner opens for passes that carry prompt tokens when the engine's
  `fp8_prefill` is "w8a8" (the prefill CUDA graphs record it: a chunk of 17-64 tokens replays the 128-row
  graph, so it runs W8A8 where its eager pass would take the decode kernel), and only with bf16 activations.
  Decode-only passes and speculative verification stay W8A16 at any row count; decode rows scheduled in the
  same pass as a prompt chunk run with it. ``VIBEQWEN_FP8_DECODE_W8A8=N`` (a measuring switch, off by default)
  also runs decode-sized calls of N..FP8_DECODE_MAX_M rows W8A8, in every pass (`w8a8_now`).

Concatenated modules keep their own scales as a per-row scale vector. NVFP4:
`vibeqwen_kernels.nvfp4.nvfp4_linear`. BF16 weights: cuBLAS.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from vibeqwen.checkpoint.layout import Precision

#: Rows (tokens) up to which FP8 layers stream the FP8 weight; above, cuBLAS on the bf16 copy.
FP8_DECODE_MAX_M = int(os.environ.get("VIBEQWEN_FP8_DECODE_MAX_M", "64"))


#: Whether FP8 layers run W8A8 on many-row inputs now (set by `prompt_pass`).
_W8A8 = False


@contextmanager
def prompt_pass(w8a8: bool):
    """Within the block, FP8 layers given more than FP8_DECODE_MAX_M rows run W8A8 if `w8a8` (else their
    W8A16 dense copy). For passes that carry prompt tokens (and CUDA-graph captures of such passes: the
    choice is recorded in the graph). Not thread-safe: one engine thread runs the model."""
    global _W8A8
    before, _W8A8 = _W8A8, bool(w8a8)
    try:
        yield
    finally:
        _W8A8 = before


def w8a8_active() -> bool:
    """Whether a `prompt_pass(w8a8=True)` block is open."""
    return _W8A8


def decode_w8a8_min_rows() -> int:
    """``VIBEQWEN_FP8_DECODE_W8A8``: FP8 layers given from this many up to FP8_DECODE_MAX_M rows (decode-sized
    calls, in any pass) run W8A8 instead of the W8A16 decode kernels; 0 (the default) never. A measuring switch
    (bench/decode_ab.py): read at every call, so a CUDA graph keeps what it was captured with.

    Raises:
        ValueError: a value that is not a whole number from 0 to FP8_DECODE_MAX_M."""
    v = os.environ.get("VIBEQWEN_FP8_DECODE_W8A8", "0").strip()
    if not v.isdigit() or int(v) > FP8_DECODE_MAX_M:
        raise ValueError(f"VIBEQWEN_FP8_DECODE_W8A8 must be a whole number from 0 (off) to {FP8_DECODE_MAX_M}, "
                         f"got {v!r}")
    return int(v)


def w8a8_now(m: int) -> bool:
    """Whether an FP8 layer (bf16 activations on CUDA, any on the CPU) given m rows runs W8A8 now: more than
    FP8_DECODE_MAX_M rows inside `prompt_pass(w8a8=True)`, or ``VIBEQWEN_FP8_DECODE_W8A8``'s decode-sized rows.

    Raises:
        ValueError: a bad ``VIBEQWEN_FP8_DECODE_W8A8`` (`decode_w8a8_min_rows`)."""
    if m > FP8_DECODE_MAX_M:
        return _W8A8
    low = decode_w8a8_min_rows()
    return 0 < low <= m


def _nvfp4_global(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(()).float()


#: rows up to which DenseLinear runs the CUDA MMA kernel. H200, GDN's b|a (64 x 2048) per call, cuBLAS / MMA kernel:
#: M 1 5.3 / 2.6 us, 8 5.4 / 2.6, 32 5.4 / 4.9, 64 5.4 / 7.6 (bench/kernels/bench_route.py; each CTA reads all of x)
DENSE_MMA_MAX_M = 32
#: output features up to which DenseLinear keeps a shuffled copy for the kernel: the shapes measured (b|a 64, the
#: router's 264 rows); larger bf16 weights (the MTP layer's attention projections) stay on cuBLAS
DENSE_MMA_MAX_N = 512


class DenseLinear:
    """y = x W^T with W [N, K] dense (bf16 on the GPU). For N <= DENSE_MMA_MAX_N (512), decode-sized bf16 inputs
    (1-32 rows, DENSE_MMA_MAX_M) run on the CUDA MMA kernel of `vibeqwen_kernels.bf16_mma` where it builds (a
    shuffled copy of W, `self.mma`; `VIBEQWEN_BF16_MMA=0` keeps cuBLAS), everything else on cuBLAS."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features = weight.shape[0]
        self.mma = None
        if weight.is_cuda and weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[0] <= DENSE_MMA_MAX_N:
            from vibeqwen_kernels.bf16_mma import bf16_mma_supported, prepack_bf16_mma

            if bf16_mma_supported(weight.shape[0], weight.shape[1], weight.device):
                self.mma = prepack_bf16_mma(weight)

    def __call__(self, x: torch.Tensor, xq=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N]; xq (quantized rows for FP8 layers) is ignored. out: optional [M, N] output of the
        weight's dtype with a contiguous last dim (the result is written there and returned)."""
        if self.mma is not None and x.dim() == 2 and x.dtype == torch.bfloat16 and 1 <= x.shape[0] <= DENSE_MMA_MAX_M:
            from vibeqwen_kernels.bf16_mma import bf16_linear_mma

            return bf16_linear_mma(x, self.mma, out=out)
        if out is None:
            return F.linear(x, self.weight)
        return torch.matmul(x, self.weight.t(), out=out)


class FP8Linear:
    """y = x (W_fp8 * scale)^T; scale float32 [N] (one value per output row, so fused modules keep their
    own per-tensor scales). Keeps a bf16 copy for many-row W8A16 inputs (see module docstring), and on an sm_90+
    GPU a copy of the codes in the CUDA MMA kernel's layout for bf16 inputs of 1..64 rows
    (`vibeqwen_kernels.fp8.mma`; `VIBEQWEN_FP8_MMA=0` keeps them on the Triton kernels)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        from vibeqwen_kernels.fp8 import prepack_fp8, weight_scale_row

        self.out_features = weight.shape[0]
        self.packed = prepack_fp8(weight, scale, weight.device)
        self.mma = None
        if weight.device.type == "cuda":
            from vibeqwen_kernels.fp8.mma import fp8_mma_supported, prepack_fp8_mma

            if fp8_mma_supported(self.packed.n, self.packed.k, weight.device):
                self.mma = prepack_fp8_mma(self.packed)
        self.scale_row = weight_scale_row(self.packed)  # [1, N] float32 for the W8A8 GEMM
        self.dense = (weight.float() * scale.float()[:, None]).to(dtype)
        # on CUDA, W8A8 writes bf16 (torch._scaled_mm's row-wise scaling on sm_90 takes bf16 out): other
        # activation dtypes keep W8A16 in prompt passes too (the CPU reference takes any dtype)
        self.w8a8_ok = dtype == torch.bfloat16 or weight.device.type != "cuda"

    def __call__(self, x, xq=None) -> torch.Tensor:
        """x [M, K] (activation dtype) -> [M, N]. xq: x already quantized for W8A8 (`QuantizedRows`, from a
        norm kernel), used when the W8A8 branch runs; x may itself be a QuantizedRows when only that branch
        can run (many rows inside `prompt_pass(w8a8=True)`). Raises ValueError for a QuantizedRows outside it."""
        from vibeqwen_kernels.fp8 import QuantizedRows, fp8_linear, fp8_w8a8_linear

        w8a8 = self.w8a8_ok and w8a8_now(x.shape[0])
        if isinstance(x, QuantizedRows):
            if not w8a8:
                raise ValueError("FP8Linear: pre-quantized rows outside a W8A8 prompt pass")
            xq = x
        elif x.shape[0] <= FP8_DECODE_MAX_M and not w8a8:
            if self.mma is not None and x.dtype == torch.bfloat16:
                from vibeqwen_kernels.fp8.mma import MMA_MAX_M, fp8_linear_mma

                if 1 <= x.shape[0] <= MMA_MAX_M:
                    return fp8_linear_mma(x, self.mma)
            return fp8_linear(x, self.packed)
        if w8a8:
            return fp8_w8a8_linear(xq if xq is not None else x, self.packed, self.scale_row, out_dtype=self.dense.dtype)
        return F.linear(x, self.dense)


    def add_rms_norm(self, x, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float):
        """``rms_norm(self(x), norm_weight, eps, residual=residual)`` -> ``(y, h)`` in fewer launches where the
        CUDA MMA kernel runs x (bf16 ``[M, K]``, 1..64 rows; `fp8_linear_mma_add_rms_norm`: the K split's reduce,
        the residual add and the norm in one launch), else None: the caller runs the two steps.
        ``VIBEQWEN_FUSED_POST_NORM=0`` always returns None (for comparison). residual: bf16 ``[M, N]``; norm_weight
        ``[N]``; returns bf16 ``[M, N]`` each. Raises ValueError for a residual of another shape or device, RuntimeError
        for a failed launch (`fp8_linear_mma_add_rms_norm`)."""
        if (self.mma is None or not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16
                or residual.dtype != torch.bfloat16 or os.environ.get("VIBEQWEN_FUSED_POST_NORM", "1") == "0"
                or (self.w8a8_ok and w8a8_now(x.shape[0]))):
            return None
        from vibeqwen_kernels.fp8.mma import MMA_MAX_M, fp8_linear_mma_add_rms_norm
        from vibeqwen_kernels.norm_fused import SPLITK_NORM_MAX_D

        if not 1 <= x.shape[0] <= min(MMA_MAX_M, FP8_DECODE_MAX_M) or self.packed.n > SPLITK_NORM_MAX_D:
            return None
        return fp8_linear_mma_add_rms_norm(x, self.mma, residual, norm_weight, eps)


class NVFP4Linear:
    """y = x W^T with W in NVFP4 (W4A16 Triton kernels)."""

    def __init__(self, packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor):
        from vibeqwen_kernels.nvfp4 import prepack_nvfp4

        self.weight = prepack_nvfp4(packed, block_scale, _nvfp4_global(global_scale))
        self.out_features = packed.shape[0]
        self.mma = None  # the MMA kernels' copy (`enable_mma`)

    def enable_mma(self) -> bool:
        """Also keep the weight in the CUDA MMA kernels' layout and run fp32-output calls of 1..MMA_MAX_M rows
        there (`vibeqwen_kernels.nvfp4.mma`: the LM head at 1-64 rows takes 89-236 us there against 170-382
        us in the Triton kernels on the H200). Costs a second copy of the weight (318 MB for the LM head).
        Returns whether it is on (False where the MMA library does not run: CPU, before sm_90,
        VIBEQWEN_MOE_MMA=0)."""
        from vibeqwen_kernels.nvfp4.mma import mma_supported, prepack_nvfp4_mma

        w = self.weight
        if self.mma is None and mma_supported(w.n, w.k, w.device):
            self.mma = prepack_nvfp4_mma(w.packed, w.block_scale, w.global_scale, repacked=w.repacked)
        return self.mma is not None

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, xq=None) -> torch.Tensor:
        """x [M, K] -> [M, N] of `out_dtype` (fp32 accumulation either way; fp32 keeps the LM head's logits
        unrounded, so near-equal logits do not become exact bf16 ties). xq (quantized rows for FP8 layers) is
        ignored."""
        from vibeqwen_kernels.nvfp4 import nvfp4_linear

        if self.mma is not None and out_dtype == torch.float32 and x.dtype == torch.bfloat16:
            from vibeqwen_kernels.nvfp4.mma import MMA_MAX_M, nvfp4_linear_mma

            if 1 <= x.shape[0] <= MMA_MAX_M:
                return nvfp4_linear_mma(x, self.mma)
        return nvfp4_linear(x, self.weight, out_dtype=out_dtype)


class ConcatLinear:
    """Modules of several precisions reading one input: consecutive FP8 modules share one FP8 weight (per-row
    scales), consecutive BF16 modules one dense weight, NVFP4 modules (one global scale each) run alone.
    `split` returns each module's output as a view of its group's output (no concatenation copy); calling
    the layer concatenates them.

    GDN's input projection in the vendor layout is qkv | z (FP8) and b | a (BF16): two launches, not four
    plus a concatenation. When every group is FP8 or BF16, many-row W8A16 passes (the FP8 groups' bf16
    copies) run as one GEMM on one dense weight of all groups (`dense`; the groups' own bf16 weights are
    views of it, so it costs no memory): one launch (at 1k prefill tokens the separate b | a GEMM took
    6 us a layer)."""

    def __init__(self, groups: list, group_sizes: list[list[int]]):
        self.groups = groups
        self.group_sizes = group_sizes
        self.sizes = [n for g in group_sizes for n in g]
        self.out_features = sum(self.sizes)
        self.dense = None
        if all(isinstance(g, (FP8Linear, DenseLinear)) for g in groups):
            self.dense = torch.cat([g.dense if isinstance(g, FP8Linear) else g.weight for g in groups])
            row = 0
            for g in groups:
                n = g.out_features
                if isinstance(g, FP8Linear):
                    g.dense = self.dense[row : row + n]
                else:
                    g.weight = self.dense[row : row + n]
                row += n

    def split(self, x: torch.Tensor, xq=None) -> list[torch.Tensor]:
        """x [M, K] -> one [M, N_i] output per module, in order (views into each group's output). xq: x
        quantized for the FP8 groups' W8A8 branch (see FP8Linear)."""
        if self.dense is not None and x.shape[0] > FP8_DECODE_MAX_M and not (_W8A8 and self.w8a8_ok):
            return list(torch.split(F.linear(x, self.dense), self.sizes, dim=-1))
        outs = []
        for layer, sizes in zip(self.groups, self.group_sizes):
            outs += list(torch.split(layer(x, xq=xq), sizes, dim=-1))
        return outs

    @property
    def w8a8_ok(self) -> bool:
        """Whether its FP8 groups take the W8A8 branch in a W8A8 prompt pass (bf16 activations)."""
        return any(isinstance(g, FP8Linear) and g.w8a8_ok for g in self.groups)

    def __call__(self, x: torch.Tensor, xq=None) -> torch.Tensor:
        return torch.cat(self.split(x, xq), dim=-1)


def split_outputs(layer, x: torch.Tensor, sizes: list[int], xq=None) -> list[torch.Tensor]:
    """Each fused module's output as a view: x [M, K] (the activation dtype) -> [M, sizes[i]] for i in order.
    layer: what `fused_linear` returned for those modules, sizes its out_features list. xq: x quantized for
    the W8A8 branch of FP8 layers (`QuantizedRows`), or None."""
    if isinstance(layer, ConcatLinear):
        return layer.split(x, xq)
    return list(torch.split(layer(x, xq=xq), sizes, dim=-1))


def w8a8_rows(layer, m: int) -> bool:
    """Whether `layer` (a fused_linear result) given m rows now runs an FP8 group's W8A8 branch: its input is
    worth quantizing once, in the kernel that produces it. Raises ValueError for a bad ``VIBEQWEN_FP8_DECODE_W8A8``."""
    fp8 = isinstance(layer, (FP8Linear, ConcatLinear)) and layer.w8a8_ok
    return fp8 and w8a8_now(m)


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
