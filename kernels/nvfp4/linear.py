"""NVFP4 weight-only linear layer on the GPU: ``y = x @ w^T`` with ``w`` in NVFP4 (W4A16).

Public surface: :class:`NVFP4Weight`, :func:`prepack_nvfp4` (load time) and :func:`nvfp4_linear`
(run time). The Triton kernels live in ``_linear_kernels.py`` and are imported on first use, so this
module imports on machines without Triton. The reference is :func:`.naive.nvfp4_linear_ref`.

Two kernels, chosen by the number of rows M of ``x``:

* decode (M <= 16, or M <= 64 for narrow weights, see :func:`choose_kernel`): one program per
  ``BLOCK_N`` weight rows and K split (split-K with an in-kernel reduction by the last program to
  finish, so small N still fills the GPU); the weight is the MMA's wide operand and comes straight
  from registers, the tokens the narrow one, so the weight is read once while the tensor cores do
  the (tiny) arithmetic.
* gemv (M <= 8, where ``configs/nvfp4_h200.json`` lists a "gemv" entry for the shape): the same
  split-K streaming on the CUDA cores instead of the tensor cores: each thread loads whole 8-byte scale
  groups, widens them to exact E2M1 values, multiplies by x in fp32 and applies the block scale once
  per group (no [BK, 16] x tile, no per-lane scale bytes).
* prefill (M larger): one ``[BLOCK_M tokens, BLOCK_N rows]`` output tile per program, programs that
  share a weight tile numbered together so the weight comes from HBM about once; each weight tile is
  widened to bf16 in registers and fed to the tensor cores (``tl.dot``, wgmma on Hopper).

Block sizes come from ``configs/nvfp4_h200.json`` (tuned on an H200 by
``bench/kernels/bench_nvfp4.py --tune``) when it lists the shape, else from the heuristics below.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import torch
from vibeqwen_kernels.pdl import pdl_launch
from vibeqwen_kernels.tuned_configs import load_tuned_table, log2_distance

__all__ = [
    "DECODE_MAX_M",
    "NVFP4Weight",
    "choose_kernel",
    "nvfp4_linear",
    "prepack_nvfp4",
    "unpack_kernel_order",
]

#: Largest M always served by the decode kernel; see :func:`choose_kernel` for the rest.
DECODE_MAX_M = 16
#: Up to this M, weights too narrow to fill the GPU with prefill tiles still use the split-K decode kernel.
SMALL_N_DECODE_MAX_M = 64
#: Up to this M, a tuned "gemv" config (configs/nvfp4_h200.json) may route decode to the CUDA-core kernel.
GEMV_MAX_M = 8
#: "Narrow": fewer output features than this (the experts' 512 and 2048, not lm_head's 248320).
SMALL_N = 16384

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Config key names the launcher reads; anything else in the JSON is ignored.
_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


@dataclass(frozen=True)
class NVFP4Weight:
    """An NVFP4 weight in the layout the kernels read (built by :func:`prepack_nvfp4`).

    Codes are repacked at load time (the checkpoint on disk stays as shipped): within each 16-element
    scale group, byte ``j`` (0..7) holds k ``j`` in its low nibble and k ``8 + j`` in its high nibble,
    so the dequantizer's output lands in the MMA's (k, k+1) register pairs with fewer shuffles. Block
    scales stay as shipped; the scalar global scale moves to a device tensor so a launch never syncs
    with the host (and CUDA graphs can capture it).

    Attributes:
        packed: uint8 ``[N, K // 2]``, contiguous, repacked as above (not the checkpoint's order:
            use :func:`unpack_kernel_order` to get the checkpoint's bytes back).
        block_scale: float8_e4m3fn ``[N, K // 16]``, contiguous.
        global_scale: float32 ``[1]`` (checkpoint ``weight_scale_2``, a multiplier).
        repacked: False when ``packed`` kept the checkpoint's nibble order (``repack=False``).
    """

    packed: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor
    repacked: bool = True

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
    repack: bool | None = None,
) -> NVFP4Weight:
    """Check a checkpoint NVFP4 weight and put it in the layout :func:`nvfp4_linear` reads.

    Args:
        packed: uint8 ``[N, K // 2]`` (checkpoint ``weight``), K a multiple of 16.
        block_scale: float8_e4m3fn ``[N, K // 16]`` (checkpoint ``weight_scale``).
        global_scale: checkpoint ``weight_scale_2`` (a multiplier; compressed-tensors stores the
            reciprocal: invert it first): Python float or one-element tensor.
        device: where the result lives; default ``packed``'s device.
        repack: put the codes in the kernels' nibble order (default True; env
            ``VIBEQWEN_NVFP4_REPACK=0`` makes the default False, keeping the checkpoint's order,
            which the kernels also read, a little slower).

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
        raise TypeError(
            f"prepack_nvfp4: global_scale must be a float or tensor, got {type(global_scale).__name__}"
        )
    dev = torch.device(device) if device is not None else packed.device
    gs = torch.as_tensor(global_scale).detach().to(device=dev, dtype=torch.float32).reshape(-1)
    if gs.numel() != 1:
        raise ValueError(f"prepack_nvfp4: global_scale must be one number, got shape {tuple(gs.shape)}")
    if not bool(torch.isfinite(gs).all()):
        raise ValueError(f"prepack_nvfp4: global_scale must be finite, got {gs.tolist()}")
    if repack is None:
        repack = os.environ.get("VIBEQWEN_NVFP4_REPACK", "1") != "0"
    packed = packed.to(dev)
    return NVFP4Weight(
        packed=_to_kernel_order(packed) if repack else packed.contiguous(),
        block_scale=block_scale.to(dev).contiguous(),
        global_scale=gs.contiguous(),
        repacked=repack,
    )


def _to_kernel_order(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint nibble order (byte i = k 2i | k 2i+1 << 4) -> kernel order (byte 8g+j = k 16g+j |
    k 16g+8+j << 4)."""
    n, kh = packed.shape
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(n, kh // 8, 16)  # [N, K/16, 16]
    return (codes[..., :8] | (codes[..., 8:] << 4)).reshape(n, kh).contiguous()


def unpack_kernel_order(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of the load-time repack: kernel-order ``NVFP4Weight.packed`` -> checkpoint order."""
    n, kh = packed.shape
    g = packed.reshape(n, kh // 8, 8)
    codes = torch.cat((g & 0x0F, g >> 4), dim=-1)  # [N, K/16, 16] in k order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(n, kh).contiguous()


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

    Split-K decode launches count arrivals in one int32 buffer per device (reset by each launch,
    so CUDA graphs may capture them): do not run two of them concurrently on different streams.
    """
    if not isinstance(weight, NVFP4Weight):
        raise TypeError(
            f"nvfp4_linear: weight must be an NVFP4Weight (see prepack_nvfp4), got {type(weight).__name__}"
        )
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _X_DTYPES:
        raise ValueError(
            "nvfp4_linear: x must be a 2-D bf16/fp16/fp32 tensor [M, K], got "
            f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}"
        )
    m, k = x.shape
    n = weight.n
    if k != weight.k:
        raise ValueError(
            f"nvfp4_linear: x has K={k} but the weight has K={weight.k} (shape [{n}, {weight.k}])"
        )
    if x.device != weight.device:
        raise ValueError(f"nvfp4_linear: x is on {x.device} but the weight is on {weight.device}")
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if x.device.type != "cuda" and not interpret:
        raise ValueError(
            f"nvfp4_linear: needs CUDA tensors (got {x.device}); use nvfp4_linear_ref on the CPU "
            "or set TRITON_INTERPRET=1"
        )
    use_asm = (
        x.device.type == "cuda" and not interpret and os.environ.get("VIBEQWEN_NVFP4_PORTABLE", "0") != "1"
    )
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

    kind = choose_kernel(m, n)
    _launch(x, weight, out, pick_config(kind, m, n, k), kind == "decode", use_asm)
    return out


def choose_kernel(m: int, n: int) -> str:
    """ "decode" (split-K streaming) for M <= 16, and up to M = 64 when N is small (prefill tiles would
    leave most SMs idle there); "prefill" otherwise."""
    if m <= DECODE_MAX_M or (m <= SMALL_N_DECODE_MAX_M and n < SMALL_N):
        return "decode"
    return "prefill"


def _launch(
    x: torch.Tensor, weight: NVFP4Weight, out: torch.Tensor, cfg: dict[str, int], decode: bool, use_asm: bool
) -> None:
    """Launch one kernel on checked arguments (the benchmark calls this to try block sizes)."""
    kern = _kernels()
    m, n, k = x.shape[0], weight.n, weight.k
    bm, bn, bk, warps = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    # The dequantizer converts 4 bytes per instruction group: every thread must own at least 4 (the
    # GEMV kernel's threads own whole 8-byte groups).
    if bk < 16 or (not cfg.get("FMA", 0) and (bn * bk // 2 < 4 * 32 * warps or bm < 16)):
        raise ValueError(
            f"nvfp4_linear: block config {cfg} gives a thread fewer than 4 weight bytes per tile"
        )
    scales = weight.block_scale.view(torch.uint8)  # the kernels read raw e4m3 bits
    common = (m, n, k, x.stride(0), weight.packed.stride(0), scales.stride(0), out.stride(0))
    if decode and cfg.get("FMA", 0):
        if m > GEMV_MAX_M:
            raise ValueError(f"nvfp4_linear: the CUDA-core GEMV kernel takes M <= {GEMV_MAX_M}, got M={m}")
        split = cfg.get("SPLIT_K", 1)
        n_blocks = triton_cdiv(n, bn)
        ws, cnt = _split_workspace(x, weight, split, n_blocks, bn, m)
        kern._nvfp4_gemv_fma_kernel[(n_blocks, split)](
            x,
            weight.packed,
            scales,
            weight.global_scale,
            out,
            ws,
            cnt,
            *common,
            BLOCK_M=m,
            BLOCK_N=bn,
            BLOCK_K=bk,
            SPLIT_K=split,
            EVEN_K=k % (split * bk) == 0,
            USE_ASM=use_asm,
            REPACKED=weight.repacked,
            PREFETCH=bool(cfg.get("PREFETCH", 0)),
            num_warps=warps,
            num_stages=cfg["num_stages"],
            **pdl_launch(x.device),
        )
    elif decode:
        if m > bm:
            raise ValueError(f"nvfp4_linear: the decode kernel takes M <= BLOCK_M = {bm}, got M={m}")
        split = cfg.get("SPLIT_K", 1)
        n_blocks = triton_cdiv(n, bn)
        ws, cnt = _split_workspace(x, weight, split, n_blocks, bn, bm)
        kern._nvfp4_gemv_kernel[(n_blocks, split)](
            x,
            weight.packed,
            scales,
            weight.global_scale,
            out,
            ws,
            cnt,
            *common,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            SPLIT_K=split,
            USE_ASM=use_asm,
            REPACKED=weight.repacked,
            PREFETCH=bool(cfg.get("PREFETCH", 0)),
            num_warps=warps,
            num_stages=cfg["num_stages"],
            **pdl_launch(x.device),
        )
    else:
        grid = (triton_cdiv(m, bm) * triton_cdiv(n, bn),)
        kern._nvfp4_gemm_kernel[grid](
            x,
            weight.packed,
            scales,
            weight.global_scale,
            out,
            *common,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            USE_ASM=use_asm,
            REPACKED=weight.repacked,
            PREFETCH=bool(cfg.get("PREFETCH", 0)),
            num_warps=warps,
            num_stages=cfg["num_stages"],
            **pdl_launch(x.device),
        )


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _split_workspace(x: torch.Tensor, weight: NVFP4Weight, split: int, n_blocks: int, bn: int, rows: int):
    """(fp32 partial-sum workspace [split * n_blocks * bn * rows], arrival counters) for a split-K launch;
    with split <= 1 neither is read, and a small existing tensor stands in for both."""
    if split <= 1:
        return weight.global_scale, weight.global_scale
    ws = torch.empty(split * n_blocks * bn * rows, device=x.device, dtype=torch.float32)
    return ws, _split_counters(x.device, n_blocks)


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    """int32 zeros the split-K decode kernel counts arrivals in; each launch leaves them at zero again.

    One buffer per device, shared by all launches: kernels that use it must not run concurrently
    (one stream). Allocated on first use (64K entries, before any CUDA-graph capture in practice).
    """
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), device=device, dtype=torch.int32)
        _COUNTERS[device] = buf
    return buf


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
    bk_cap = _pow2_at_least(k, 64)
    if kind == "decode":
        # Narrow row blocks when N is small, and split K until there are ~2 programs per SM.
        bn = 64 if n >= 64 * 132 * 2 else 16
        bk = min(256, bk_cap)
        n_blocks = -(-n // bn)
        split = 1
        while n_blocks * split < 264 and split * 2 * bk <= k:
            split *= 2
        return {
            "BLOCK_M": _pow2_at_least(m, 16),
            "BLOCK_N": bn,
            "BLOCK_K": bk,
            "num_warps": 4,
            "num_stages": 3,
            "SPLIT_K": split,
        }
    bm = 64 if m <= 64 else 128
    return {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": min(128, bk_cap), "num_warps": 4, "num_stages": 3}


@lru_cache(maxsize=1)
def _tuned_table() -> dict:
    """configs/nvfp4_h200.json (or $VIBEQWEN_NVFP4_CONFIGS); {} when absent or unreadable."""
    return load_tuned_table("nvfp4_h200.json", "VIBEQWEN_NVFP4_CONFIGS")


def pick_config(kind: str, m: int, n: int, k: int, gemv: bool = True) -> dict[str, int]:
    """Block sizes for one launch: the tuned entry for ``[n, k]`` whose M is nearest ``m`` (in log2),
    else :func:`default_config`. Decode configs get ``BLOCK_M >= M`` (one block holds every row).
    For M <= GEMV_MAX_M a "gemv" entry (CUDA-core kernel, ``FMA``: 1, ``BLOCK_M`` = M) wins when its
    tuned M is at least as near as the nearest "decode" entry's; ``gemv=False`` ignores those."""
    table = _tuned_table()
    entries = table.get(kind, {}).get(f"{n}x{k}", {})
    gemv = table.get("gemv", {}).get(f"{n}x{k}", {}) if gemv and kind == "decode" and m <= GEMV_MAX_M else {}
    if gemv:
        # the CUDA-core GEMV kernel where its nearest tuned M is at least as near as the MMA kernel's
        def dist(mt: str) -> float:
            return log2_distance(mt, m)

        best_g = min(gemv, key=dist)
        if not entries or dist(best_g) <= min(dist(mt) for mt in entries):
            e = gemv[best_g]
            return {
                "BLOCK_M": m,
                "BLOCK_N": int(e["BLOCK_N"]),
                "BLOCK_K": int(e["BLOCK_K"]),
                "num_warps": int(e["num_warps"]),
                "num_stages": int(e.get("num_stages", 1)),
                "SPLIT_K": int(e.get("SPLIT_K", 1)),
                "PREFETCH": int(e.get("PREFETCH", 0)),
                "FMA": 1,
            }
    if entries:
        best = min(entries, key=lambda mt: log2_distance(mt, m))
        cfg = {key: int(entries[best][key]) for key in _CONFIG_KEYS if key in entries[best]}
        if len(cfg) == len(_CONFIG_KEYS):
            cfg["SPLIT_K"] = int(entries[best].get("SPLIT_K", 1))
            cfg["PREFETCH"] = int(entries[best].get("PREFETCH", 0))
            if kind == "decode":
                # the decode kernel holds all M rows in one block
                cfg["BLOCK_M"] = max(cfg["BLOCK_M"], _pow2_at_least(m, 16))
            return cfg
    return default_config(kind, m, n, k)
