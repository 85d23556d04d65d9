"""NVFP4 weight-only linear layer on the GPU: ``y = x @ w^T`` with ``w`` in NVFP4 (W4A16).

Public surface: :class:`NVFP4Weight`, :func:`prepack_nvfp4` (load time) and :func:`nvfp4_linear`
(run time). The Triton kernels live in ``_linear_kernels.py`` and are imported on first use, so this
module imports on machines without Triton. The reference is :func:`.naive.nvfp4_linear_ref`.

Two kernels, chosen by the number of rows M of ``x``:

* decode (M <= ``DECODE_MAX_M``): one program per ``BLOCK_N`` weight rows streams all of K; the
  weight is the MMA's wide operand, the tokens the narrow one, so the weight is read once at close to
  HBM bandwidth while the tensor cores do the (tiny) arithmetic.
* prefill (M larger): ``[BLOCK_M, BLOCK_N]`` output tiles; each weight tile is widened to bf16 in
  registers once per tile and fed to ``tl.dot``.

Block sizes come from ``configs/nvfp4_h200.json`` (tuned on an H200 by
``bench/kernels/bench_nvfp4.py --tune``) when it lists the shape, else from the heuristics below.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["DECODE_MAX_M", "NVFP4Weight", "nvfp4_linear", "prepack_nvfp4"]

#: Largest M served by the decode kernel; larger M goes to the prefill kernel.
DECODE_MAX_M = 16

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Config key names the launcher reads; anything else in the JSON is ignored.
_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


@dataclass(frozen=True)
class NVFP4Weight:
    """An NVFP4 weight in the layout the kernels read (built by :func:`prepack_nvfp4`).

    The layout is the checkpoint's (ModelOpt), kept as shipped: the kernels widen E2M1 codes straight
    from it, so no repacking pays yet; the scalar global scale moves to a device tensor so a launch
    never syncs with the host (and CUDA graphs can capture it).

    Attributes:
        packed: uint8 ``[N, K // 2]``, contiguous; byte ``i`` holds k ``2i`` (low nibble), ``2i+1`` (high).
        block_scale: float8_e4m3fn ``[N, K // 16]``, contiguous.
        global_scale: float32 ``[1]`` (checkpoint ``weight_scale_2``, a multiplier).
    """

    packed: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor

    @property
    def n(self) -> int:
        return self.packed.shape[0]

    @property
    def k(self) -> int:
        return self.packed.shape[1] * 2

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        """Bytes a full pass over the weight reads (codes + block scales + global scale)."""
        return self.packed.numel() + self.block_scale.numel() + 4


def prepack_nvfp4(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: float | torch.Tensor,
    device: torch.device | str | None = None,
) -> NVFP4Weight:
    """Check a checkpoint NVFP4 weight and put it in the layout :func:`nvfp4_linear` reads.

    Args:
        packed: uint8 ``[N, K // 2]`` (checkpoint ``weight``), K a multiple of 16.
        block_scale: float8_e4m3fn ``[N, K // 16]`` (checkpoint ``weight_scale``).
        global_scale: checkpoint ``weight_scale_2`` (a multiplier; compressed-tensors stores the
            reciprocal: invert it first): Python float or one-element tensor.
        device: where the result lives; default ``packed``'s device.

    Returns:
        :class:`NVFP4Weight` with contiguous tensors on ``device``.

    Raises:
        ValueError: wrong dtypes or dimensions, ``block_scale`` shape not ``[N, K // 16]``, K not a
            multiple of 16, an empty weight, or a global scale that is not one finite number.
        TypeError: arguments that are not tensors (or a number for ``global_scale``).
    """
    if not isinstance(packed, torch.Tensor) or not isinstance(block_scale, torch.Tensor):
        raise TypeError("prepack_nvfp4: packed and block_scale must be torch.Tensors")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(
            f"prepack_nvfp4: packed must be uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}"
        )
    n, k = packed.shape[0], packed.shape[1] * 2
    if n == 0 or k == 0 or k % 16:
        raise ValueError(f"prepack_nvfp4: need N > 0 and K a positive multiple of 16, got N={n}, K={k}")
    if block_scale.dtype != torch.float8_e4m3fn or tuple(block_scale.shape) != (n, k // 16):
        raise ValueError(
            f"prepack_nvfp4: block_scale must be float8_e4m3fn [{n}, {k // 16}], got "
            f"{block_scale.dtype} {tuple(block_scale.shape)}"
        )
    if isinstance(global_scale, bool) or not isinstance(global_scale, (int, float, torch.Tensor)):
        raise TypeError(f"prepack_nvfp4: global_scale must be a float or tensor, got {type(global_scale).__name__}")
    dev = torch.device(device) if device is not None else packed.device
    gs = torch.as_tensor(global_scale).detach().to(device=dev, dtype=torch.float32).reshape(-1)
    if gs.numel() != 1:
        raise ValueError(f"prepack_nvfp4: global_scale must be one number, got shape {tuple(gs.shape)}")
    if not bool(torch.isfinite(gs).all()):
        raise ValueError(f"prepack_nvfp4: global_scale must be finite, got {gs.tolist()}")
    return NVFP4Weight(
        packed=packed.to(dev).contiguous(),
        block_scale=block_scale.to(dev).contiguous(),
        global_scale=gs.contiguous(),
    )


def nvfp4_linear(
    x: torch.Tensor,
    weight: NVFP4Weight,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``y = x @ w^T`` for an NVFP4 weight, dequantized in registers (W4A16).

    Args:
        x: ``[M, K]`` bf16 on CUDA (fp16/fp32 are cast to bf16 first: the GPU kernels multiply in
            bf16). Rows may be strided; the last dimension must be contiguous. Under Triton's
            interpreter (``TRITON_INTERPRET=1``, CPU tensors) fp16/fp32 are used as given.
        weight: from :func:`prepack_nvfp4`, on ``x``'s device, ``weight.k == K``.
        out: optional ``[M, N]`` output to write into (last dimension contiguous).
        out_dtype: dtype of a newly allocated output (bf16, fp16 or fp32); ignored when ``out`` is
            given.

    Returns:
        ``[M, N]`` tensor of ``out_dtype`` (or ``out``). Accumulation is fp32; the dequantized
        weight is exact in bf16, so the result differs from ``nvfp4_linear_ref`` by the fp32
        summation order and the final rounding to ``out_dtype`` (about 2^-9 relative for bf16).

    Raises:
        ValueError: ``x`` not a 2-D bf16/fp16/fp32 tensor, K mismatch, devices differ, tensors on the
            CPU outside the interpreter, or a bad ``out`` (shape, dtype, device, layout).
        TypeError: ``weight`` is not an :class:`NVFP4Weight`.
    """
    if not isinstance(weight, NVFP4Weight):
        raise TypeError(f"nvfp4_linear: weight must be an NVFP4Weight (see prepack_nvfp4), got {type(weight).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _X_DTYPES:
        raise ValueError(
            "nvfp4_linear: x must be a 2-D bf16/fp16/fp32 tensor [M, K], got "
            f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}"
        )
    m, k = x.shape
    n = weight.n
    if k != weight.k:
        raise ValueError(f"nvfp4_linear: x has K={k} but the weight has K={weight.k} (shape [{n}, {weight.k}])")
    if x.device != weight.device:
        raise ValueError(f"nvfp4_linear: x is on {x.device} but the weight is on {weight.device}")
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if x.device.type != "cuda" and not interpret:
        raise ValueError(
            f"nvfp4_linear: needs CUDA tensors (got {x.device}); use nvfp4_linear_ref on the CPU "
            "or set TRITON_INTERPRET=1"
        )
    use_asm = x.device.type == "cuda" and not interpret and os.environ.get("VIBEQWEN_NVFP4_PORTABLE", "0") != "1"
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)
    if x.stride(1) != 1:
        x = x.contiguous()

    if out is None:
        if out_dtype not in _OUT_DTYPES:
            raise ValueError(f"nvfp4_linear: out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
        out = torch.empty((m, n), device=x.device, dtype=out_dtype)
    else:
        if (
            not isinstance(out, torch.Tensor)
            or tuple(out.shape) != (m, n)
            or out.dtype not in _OUT_DTYPES
            or out.device != x.device
            or (m > 0 and n > 1 and out.stride(1) != 1)
        ):
            raise ValueError(
                f"nvfp4_linear: out must be a [{m}, {n}] bf16/fp16/fp32 tensor on {x.device} with a "
                f"contiguous last dimension, got {getattr(out, 'dtype', None)} {tuple(getattr(out, 'shape', ()))}"
            )
    if m == 0:
        return out

    decode = m <= DECODE_MAX_M
    _launch(x, weight, out, pick_config("decode" if decode else "prefill", m, n, k), decode, use_asm)
    return out


def _launch(
    x: torch.Tensor, weight: NVFP4Weight, out: torch.Tensor, cfg: dict[str, int], decode: bool, use_asm: bool
) -> None:
    """Launch one kernel on checked arguments (the benchmark calls this to try block sizes)."""
    kern = _kernels()
    m, n, k = x.shape[0], weight.n, weight.k
    # The portable path reads the block scales as raw bits (the interpreter has no fp8 type).
    scales = weight.block_scale if use_asm else weight.block_scale.view(torch.uint8)
    if decode:
        grid = (triton_cdiv(n, cfg["BLOCK_N"]), triton_cdiv(m, cfg["BLOCK_M"]))
        fn = kern._nvfp4_gemv_kernel
    else:
        grid = (triton_cdiv(m, cfg["BLOCK_M"]) * triton_cdiv(n, cfg["BLOCK_N"]),)
        fn = kern._nvfp4_gemm_kernel
    fn[grid](
        x, weight.packed, scales, weight.global_scale, out,
        m, n, k,
        x.stride(0), weight.packed.stride(0), scales.stride(0), out.stride(0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        USE_ASM=use_asm,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@lru_cache(maxsize=1)
def _kernels():
    from vibeqwen_kernels.nvfp4 import _linear_kernels

    return _linear_kernels


def _pow2_at_least(v: int, lo: int) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(v, 1)))))


def default_config(kind: str, m: int, n: int, k: int) -> dict[str, int]:
    """Heuristic block sizes for a shape no tuned config lists (``kind``: "decode" or "prefill")."""
    bk_cap = _pow2_at_least(k, 16)
    if kind == "decode":
        # Enough programs to fill 132 SMs a few times over before widening the tiles.
        bn = 64 if n >= 64 * 132 * 2 else (32 if n >= 32 * 132 else 16)
        return {"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": min(256, bk_cap), "num_warps": 4, "num_stages": 3}
    bm = 64 if m <= 64 else 128
    return {
        "BLOCK_M": bm,
        "BLOCK_N": 128,
        "BLOCK_K": min(64, bk_cap),
        "num_warps": 4 if bm == 64 else 8,
        "num_stages": 3,
    }


@lru_cache(maxsize=1)
def _tuned_table() -> dict:
    path = os.environ.get("VIBEQWEN_NVFP4_CONFIGS")
    try:
        if path:
            with open(path) as f:
                return json.load(f)
        from importlib import resources

        return json.loads((resources.files("vibeqwen_configs") / "nvfp4_h200.json").read_text())
    except (FileNotFoundError, ModuleNotFoundError, json.JSONDecodeError, OSError):
        return {}


def pick_config(kind: str, m: int, n: int, k: int) -> dict[str, int]:
    """Block sizes for one launch: the tuned entry for ``[n, k]`` whose M is nearest ``m`` (in log2),
    else :func:`default_config`. Tuned decode entries always use ``BLOCK_M = 16``."""
    entries = _tuned_table().get(kind, {}).get(f"{n}x{k}", {})
    if entries:
        best = min(entries, key=lambda mt: abs(math.log2(int(mt)) - math.log2(max(m, 1))))
        cfg = {key: int(entries[best][key]) for key in _CONFIG_KEYS if key in entries[best]}
        if len(cfg) == len(_CONFIG_KEYS):
            return cfg
    return default_config(kind, m, n, k)
