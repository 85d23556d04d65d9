"""FP8 (E4M3, per-tensor or per-row scale) weight-only linear: ``y = x @ (w * scale)^T`` (W8A16).

Public surface: :class:`FP8Weight`, :func:`prepack_fp8` (load time), :func:`fp8_linear` (run time) and
the plain-torch reference :func:`fp8_linear_ref`. The Triton kernels live in ``_linear_kernels.py``
and are imported on first use, so this module imports on machines without Triton.

Dequantization (ModelOpt FP8 export; :func:`vibeqwen.checkpoint.quant.fp8_dequantize`):
``w = float32(q) * scale``. The kernels widen ``q`` exactly to the activation dtype in registers
(every E4M3 value is exact in bf16/fp16), accumulate ``x @ q^T`` in fp32 and multiply by the row's
scale once at the end (fp32), then round to the output dtype.

Kernels, by M (rows of x), see :func:`pick_config`:

* M <= 4: CUDA-core GEMV, split over N and K (fp32 partials + a deterministic reduce kernel).
* 4 < M <= 64: tensor-core kernel with the weight as the wide MMA operand, BLOCK_M = pow2 >= M,
  split over N and K as above so even narrow weights fill the 132 SMs.
* M > 64: the same tensor-core kernel as a tiled GEMM (128 x 128 tiles, grouped order, no split).

Up to M = 64 a table tuned on the H200 (configs/fp8_h200.json, ``bench/kernels/bench_fp8.py --tune``) may
instead pick either kernel and its blocks per (N, K) and M; the rules above are the fallback.

Every launch's grid depends only on shapes; no host<->device sync: CUDA-graph capturable. Split-K
workspaces are allocated per call with ``torch.empty`` (fine under graph capture: the graph's pool).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch
from vibeqwen_kernels.pdl import pdl_launch
from vibeqwen_kernels.tuned_configs import load_tuned_table, log2_distance

__all__ = ["FP8Weight", "fp8_linear", "fp8_linear_ref", "pick_config", "prepack_fp8"]

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Largest M served by the CUDA-core GEMV kernel.
GEMV_MAX_M = 4
#: Largest M served by the split-K tensor-core decode configuration.
DECODE_MAX_M = 64
#: Programs a split-K launch aims for (~4 per SM on the H200's 132 SMs).
_TARGET_PROGRAMS = 528


@dataclass(frozen=True)
class FP8Weight:
    """An FP8 E4M3 weight in the layout the kernels read (built by :func:`prepack_fp8`).

    Attributes:
        weight: float8_e4m3fn ``[N, K]``, contiguous (the checkpoint's ``weight``).
        scale: float32 ``[1]`` (per-tensor) or ``[N]`` (per output row: concatenated matrices with
            different per-tensor scales), contiguous, on the weight's device; a multiplier
            (checkpoint ``weight_scale``).
    """

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def n(self) -> int:
        return self.weight.shape[0]

    @property
    def k(self) -> int:
        return self.weight.shape[1]

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        """Bytes a full pass over the weight reads (codes + scales)."""
        return self.weight.numel() + 4 * self.scale.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[N, K]`` ``dtype`` tensor ``float32(weight) * scale`` (rounded once to ``dtype``)."""
        return (self.weight.float() * self.scale.reshape(-1, 1)).to(dtype)


def prepack_fp8(
    weight: torch.Tensor,
    weight_scale: float | torch.Tensor,
    device: torch.device | str | None = None,
) -> FP8Weight:
    """Check a checkpoint FP8 weight and put it where :func:`fp8_linear` reads it.

    Args:
        weight: float8_e4m3fn ``[N, K]`` (checkpoint ``weight``); must not contain NaN codes.
        weight_scale: multiplier(s): a Python float, a one-element tensor (0-d or ``[1]``), or an
            ``[N]`` tensor of per-output-row scales (e.g. ``torch.cat([s_q.expand(Nq), s_z.expand(Nz)])``
            after concatenating several per-tensor-scaled matrices along N).
        device: where the result lives; default ``weight``'s device.

    Returns:
        :class:`FP8Weight` with contiguous tensors on ``device`` (scale float32 ``[1]`` or ``[N]``).

    Raises:
        TypeError: ``weight`` not a tensor, or ``weight_scale`` not a number/tensor.
        ValueError: wrong dtype or dimensions, an empty weight, a scale with another element count,
            or a non-finite scale (checked once here, on the host: load time only).
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"prepack_fp8: weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(
            f"prepack_fp8: weight must be float8_e4m3fn [N, K], got {weight.dtype} {tuple(weight.shape)}"
        )
    n, k = weight.shape
    if n == 0 or k == 0:
        raise ValueError(f"prepack_fp8: empty weight {tuple(weight.shape)}")
    if isinstance(weight_scale, bool) or not isinstance(weight_scale, (int, float, torch.Tensor)):
        raise TypeError(
            f"prepack_fp8: weight_scale must be a float or tensor, got {type(weight_scale).__name__}"
        )
    dev = torch.device(device) if device is not None else weight.device
    s = torch.as_tensor(weight_scale).detach().to(device=dev, dtype=torch.float32).reshape(-1).contiguous()
    if s.numel() not in (1, n):
        raise ValueError(f"prepack_fp8: weight_scale must have 1 or N={n} elements, got {s.numel()}")
    if not bool(torch.isfinite(s).all()):
        raise ValueError("prepack_fp8: weight_scale must be finite")
    return FP8Weight(weight=weight.to(dev).contiguous(), scale=s)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor | FP8Weight, scale=None) -> torch.Tensor:
    """Reference ``y = x @ (float32(q) * scale)^T`` entirely in float32 (plain torch, any device).

    Args:
        x: ``[M, K]`` float tensor.
        weight: float8_e4m3fn ``[N, K]`` (then ``scale``: float, one-element or ``[N]`` tensor), or an
            :class:`FP8Weight` (``scale`` ignored).

    Returns:
        float32 ``[M, N]`` on ``x``'s device.

    Raises:
        ValueError: ``x`` not 2-D float, K mismatch, or a scale of the wrong size.
    """
    if isinstance(weight, FP8Weight):
        q, s = weight.weight, weight.scale
    else:
        q, s = weight, scale
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError("fp8_linear_ref: x must be a 2-D float tensor [M, K]")
    if q.dim() != 2 or q.shape[1] != x.shape[1]:
        raise ValueError(f"fp8_linear_ref: x is {tuple(x.shape)} but the weight is {tuple(q.shape)}")
    s = torch.as_tensor(s).to(device=x.device, dtype=torch.float32).reshape(-1)
    if s.numel() not in (1, q.shape[0]):
        raise ValueError(f"fp8_linear_ref: scale must have 1 or N={q.shape[0]} elements, got {s.numel()}")
    w = q.to(x.device).float() * s.reshape(-1, 1)
    return x.float() @ w.t()


def fp8_linear(x: torch.Tensor, weight: FP8Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ (q * scale)^T`` with the FP8 weight widened in registers (W8A16), fp32 accumulation.

    Args:
        x: ``[M, K]`` bf16/fp16/fp32 on the weight's device; rows may be strided (a non-contiguous
            last dim is copied). The weight is widened to x's dtype (fp32 x: fp32 ``ieee`` dot, slow;
            meant for tests).
        weight: from :func:`prepack_fp8`, ``weight.k == K``.
        out: optional ``[M, N]`` bf16/fp16/fp32 tensor on x's device, contiguous last dim.

    Returns:
        ``out``, or a new ``[M, N]`` tensor of ``x.dtype``. Differs from :func:`fp8_linear_ref` by fp32
        summation order, the scale applied after the sum, and the final rounding (2^-9 relative, bf16).

    Raises:
        TypeError: ``weight`` is not an :class:`FP8Weight`.
        ValueError: bad ``x`` (dims, dtype, K, device), a bad ``out``, or CPU tensors outside the
            Triton interpreter.
    """
    if not isinstance(weight, FP8Weight):
        raise TypeError(
            f"fp8_linear: weight must be an FP8Weight (see prepack_fp8), got {type(weight).__name__}"
        )
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _X_DTYPES:
        raise ValueError(
            "fp8_linear: x must be a 2-D bf16/fp16/fp32 tensor [M, K], got "
            f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}"
        )
    m, k = x.shape
    n = weight.n
    if k != weight.k:
        raise ValueError(f"fp8_linear: x has K={k} but the weight is [{n}, {weight.k}]")
    if x.device != weight.device:
        raise ValueError(f"fp8_linear: x is on {x.device} but the weight is on {weight.device}")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"fp8_linear: needs CUDA tensors (got {x.device}); use fp8_linear_ref or TRITON_INTERPRET=1"
        )
    if out is None:
        out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    elif (
        not isinstance(out, torch.Tensor)
        or tuple(out.shape) != (m, n)
        or out.dtype not in _X_DTYPES
        or out.device != x.device
        or (m > 0 and n > 1 and out.stride(1) != 1)
    ):
        raise ValueError(
            f"fp8_linear: out must be a [{m}, {n}] bf16/fp16/fp32 tensor on {x.device} with a contiguous "
            f"last dim, got {getattr(out, 'dtype', None)} {tuple(getattr(out, 'shape', ()))}"
        )
    if m == 0:
        return out
    if k > 1 and x.stride(1) != 1:
        x = x.contiguous()
    _launch(x, weight, out, pick_config(m, n, k))
    return out


def _pow2_at_least(v: int, lo: int) -> int:
    return max(lo, 1 << max(0, (v - 1).bit_length()))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split(n_blocks: int, k: int, bk: int) -> int:
    """Power-of-two K split giving about _TARGET_PROGRAMS programs, at most one per K tile."""
    k_tiles = _cdiv(k, bk)
    split = 1
    while n_blocks * split * 2 <= _TARGET_PROGRAMS and split * 2 <= k_tiles:
        split *= 2
    return split


def _split_and_bk(n_blocks: int, k: int, bk: int, min_bk: int) -> tuple[int, int]:
    """(SPLIT_K, BLOCK_K): shrink BLOCK_K (down to min_bk) while too few programs fill the GPU."""
    split = _split(n_blocks, k, bk)
    while n_blocks * split * 2 <= _TARGET_PROGRAMS and bk > min_bk:
        bk //= 2
        split = _split(n_blocks, k, bk)
    return split, bk


#: Keys of a launch configuration (KIND is "gemv" or "mm"; W_AS_A only for "mm").
CONFIG_KEYS = ("KIND", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "GROUP_M", "num_warps", "num_stages")


@lru_cache(maxsize=1)
def _tuned_table() -> dict:
    """configs/fp8_h200.json (or $VIBEQWEN_FP8_CONFIGS): ``{"configs": {"<N>x<K>": {"<M>": config}}}`` written
    by ``bench/kernels/bench_fp8.py --tune``; {} when absent or unreadable."""
    return load_tuned_table("fp8_h200.json", "VIBEQWEN_FP8_CONFIGS")


def _valid(cfg: dict, m: int) -> bool:
    """A tuned entry the kernels can run for M rows and K columns (else the heuristic is used)."""
    try:
        if cfg["KIND"] not in ("gemv", "mm") or any(not isinstance(cfg[key], int) for key in CONFIG_KEYS[1:]):
            return False
        blocks_ok = all(v > 0 and v & (v - 1) == 0 for v in (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]))
        if cfg["KIND"] == "gemv":
            blocks_ok = blocks_ok and cfg["BLOCK_M"] >= m and cfg["BLOCK_M"] <= GEMV_MAX_M
        else:
            blocks_ok = blocks_ok and min(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) >= 16
        w_as_a = cfg.get("W_AS_A", 1)
        return (blocks_ok and cfg["SPLIT_K"] >= 1 and cfg["num_warps"] >= 1 and cfg["num_stages"] >= 1
                and type(w_as_a) is int and w_as_a in (0, 1))
    except (KeyError, TypeError):
        return False


def pick_config(m: int, n: int, k: int) -> dict[str, int]:
    """Launch configuration for ``[M, K] x [N, K]^T``: for M <= DECODE_MAX_M the tuned entry of this (N, K)
    (configs/fp8_h200.json) whose M is nearest in log2, if one is valid for M rows (a gemv entry's BLOCK_M
    is raised to the power of two >= M), else the heuristic below.

    Keys: KIND ("gemv" or "mm"), BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, GROUP_M, num_warps, num_stages,
    and for "mm" W_AS_A (1: weight is the MMA's A operand, decode; 0: ``x @ w^T`` orientation).
    """
    entries = _tuned_table().get("configs", {}).get(f"{n}x{k}") if m <= DECODE_MAX_M else None
    if isinstance(entries, dict) and entries:
        try:
            for key in sorted(entries, key=lambda mm: log2_distance(mm, m)):
                cfg = dict(entries[key])
                if cfg.get("KIND") == "gemv":
                    cfg["BLOCK_M"] = _pow2_at_least(m, 1)
                if _valid(cfg, m):
                    return cfg
        except (ValueError, TypeError, AttributeError):
            pass
    return _heuristic_config(m, n, k)


def _heuristic_config(m: int, n: int, k: int) -> dict[str, int]:
    bk_cap = _pow2_at_least(k, 32)
    if m <= GEMV_MAX_M:
        bn = 32
        split, bk = _split_and_bk(_cdiv(n, bn), k, min(256, bk_cap), 64)
        return {
            "KIND": "gemv",
            "BLOCK_M": _pow2_at_least(m, 1),
            "BLOCK_N": bn,
            "BLOCK_K": bk,
            "SPLIT_K": split,
            "GROUP_M": 1,
            "num_warps": 4,
            "num_stages": 2,
        }
    if m <= DECODE_MAX_M:
        bn = min(64, _pow2_at_least(n, 16))
        split, bk = _split_and_bk(_cdiv(n, bn), k, min(128, bk_cap), 64)
        return {
            "KIND": "mm",
            "BLOCK_M": _pow2_at_least(m, 16),
            "BLOCK_N": bn,
            "BLOCK_K": bk,
            "SPLIT_K": split,
            "GROUP_M": 1,
            "W_AS_A": 1,
            "num_warps": 4,
            "num_stages": 3,
        }
    return {
        "KIND": "mm",
        "BLOCK_M": 128,
        "BLOCK_N": min(128, _pow2_at_least(n, 16)),
        "BLOCK_K": min(64, bk_cap),
        "SPLIT_K": 1,
        "GROUP_M": 8,
        "W_AS_A": 0,
        "num_warps": 8,
        "num_stages": 3,
    }


@lru_cache(maxsize=1)
def _kernels():
    from vibeqwen_kernels.fp8 import _linear_kernels

    return _linear_kernels


def _launch(x: torch.Tensor, weight: FP8Weight, out: torch.Tensor, cfg: dict[str, int]) -> None:
    """Launch on checked arguments with an explicit config (tests and the benchmark call this).

    ``cfg["SPLIT_K"]`` is clamped so no split is empty; K_PER_SPLIT is a multiple of BLOCK_K.
    """
    kern = _kernels()
    m, k = x.shape
    n = weight.n
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    k_tiles = _cdiv(k, bk)
    tiles_per_split = _cdiv(k_tiles, max(1, cfg["SPLIT_K"]))
    split = _cdiv(k_tiles, tiles_per_split)
    k_per_split = tiles_per_split * bk
    even_k = split * k_per_split == k
    stride_s = 0 if weight.scale.numel() == 1 else 1
    if split > 1:
        ws = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    else:
        ws = out  # not read
    args = (x, weight.weight, weight.scale, out, ws, m, n, k, x.stride(0), weight.weight.stride(0),
            out.stride(0), stride_s, k_per_split)  # fmt: skip
    if cfg["KIND"] == "gemv":
        if bm < m or bm & (bm - 1):
            raise ValueError(f"fp8_linear: gemv BLOCK_M={bm} must be a power of two >= M={m}")
        kern._fp8_gemv_kernel[(_cdiv(n, bn), split)](
            *args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, EVEN_K=even_k,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            **pdl_launch(x.device),
        )  # fmt: skip
    else:
        if min(bm, bn, bk) < 16:
            raise ValueError(f"fp8_linear: tensor-core tiles need every block >= 16, got {cfg}")
        grid = (_cdiv(m, bm) * _cdiv(n, bn), split)
        kern._fp8_mm_kernel[grid](
            *args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], SPLIT_K=split, EVEN_K=even_k,
            DOT_IEEE=x.dtype == torch.float32, W_AS_A=bool(cfg.get("W_AS_A", 1)), num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"], **pdl_launch(x.device),
        )  # fmt: skip
    if split > 1:
        block = 1024
        kern._fp8_splitk_reduce_kernel[(m, _cdiv(n, block))](
            ws, weight.scale, out, m, n, out.stride(0), stride_s, SPLIT_K=split, BLOCK=block, num_warps=4,
            **pdl_launch(ws.device),
        )
