"""Fused NVFP4 mixture-of-experts on the GPU (Triton): router top-k, pair/expert alignment, grouped
SwiGLU GEMMs with the weighted sum over each token's experts.

Public surface:

* :func:`fused_router` -- ``[T, E + 1]`` logits (column E = shared-expert gate) -> top-k weights and ids
  with the shared expert appended as slot k (id E, weight sigmoid(logit E)).
* :class:`MoEWeights`, :func:`prepack_moe_nvfp4` -- the E routed experts and the shared expert stacked
  (expert E = shared) in the kernels' layout (load time).
* :func:`moe_align` -- groups the T*k' (token, slot) pairs by expert, groups padded to BLOCK_M.
* :func:`fused_moe` -- ``sum_slot topk_weight * SwiGLU_expert(x)`` per token.
* :func:`pick_moe_config` -- block sizes per T (tuned table ``configs/moe_nvfp4_h200.json`` if present,
  else a heuristic).

Reference semantics: :func:`vibeqwen_kernels.moe.naive.route_topk_ref`, ``moe_experts_ref`` and
``swiglu_mlp_ref`` on the dequantized weights (:func:`vibeqwen.checkpoint.quant.nvfp4_dequantize`);
Qwen3.5/3.6 ``SparseMoeBlock`` (HF ``Qwen3_5MoeSparseMoeBlock``, see ``vibeqwen/model/moe.py``).

Every launch has a grid that depends only on (T, k', E, H, I, config) and no host<->device sync, so
the whole path can be captured in a CUDA graph. The Triton kernels are in ``_fused_kernels.py`` and
are imported on first use (this module imports without Triton).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from vibeqwen_kernels.moe import align_cuda, mma_cuda
from vibeqwen_kernels.pdl import pdl_launch
from vibeqwen_kernels.tuned_configs import load_tuned_table, log2_distance

__all__ = [
    "MoEWeights",
    "align_bounds",
    "default_moe_config",
    "fused_moe",
    "fused_router",
    "moe_align",
    "pick_moe_config",
    "prepack_moe_nvfp4",
]

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Config keys (all ints). GEMM1 = gate/up (BLOCK_N1 columns of each half per program), GEMM2 = down.
#: SPLIT_K1 / SPLIT_K2: split-K factor of GEMM1 / GEMM2 (optional, default 1 = no split; a config or
#: tuned-table entry without them means 1). GEMV (optional, default 0): 1 runs both GEMMs on the CUDA cores,
#: one program per (token, expert) pair (decode; BLOCK_M unused, no alignment), 0 on the tensor cores.
#: SPLIT_GU (optional, default 0; tensor cores only): 1 computes gate and up rows in separate programs (one
#: accumulator each) into the fp32 workspace, finished by the SiLU-mul kernel as split-K is.
#: MMA (optional, default 0): 1 runs both GEMMs in the CUDA kernels of ``mma_cuda.py`` (BLOCK_M = 16: the
#: decode kernel; 32 or 64: the prefill kernel; needs the weights' shuffled copy and a built kernel, else the
#: entry's ``fallback`` config runs); SPLIT_K1 / SPLIT_K2 split K there too, the BLOCK_N/BLOCK_K/WARPS/STAGES
#: keys are unused.
CONFIG_KEYS = (
    "BLOCK_M",
    "BLOCK_N1",
    "BLOCK_K1",
    "WARPS1",
    "STAGES1",
    "BLOCK_N2",
    "BLOCK_K2",
    "WARPS2",
    "STAGES2",
    "SPLIT_K1",
    "SPLIT_K2",
    "GEMV",
    "SPLIT_GU",
    "MMA",
)
#: Keys a config may omit, with their defaults.
OPTIONAL_CONFIG_KEYS = {"SPLIT_K1": 1, "SPLIT_K2": 1, "GEMV": 0, "SPLIT_GU": 0, "MMA": 0}
_MAX_SPLIT = 64
#: Largest T whose tuned MMA = 1 entries with BLOCK_M = 16 (the decode kernel) are used: that kernel was tuned
#: and measured for decode sizes only; a larger T whose nearest entry is such an entry runs its Triton fallback.
#: (An eager 160-256 token verification step ran 88 ms with the CUDA kernel picked for it, 46 ms with the Triton
#: config: not understood yet, see bench/results/h200_notes.md.) MMA entries with BLOCK_M = 32 / 64 (the
#: prefill kernel) are used at any T whose nearest tuned entry they are: the tuner only writes one where it
#: beat every Triton candidate at that T.
MMA_MAX_T = 64
#: (k', E', H, I) that configs/moe_nvfp4_h200.json was tuned for; other shapes get the heuristic.
TUNED_SHAPE = (9, 257, 2048, 512)
#: Decode heuristic: streaming multiprocessors of the target (H200) and programs per SM aimed at.
_NUM_SMS = 132
_PROGRAMS_PER_SM = 6
_MIN_SPLIT_K = 256
#: Pairs per program of the chunked alignment (counted and ranked all-to-all in registers).
_ALIGN_CHUNK = 128
#: Up to this many pairs moe_align uses the all-to-all kernel (no atomics, nothing proportional to E).
_ALIGN_SMALL_MAX = 128
#: programs of the alignment's scan (each sums the whole count matrix, then writes its slice of the experts).
#: H200, moe_align at 1k / 8k tokens (E' 257, block_m 64): 21.4 / 58.6 us with 1 program, 18.5 / 41.7 with 8
_ALIGN_SCAN_PROGRAMS = 8


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _use_asm(device: torch.device) -> bool:
    """The inline-PTX dequantizer of nvfp4/_linear_kernels.py (validated by its GPU tests) on CUDA;
    ``VIBEQWEN_NVFP4_PORTABLE=1`` selects the integer-arithmetic one (as for ``nvfp4_linear``)."""
    return (
        device.type == "cuda" and not _interpret() and os.environ.get("VIBEQWEN_NVFP4_PORTABLE", "0") != "1"
    )


def _check_device(t: torch.Tensor, name: str) -> None:
    if t.device.type != "cuda" and not _interpret():
        raise ValueError(
            f"{name}: needs CUDA tensors (got {t.device}); use the references in vibeqwen_kernels.moe.naive "
            "on the CPU or set TRITON_INTERPRET=1"
        )


@lru_cache(maxsize=1)
def _kernels():
    from vibeqwen_kernels.moe import _fused_kernels

    return _fused_kernels


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(v: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(v, 1)))))


# --------------------------------------------------------------------------------------------- router


def fused_router(
    logits: torch.Tensor, top_k: int, *, shared: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing plus the shared-expert gate, in one kernel.

    Args:
        logits: ``[T, E + 1]`` (``shared=True``) or ``[T, E]`` bf16/fp16/fp32; column E is the
            shared-expert gate logit (``shared_expert_gate(x)``). Last dimension contiguous.
        top_k: experts per token, ``1 <= top_k <= E``.
        shared: whether column E is the shared gate (then slot ``top_k`` is appended).

    Returns:
        ``(topk_weights, topk_ids)``: float32 ``[T, top_k + 1]`` and int32 ``[T, top_k + 1]`` (without the
        extra column when ``shared=False``). Slots ``0..top_k-1``: fp32 softmax over the E routed logits,
        the top_k largest (descending, ties to the lower id), renormalised to sum 1
        (:func:`~vibeqwen_kernels.moe.naive.route_topk_ref`, HF ``Qwen3_5MoeTopKRouter``). Slot
        ``top_k``: id E, weight ``sigmoid(logits[:, E])`` (fp32).

    Raises:
        ValueError: bad shape/dtype/``top_k``, or CPU tensors outside Triton's interpreter.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype not in _X_DTYPES:
        raise ValueError(
            "fused_router: logits must be a 2-D bf16/fp16/fp32 tensor, got "
            f"{getattr(logits, 'dtype', type(logits).__name__)} {tuple(getattr(logits, 'shape', ()))}"
        )
    t, cols = logits.shape
    e = cols - 1 if shared else cols
    if not (isinstance(top_k, int) and 1 <= top_k <= e):
        raise ValueError(f"fused_router: need 1 <= top_k <= E = {e}, got {top_k}")
    _check_device(logits, "fused_router")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    kp = top_k + int(shared)
    weights = torch.empty((t, kp), device=logits.device, dtype=torch.float32)
    ids = torch.empty((t, kp), device=logits.device, dtype=torch.int32)
    if t == 0:
        return weights, ids
    block_e = _pow2_at_least(e, 16)
    block_t = 1 if t <= 8 else 4
    _kernels()._router_topk_kernel[(_cdiv(t, block_t),)](
        logits,
        weights,
        ids,
        t,
        e,
        logits.stride(0),
        weights.stride(0),
        ids.stride(0),
        TOP_K=top_k,
        SHARED=int(shared),
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_C=_pow2_at_least(kp, 2),
        num_warps=4 if block_e >= 512 else 2,
        **pdl_launch(logits.device),
    )
    return weights, ids


# -------------------------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class MoEWeights:
    """Stacked NVFP4 experts (E routed, then the shared expert as number E), in the kernels' layout.

    Attributes (E' = E + 1 experts, H hidden, I intermediate):
        w13_packed: uint8 ``[E', 2I, H/2]``: rows 0..I-1 gate_proj, I..2I-1 up_proj.
        w13_scale: float8_e4m3fn ``[E', 2I, H/16]`` block scales.
        w13_gscale: float32 ``[E', 2I]`` global scale (``weight_scale_2``, a multiplier) per output row:
            the gate's for rows < I, the up's for the rest.
        w2_packed: uint8 ``[E', H, I/2]`` (down_proj).
        w2_scale: float8_e4m3fn ``[E', H, I/16]``.
        w2_gscale: float32 ``[E', H]``.
        repacked: True when the codes are in the kernel nibble order of
            :func:`vibeqwen_kernels.nvfp4.linear.prepack_nvfp4` (within each 16-element scale group,
            byte j holds k = j in its low nibble and k = 8 + j in its high nibble); False: checkpoint
            order (byte i holds k = 2i, 2i+1).
        w13_mma, w2_mma: the same codes and scales shuffled for the CUDA kernels
            (:class:`~vibeqwen_kernels.moe.mma_cuda.MMAWeights`; w13 with its gate and up rows interleaved per
            tile), or None (configs with MMA = 1 then run their fallback).
    """

    w13_packed: torch.Tensor
    w13_scale: torch.Tensor
    w13_gscale: torch.Tensor
    w2_packed: torch.Tensor
    w2_scale: torch.Tensor
    w2_gscale: torch.Tensor
    repacked: bool = True
    w13_mma: object = None
    w2_mma: object = None

    @property
    def num_experts(self) -> int:
        """E' = routed experts + 1 (the shared expert)."""
        return self.w13_packed.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2_packed.shape[1]

    @property
    def intermediate(self) -> int:
        return self.w2_packed.shape[2] * 2

    @property
    def device(self) -> torch.device:
        return self.w13_packed.device

    @property
    def expert_nbytes(self) -> int:
        """Bytes one expert's weights occupy (codes + block scales + global scales)."""
        return sum(t[0].numel() * t.element_size() for t in self._tensors())

    def _tensors(self):
        return (
            self.w13_packed,
            self.w13_scale,
            self.w13_gscale,
            self.w2_packed,
            self.w2_scale,
            self.w2_gscale,
        )


def _to_kernel_order(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint nibble order (byte i = k 2i | k 2i+1 << 4) -> kernel order (byte 8g+j = k 16g+j |
    k 16g+8+j << 4), along the last dimension of any ``[..., K/2]`` uint8 tensor."""
    lead, kh = packed.shape[:-1], packed.shape[-1]
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*lead, kh // 8, 16)
    return (codes[..., :8] | (codes[..., 8:] << 4)).reshape(*lead, kh).contiguous()


def _unpack_kernel_order(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_to_kernel_order`."""
    lead, kh = packed.shape[:-1], packed.shape[-1]
    g = packed.reshape(*lead, kh // 8, 8)
    codes = torch.cat((g & 0x0F, g >> 4), dim=-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(*lead, kh).contiguous()


_Triple = tuple  # (packed uint8 [N, K/2], block_scale e4m3 [N, K/16], global_scale float or 1-elem tensor)


def _check_triple(tr, n: int | None, k: int | None, what: str) -> tuple[int, int]:
    if not isinstance(tr, (tuple, list)) or len(tr) != 3:
        raise TypeError(f"prepack_moe_nvfp4: {what} must be a (packed, block_scale, global_scale) triple")
    packed, scale, gs = tr
    if not isinstance(packed, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise TypeError(f"prepack_moe_nvfp4: {what}: packed and block_scale must be tensors")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(
            f"prepack_moe_nvfp4: {what}: packed must be uint8 [N, K/2], got {packed.dtype} "
            f"{tuple(packed.shape)}"
        )
    pn, pk = packed.shape[0], packed.shape[1] * 2
    if pk % 16 or pn == 0:
        raise ValueError(f"prepack_moe_nvfp4: {what}: K must be a positive multiple of 16, got [{pn}, {pk}]")
    if (n is not None and pn != n) or (k is not None and pk != k):
        raise ValueError(f"prepack_moe_nvfp4: {what}: expected [{n}, {k}] weights, got [{pn}, {pk}]")
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (pn, pk // 16):
        raise ValueError(
            f"prepack_moe_nvfp4: {what}: block_scale must be float8_e4m3fn [{pn}, {pk // 16}], "
            f"got {scale.dtype} {tuple(scale.shape)}"
        )
    if isinstance(gs, bool) or not isinstance(gs, (int, float, torch.Tensor)):
        raise TypeError(f"prepack_moe_nvfp4: {what}: global_scale must be a number or tensor")
    if isinstance(gs, torch.Tensor) and gs.numel() != 1:
        raise ValueError(f"prepack_moe_nvfp4: {what}: global_scale must be one number")
    return pn, pk


def prepack_moe_nvfp4(
    gate: Sequence[_Triple],
    up: Sequence[_Triple],
    down: Sequence[_Triple],
    device: torch.device | str | None = None,
    repack: bool = True,
    mma: bool | None = None,
) -> MoEWeights:
    """Stack per-expert NVFP4 checkpoint weights into :class:`MoEWeights` (load time).

    Args:
        gate, up: E' = E + 1 triples ``(packed uint8 [I, H/2], block_scale float8_e4m3fn [I, H/16],
            global_scale)``, routed experts 0..E-1 then the shared expert; ``global_scale`` is the
            checkpoint ``weight_scale_2`` (a multiplier; invert compressed-tensors' global scale first),
            a float or one-element tensor.
        down: E' triples ``(uint8 [H, I/2], e4m3 [H, I/16], global_scale)``.
        device: where the stacks live (default: the first packed tensor's device).
        repack: put the codes in the kernel nibble order (faster dequantization; default True).
        mma: also keep a copy shuffled for the CUDA kernels (``csrc/moe_mma.cu``; the experts' bytes again,
            +11% for the bf16 block scales; gate|up rows interleaved per tile for the SiLU epilogue). Default: on
            a CUDA device of compute capability >= 9 where the kernels build, unless ``VIBEQWEN_MOE_MMA=0``.

    Returns:
        :class:`MoEWeights` with contiguous tensors on ``device``.

    Raises:
        ValueError: lists of different or zero length, shapes inconsistent across experts or between
            gate/up and down, H or I not a multiple of 16, wrong dtypes, non-finite global scales.
        TypeError: entries that are not (tensor, tensor, number/tensor) triples.
    """
    if not (len(gate) == len(up) == len(down)) or len(gate) == 0:
        raise ValueError(
            f"prepack_moe_nvfp4: need the same non-zero number of gate/up/down experts, got "
            f"{len(gate)}/{len(up)}/{len(down)}"
        )
    i, h = _check_triple(gate[0], None, None, "gate[0]")
    for e in range(len(gate)):
        _check_triple(gate[e], i, h, f"gate[{e}]")
        _check_triple(up[e], i, h, f"up[{e}]")
        _check_triple(down[e], h, i, f"down[{e}]")
    dev = torch.device(device) if device is not None else gate[0][0].device

    def gscale(v) -> torch.Tensor:
        return torch.as_tensor(v).detach().to(device=dev, dtype=torch.float32).reshape(1)

    w13_packed = torch.stack([torch.cat((g[0].to(dev), u[0].to(dev))) for g, u in zip(gate, up)])
    w13_scale = torch.stack([torch.cat((g[1].to(dev), u[1].to(dev))) for g, u in zip(gate, up)])
    w13_gscale = torch.stack(
        [torch.cat((gscale(g[2]).expand(i), gscale(u[2]).expand(i))) for g, u in zip(gate, up)]
    )
    w2_packed = torch.stack([d[0].to(dev) for d in down])
    w2_scale = torch.stack([d[1].to(dev) for d in down])
    w2_gscale = torch.stack([gscale(d[2]).expand(h) for d in down])
    if not bool(torch.isfinite(w13_gscale).all() and torch.isfinite(w2_gscale).all()):
        raise ValueError("prepack_moe_nvfp4: global scales must be finite")
    if repack:
        w13_packed = _to_kernel_order(w13_packed)
        w2_packed = _to_kernel_order(w2_packed)
    if mma is None:
        mma = dev.type == "cuda" and os.environ.get("VIBEQWEN_MOE_MMA", "1") != "0" and mma_cuda.mma_library(dev) is not None
    w13_mma = w2_mma = None
    if mma and i % 16 == 0 and h % 64 == 0 and i % 64 == 0:
        e4m3 = mma_cuda.mlp_e4m3_copy()
        w13_mma = mma_cuda.shuffle_mma_weights(w13_packed, w13_scale, repack, interleave_halves=True, e4m3_copy=e4m3)
        w2_mma = mma_cuda.shuffle_mma_weights(w2_packed, w2_scale, repack, e4m3_copy=e4m3)
    return MoEWeights(
        w13_packed=w13_packed.contiguous(),
        w13_scale=w13_scale.contiguous(),
        w13_gscale=w13_gscale.contiguous(),
        w2_packed=w2_packed.contiguous(),
        w2_scale=w2_scale.contiguous(),
        w2_gscale=w2_gscale.contiguous(),
        repacked=repack,
        w13_mma=w13_mma,
        w2_mma=w2_mma,
    )


# ---------------------------------------------------------------------------------------------- align


def align_bounds(n_pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(P_max, B_max): host-side bounds on the padded pair count and block count of :func:`moe_align`.

    B_max = cdiv(n_pairs, block_m) + min(num_experts, n_pairs): each non-empty group of c pairs takes
    cdiv(c, block_m) <= c / block_m + 1 blocks. P_max = B_max * block_m.
    """
    b_max = _cdiv(n_pairs, block_m) + min(num_experts, n_pairs)
    return b_max * block_m, b_max


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the T*k' (token, slot) pairs by expert, each group padded to a multiple of ``block_m``.

    No host sync, no atomics. Pair ``p = t * k' + s`` is (token t, slot s). Up to 128 pairs (decode) one
    all-to-all program does it; beyond, up to ``ALIGN_CUDA_MAX_PAIRS`` (4608: 512 tokens at k' = 9) one CUDA launch
    where it builds (:mod:`~vibeqwen_kernels.moe.align_cuda`, sm_90+), else three Triton launches over chunks of
    128 pairs (histograms, a scan, a scatter). Every way gives the same outputs; a group keeps the pair order.

    Args:
        topk_ids: int32 ``[T, k']`` (contiguous; other int dtypes are converted), every id in
            ``[0, num_experts)`` (not checked: that would sync; an id out of range corrupts the result).
        num_experts: E' (routed + shared).
        block_m: group padding, a power of two >= 16 (also the GEMM's pairs per block).

    Returns:
        ``(sorted_pair_ids int32 [P_max], block_expert int32 [B_max], num_padded int32 [1])`` with
        ``(P_max, B_max) = align_bounds(T * k', num_experts, block_m)``. Expert e's pairs occupy
        ``sorted_pair_ids[start_e : start_e + count_e]`` (in pair order), starts are
        increasing in e, ``start_{e+1} = start_e + roundup(count_e, block_m)``; all other entries
        (group padding and everything from ``num_padded`` on) hold the sentinel ``T * k'``.
        ``block_expert[b]`` is the expert of positions ``[b * block_m, (b + 1) * block_m)``, -1 for
        ``b >= num_padded / block_m``.

    Raises:
        ValueError: bad shape/dtype, ``block_m`` not a power of two >= 16, CPU tensors outside the
            interpreter.
    """
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.is_floating_point():
        raise ValueError(
            f"moe_align: topk_ids must be an integer [T, k'] tensor, got "
            f"{getattr(topk_ids, 'dtype', None)} {tuple(getattr(topk_ids, 'shape', ()))}"
        )
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"moe_align: block_m must be a power of two >= 16, got {block_m}")
    if num_experts < 1:
        raise ValueError(f"moe_align: num_experts must be >= 1, got {num_experts}")
    _check_device(topk_ids, "moe_align")
    ids = topk_ids.to(torch.int32).contiguous().view(-1)
    n_pairs = ids.numel()
    p_max, b_max = align_bounds(n_pairs, num_experts, block_m)
    dev = ids.device
    sorted_ids = torch.empty(p_max, device=dev, dtype=torch.int32)
    block_expert = torch.empty(b_max, device=dev, dtype=torch.int32)
    num_padded = torch.empty(1, device=dev, dtype=torch.int32)
    if 0 < n_pairs <= _ALIGN_SMALL_MAX:
        np_pad = _pow2_at_least(n_pairs, 16)
        _kernels()._moe_align_small_kernel[(1,)](
            ids,
            sorted_ids,
            block_expert,
            num_padded,
            n_pairs,
            p_max,
            b_max,
            NP=np_pad,
            BLOCK_M=block_m,
            CHUNK=1024,
            num_warps=4 if np_pad <= 64 else 8,
            **pdl_launch(ids.device),
        )
        return sorted_ids, block_expert, num_padded
    if _ALIGN_SMALL_MAX < n_pairs <= align_cuda.ALIGN_CUDA_MAX_PAIRS and align_cuda.align_supported(num_experts, dev):
        align_cuda.moe_align_cuda(ids, num_experts, block_m, sorted_ids, block_expert, num_padded)
        return sorted_ids, block_expert, num_padded
    e_pad = _pow2_at_least(num_experts + 1, 128)  # + a spare histogram bin for masked lanes
    n_chunks = max(1, _cdiv(n_pairs, _ALIGN_CHUNK))
    counts = torch.empty((2, n_chunks, e_pad), device=dev, dtype=torch.int32)  # counts, offsets
    start = torch.empty(e_pad, device=dev, dtype=torch.int32)
    kern = _kernels()
    kern._moe_count_kernel[(n_chunks,)](
        ids, counts[0], n_pairs, E_PAD=e_pad, CHUNK=_ALIGN_CHUNK, num_warps=4, **pdl_launch(ids.device)
    )
    kern._moe_scan_kernel[(_ALIGN_SCAN_PROGRAMS,)](
        counts[0],
        counts[1],
        start,
        sorted_ids,
        block_expert,
        num_padded,
        n_pairs,
        n_chunks,
        num_experts,
        p_max,
        b_max,
        E_PAD=e_pad,
        BLOCK_M=block_m,
        ROWS=16,
        CHUNK_B=4,
        CHUNK_P=1024,
        num_warps=4,
        **pdl_launch(counts.device),
    )
    kern._moe_scatter_kernel[(n_chunks,)](
        ids, counts[1], start, sorted_ids, n_pairs, E_PAD=e_pad, CHUNK=_ALIGN_CHUNK, num_warps=4,
        **pdl_launch(ids.device),
    )
    return sorted_ids, block_expert, num_padded


# -------------------------------------------------------------------------------------------- configs


def _decode_split(k: int, programs: int, block_k: int) -> int:
    """Smallest power-of-two split of K with programs * split >= _PROGRAMS_PER_SM * _NUM_SMS, capped so
    each split walks at least max(_MIN_SPLIT_K, block_k) of K."""
    split = 1
    while programs * split < _PROGRAMS_PER_SM * _NUM_SMS and k // (2 * split) >= max(_MIN_SPLIT_K, block_k):
        split *= 2
    return split


def default_moe_config(
    t: int, k: int = 9, num_experts: int = 257, *, hidden: int = 2048, intermediate: int = 512
) -> dict[str, int]:
    """Heuristic block sizes for T tokens x k' slots over E' experts (no tuned entry).

    BLOCK_M follows the mean pairs per expert (decode: 16, most blocks hold one real pair, the weight
    stream dominates). Decode (mean < 8 pairs per expert) also splits K: with d = min(E', T * k')
    distinct experts, GEMM1 has d * cdiv(I, BLOCK_N1) programs per split and GEMM2 d * cdiv(H, BLOCK_N2);
    SPLIT_K1 / SPLIT_K2 (powers of two) raise that to ~6 programs per SM on 132 SMs, each split walking
    at least 256 of K (H for GEMM1, I for GEMM2), so no program runs a long serial K loop.
    """
    mean = t * k / max(num_experts, 1)
    if mean < 8:
        cfg = {
            "BLOCK_M": 16,
            "BLOCK_N1": 64,
            "BLOCK_K1": 128,
            "WARPS1": 4,
            "STAGES1": 3,
            "BLOCK_N2": 64,
            "BLOCK_K2": 128,
            "WARPS2": 4,
            "STAGES2": 3,
        }
        d = max(1, min(num_experts, t * k))
        cfg["SPLIT_K1"] = _decode_split(hidden, d * _cdiv(intermediate, cfg["BLOCK_N1"]), cfg["BLOCK_K1"])
        cfg["SPLIT_K2"] = _decode_split(intermediate, d * _cdiv(hidden, cfg["BLOCK_N2"]), cfg["BLOCK_K2"])
        cfg["GEMV"] = cfg["SPLIT_GU"] = cfg["MMA"] = 0
        return cfg
    if mean < 48:
        cfg = {
            "BLOCK_M": 32,
            "BLOCK_N1": 64,
            "BLOCK_K1": 128,
            "WARPS1": 4,
            "STAGES1": 3,
            "BLOCK_N2": 128,
            "BLOCK_K2": 64,
            "WARPS2": 4,
            "STAGES2": 3,
        }
    elif mean < 160:
        cfg = {
            "BLOCK_M": 64,
            "BLOCK_N1": 64,
            "BLOCK_K1": 64,
            "WARPS1": 4,
            "STAGES1": 3,
            "BLOCK_N2": 128,
            "BLOCK_K2": 64,
            "WARPS2": 8,
            "STAGES2": 3,
        }
    else:
        cfg = {
            "BLOCK_M": 128,
            "BLOCK_N1": 64,
            "BLOCK_K1": 64,
            "WARPS1": 8,
            "STAGES1": 3,
            "BLOCK_N2": 128,
            "BLOCK_K2": 64,
            "WARPS2": 8,
            "STAGES2": 3,
        }
    return dict(cfg, SPLIT_K1=1, SPLIT_K2=1, GEMV=0, SPLIT_GU=0, MMA=0)


@lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    import logging

    logging.getLogger(__name__).warning(message)


@lru_cache(maxsize=1)
def _tuned_table() -> dict:
    """configs/moe_nvfp4_h200.json (or $VIBEQWEN_MOE_CONFIGS): ``{"configs": {"<T>": {CONFIG_KEYS...}}}``;
    {} when absent or unreadable."""
    return load_tuned_table("moe_nvfp4_h200.json", "VIBEQWEN_MOE_CONFIGS")


def pick_moe_config(
    t: int, k: int = 9, num_experts: int = 257, *, hidden: int = 2048, intermediate: int = 512,
    allow_mma: bool = True,
) -> dict[str, int]:
    """Block sizes for T tokens: the tuned entry whose T is nearest in log2 when the shapes are the ones
    the table was tuned for (:data:`TUNED_SHAPE`: the model's k' = 9, E' = 257, H = 2048, I = 512), else
    :func:`default_moe_config`. Incomplete entries are ignored; an entry without SPLIT_K1 / SPLIT_K2 / GEMV
    means 1 / 1 / 0."""
    entries = _tuned_table().get("configs", {})
    if (k, num_experts, hidden, intermediate) != TUNED_SHAPE and entries and os.environ.get("VIBEQWEN_MOE_CONFIGS"):
        _warn_once(f"VIBEQWEN_MOE_CONFIGS applies to (k', E', H, I) = {TUNED_SHAPE} only; "
                   f"{(k, num_experts, hidden, intermediate)} uses the heuristic configs")
    if (k, num_experts, hidden, intermediate) == TUNED_SHAPE and isinstance(entries, dict) and entries:
        try:
            best = min(entries, key=lambda tt: log2_distance(tt, t))
            entry = entries[best]
            if int(entry.get("MMA", 0)) == 1 and (
                not allow_mma or (t > MMA_MAX_T and int(entry.get("BLOCK_M", 0)) == mma_cuda.BLOCK_PAIRS)
            ):
                entry = entry["fallback"]  # the best config without the CUDA kernel, tuned alongside
            cfg = {key: int(entry[key] if key in entry else OPTIONAL_CONFIG_KEYS[key]) for key in CONFIG_KEYS}
            return cfg
        except (KeyError, ValueError, TypeError):
            pass
    return default_moe_config(t, k, num_experts, hidden=hidden, intermediate=intermediate)


def _check_config(cfg: dict, use_asm: bool) -> None:
    missing = [key for key in CONFIG_KEYS if key not in cfg and key not in OPTIONAL_CONFIG_KEYS]
    if missing:
        raise ValueError(f"fused_moe: config lacks {missing}")
    for key in ("SPLIT_K1", "SPLIT_K2"):
        v = cfg.get(key, OPTIONAL_CONFIG_KEYS[key])
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= _MAX_SPLIT:
            raise ValueError(f"fused_moe: {key} must be an int in [1, {_MAX_SPLIT}], got {v!r}")
    gemv = cfg.get("GEMV", 0)
    for key in ("GEMV", "SPLIT_GU", "MMA"):
        v = cfg.get(key, 0)
        if type(v) is not int or v not in (0, 1):
            raise ValueError(f"fused_moe: {key} must be 0 or 1, got {v!r}")
    bm = cfg["BLOCK_M"]
    if bm < 16 or bm & (bm - 1):
        raise ValueError(f"fused_moe: BLOCK_M must be a power of two >= 16, got {bm}")
    if cfg.get("MMA", 0) == 1 and (bm not in mma_cuda.BLOCK_SIZES or gemv):
        raise ValueError(f"fused_moe: MMA = 1 needs BLOCK_M in {mma_cuda.BLOCK_SIZES} and GEMV = 0, got "
                         f"BLOCK_M = {bm}, GEMV = {gemv}")
    for n_key, k_key, w_key in (("BLOCK_N1", "BLOCK_K1", "WARPS1"), ("BLOCK_N2", "BLOCK_K2", "WARPS2")):
        bn, bk, w = cfg[n_key], cfg[k_key], cfg[w_key]
        min_bn = 4 if gemv else 16  # the CUDA-core path has no MMA tile shape to fill
        if bn < min_bn or bk < 16 or bn & (bn - 1) or bk & (bk - 1):
            raise ValueError(f"fused_moe: {n_key}/{k_key} must be powers of two >= {min_bn}/16, got {bn}/{bk}")
        # the PTX dequantizer converts 4 bytes at a time: each thread must own >= 4 weight bytes
        if use_asm and bn * bk // 2 < 4 * 32 * w:
            raise ValueError(
                f"fused_moe: {n_key} x {k_key} = {bn} x {bk} gives a thread fewer than 4 "
                f"weight bytes with {w} warps"
            )


# ------------------------------------------------------------------------------------------ fused_moe


def _mma_runnable(weights: MoEWeights, device: torch.device, cfg: dict) -> bool:
    """Whether a config with MMA = 1 can run: shuffled weights, a built kernel, K splits it accepts."""
    return (
        weights.w13_mma is not None
        and weights.w2_mma is not None
        and mma_cuda.mma_library(device) is not None
        and mma_cuda.split_ok(weights.hidden, cfg.get("SPLIT_K1", 1), cfg["BLOCK_M"])
        and mma_cuda.split_ok(weights.intermediate, cfg.get("SPLIT_K2", 1), cfg["BLOCK_M"])
    )


def _silu_mul(kern, ws1: torch.Tensor, ids_flat: torch.Tensor, weights: MoEWeights, hbuf: torch.Tensor,
              split1: int) -> None:
    """h = silu(g) * u from GEMM1's fp32 split partials ws1 [split1, pairs, 2I] (raw sums, 2^-9 scaled) into
    hbuf [pairs, I] (``_moe_silu_mul_kernel``)."""
    n_pairs, n_i = hbuf.shape
    block_p = min(16, _pow2_at_least(n_pairs, 2))
    block_i = min(128, _pow2_at_least(n_i, 16))
    kern._moe_silu_mul_kernel[(_cdiv(n_pairs, block_p), _cdiv(n_i, block_i))](
        ws1, ids_flat, weights.w13_gscale, hbuf, n_pairs, n_i, ws1.stride(0), ws1.stride(1),
        weights.w13_gscale.stride(0), hbuf.stride(0), SPLIT_K=split1, BLOCK_P=block_p, BLOCK_N=block_i, num_warps=4,
        **pdl_launch(ws1.device),
    )


#: programs the slot sum aims for (two per SM of the H200): a decode step's T rows of H = 2048 in 1024-column blocks
#: were 64 programs at T = 32 for 4.7 MB of partials
SLOT_SUM_PROGRAMS = 264


def slot_sum_block(t: int, h: int) -> int:
    """Columns per program of the slot sum of ``t`` rows of ``h``: the largest power of two from 512 to 1024 that
    gives at least :data:`SLOT_SUM_PROGRAMS` programs, else 256 (at H = 2048: 256 up to 64 tokens, 1024 from 132),
    at most ``h`` rounded up to a power of two (16 at least). ``VIBEQWEN_MOE_SUM_BLOCK`` (a power of two, 16-4096) forces it (for measuring; the
    same sums: each column is summed alone). Read at every call, so a CUDA graph keeps what it was captured with.

    Raises:
        ValueError: another ``VIBEQWEN_MOE_SUM_BLOCK`` value."""
    cap = _pow2_at_least(h, 16)
    v = os.environ.get("VIBEQWEN_MOE_SUM_BLOCK")
    if v is not None:
        if not v.isdigit() or int(v) not in [2**i for i in range(4, 13)]:
            raise ValueError(f"VIBEQWEN_MOE_SUM_BLOCK must be a power of two from 16 to 4096, got {v!r}")
        return min(int(v), cap)
    block = 1024
    while block > 256 and t * ((h + block - 1) // block) < SLOT_SUM_PROGRAMS:
        block //= 2
    return min(block, cap)


def _slot_sum(kern, ypair: torch.Tensor, tw: torch.Tensor, out: torch.Tensor, kp: int, split2: int,
              stride_ym: int, stride_ys: int, partials: bool) -> None:
    """out [T, H] = the sum over each token's k' slots of GEMM2's per-pair outputs (``_moe_sum_kernel``):
    weighted bf16 rows, or fp32 split partials times the topk weights (partials, or split2 > 1)."""
    t, h = out.shape
    block_r = slot_sum_block(t, h)
    # 8 warps: more loads in flight per program; on the H200 at H = 2048, 9 fp32 slots: T = 1024 23.5 -> 20.8 us,
    # T = 8192 198 -> 150 us (the bytes take 19 / 152 us at 4.2 TB/s), 4 warps for decode-sized T
    kern._moe_sum_kernel[(t, _cdiv(h, block_r))](
        ypair, tw, out, t, h, stride_ym, stride_ys, out.stride(0),
        TOPK=kp, SPLIT_K=split2, BLOCK_N=block_r, PARTIALS=partials, num_warps=8 if t >= 256 else 4,
        **pdl_launch(ypair.device),
    )


def _fused_moe_mma(xc, tw, ids_flat, sorted_ids, block_expert, weights: MoEWeights, split1: int, split2: int,
                   out: torch.Tensor, kern, block_m: int) -> torch.Tensor:
    """fused_moe with both GEMMs in the CUDA kernels (blocks of ``block_m`` pairs): gate|up -> h -> down -> slot
    sum (Triton). From ``mma_cuda.MLP_MIN_PAIRS`` pairs in 16-pair blocks (decode steps of 16+ tokens) gate|up, SiLU
    and down run as one ``mma_cuda.moe_mlp`` launch instead (h kept on chip; ``VIBEQWEN_MOE_MLP=0`` keeps the
    launches below): its own splits then (gate|up unsplit, down in ``mma_cuda.mlp_split`` slices of I), whatever
    SPLIT_K1 / SPLIT_K2 say. Gate|up without a K split finishes h = silu(g) * u in its epilogue (gate and up rows
    interleaved per tile: no fp32 partials, no SiLU-mul launch); with one, fp32 split partials that the SiLU-mul
    kernel (Triton) sums and finishes. Down writes fp32 rows (or split partials; global scale applied) that the
    slot sum weights and adds. (bf16 rows with the routing weight applied in the epilogue, half the bytes for the
    slot sum, measured slower on the H200: T = 1024 413 -> 426 us per call; the 16-byte half-sector stores.)"""
    t, h = xc.shape
    if xc.data_ptr() % 16 or xc.stride(0) % 8:  # the kernel reads x rows 16 bytes at a time
        xc = xc.clone(memory_format=torch.contiguous_format)
    kp = ids_flat.numel() // t
    n_pairs, n_i = ids_flat.numel(), weights.intermediate
    if (block_m == mma_cuda.BLOCK_PAIRS and mma_cuda.mlp_wanted(n_pairs)
            and mma_cuda.mlp_supported(weights.w13_mma, weights.w2_mma, xc.device)):
        # gate|up, SiLU and down in one launch (the same sums as SPLIT_K1 = 1, SPLIT_K2 = split)
        split = mma_cuda.mlp_split(n_pairs)
        ypair = torch.empty((split, n_pairs, h), device=xc.device, dtype=torch.float32)
        mma_cuda.moe_mlp(xc, kp, weights.w13_mma, weights.w13_gscale, weights.w2_mma, weights.w2_gscale, sorted_ids,
                         block_expert, n_pairs, split, ypair)
        _slot_sum(kern, ypair, tw, out, kp, split, ypair.stride(1), ypair.stride(0), partials=True)
        return out
    hbuf = torch.empty((n_pairs, n_i), device=xc.device, dtype=xc.dtype)
    if split1 == 1 and weights.w13_mma.halves_interleaved:
        mma_cuda.moe_mma(xc, kp, weights.w13_mma, weights.w13_gscale, sorted_ids, block_expert, n_pairs, 1,
                         hbuf.view(1, n_pairs, n_i), block_m, silu=True)
    else:
        ws1 = torch.empty((split1, n_pairs, 2 * n_i), device=xc.device, dtype=torch.float32)
        mma_cuda.moe_mma(xc, kp, weights.w13_mma, None, sorted_ids, block_expert, n_pairs, split1, ws1, block_m)
        _silu_mul(kern, ws1, ids_flat, weights, hbuf, split1)
    ypair = torch.empty((split2, n_pairs, h), device=xc.device, dtype=torch.float32)
    mma_cuda.moe_mma(hbuf, 1, weights.w2_mma, weights.w2_gscale, sorted_ids, block_expert, n_pairs, split2, ypair,
                     block_m)
    _slot_sum(kern, ypair, tw, out, kp, split2, ypair.stride(1), ypair.stride(0), partials=True)
    return out


def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights: MoEWeights,
    config: dict | None = None,
    *,
    out: torch.Tensor | None = None,
    align: tuple | None = None,
) -> torch.Tensor:
    """``out[t] = sum_s topk_weights[t, s] * expert_{topk_ids[t, s]}(x[t])`` with NVFP4 SwiGLU experts.

    expert_e(x) = W_down[e] (silu(W_gate[e] x) * W_up[e] x), weights dequantized to bf16 in registers
    (exactly) and multiplied on the tensor cores with fp32 accumulation. Four launches: :func:`moe_align`,
    gate/up GEMM with SiLU-and-mul fused (h buffer ``[T*k', I]``), down GEMM scaled by the pair's weight
    (``[T*k', H]`` buffer), and an fp32 sum over the k' slots of each token (deterministic, no atomics).
    With ``SPLIT_K1 > 1`` the gate/up GEMM splits K (H) and writes fp32 partials
    ``[SPLIT_K1, T*k', 2, I]``; a fifth launch sums them in split order and applies SiLU-and-mul. With
    ``SPLIT_K2 > 1`` the down GEMM splits K (I) into fp32 partials ``[SPLIT_K2, T*k', H]`` that the slot
    sum reduces too (splits in order, then times the pair's weight): no extra launch. Both deterministic. (MMA
    configs with 16-pair blocks from ``mma_cuda.MLP_MIN_PAIRS`` pairs run both GEMMs as one launch with its own
    splits: ``_fused_moe_mma``.)

    Args:
        x: ``[T, H]`` bf16 on CUDA (fp16/fp32 are computed in bf16 on the GPU; under the interpreter,
            fp16/fp32 are used as given). Last dimension contiguous.
        topk_weights: float32 ``[T, k']`` (e.g. :func:`fused_router`'s, shared expert included).
        topk_ids: int32 ``[T, k']``, ids in ``[0, E')``; one token's ids should be distinct (as the
            router gives); a repeated id is still summed correctly.
        weights: :class:`MoEWeights` on ``x``'s device with ``hidden == H``.
        config: block sizes (keys :data:`CONFIG_KEYS`; SPLIT_K1 / SPLIT_K2 optional, default 1); default
            :func:`pick_moe_config` (T, k', E', H, I).
        out: optional ``[T, H]`` output of ``x``'s dtype (contiguous).
        align: optional ``(sorted_ids, block_expert, block_m)``: :func:`moe_align`'s first two outputs for these
            ids and ``block_m`` (e.g. from :func:`~vibeqwen_kernels.moe.route_cuda.fused_route`); used when the
            config's BLOCK_M is ``block_m`` (and not GEMV), else the alignment runs here.

    Returns:
        ``[T, H]`` in ``x``'s dtype. Intermediates (h, per-pair outputs) are rounded to the compute dtype
        (bf16 on the GPU), as the bf16 reference ``moe_experts_ref`` does.

    Raises:
        ValueError: shape/dtype/device mismatches, bad config, CPU tensors outside the interpreter.
        TypeError: ``weights`` is not :class:`MoEWeights`.

    Memory: allocates ``P_max`` int32 + ``T*k'*(I + H)`` compute-dtype elements per call (T = 8192,
    k' = 9: ~380 MB in bf16); split very long prefills in the caller if that matters. Split-K adds
    ``4 * T*k' * (SPLIT_K1 * 2I + SPLIT_K2 * H)`` bytes of fp32 partials (decode: under 10 MB at 64 tokens).
    """
    if not isinstance(weights, MoEWeights):
        raise TypeError(
            f"fused_moe: weights must be MoEWeights (see prepack_moe_nvfp4), got {type(weights).__name__}"
        )
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _X_DTYPES:
        raise ValueError(
            f"fused_moe: x must be a 2-D bf16/fp16/fp32 tensor, got "
            f"{getattr(x, 'dtype', None)} {tuple(getattr(x, 'shape', ()))}"
        )
    t, h = x.shape
    if h != weights.hidden:
        raise ValueError(f"fused_moe: x has H={h}, the experts H={weights.hidden}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"fused_moe: topk_weights {tuple(topk_weights.shape)} and topk_ids "
            f"{tuple(topk_ids.shape)} must both be [T={t}, k']"
        )
    if x.device != weights.device or topk_ids.device != x.device or topk_weights.device != x.device:
        raise ValueError("fused_moe: x, topk_weights, topk_ids and weights must be on one device")
    _check_device(x, "fused_moe")
    kp = topk_ids.shape[1]
    n_exp, n_i = weights.num_experts, weights.intermediate
    if out is not None and (
        tuple(out.shape) != (t, h)
        or out.dtype != x.dtype
        or out.device != x.device
        or not out.is_contiguous()
    ):
        raise ValueError(f"fused_moe: out must be a contiguous [{t}, {h}] {x.dtype} tensor on {x.device}")
    if out is None:
        out = torch.empty((t, h), device=x.device, dtype=x.dtype)
    if t == 0 or kp == 0:
        return out.zero_()
    use_asm = _use_asm(x.device)
    cfg = dict(config) if config is not None else pick_moe_config(t, kp, n_exp, hidden=h, intermediate=n_i)
    _check_config(cfg, use_asm)
    if cfg.get("MMA", 0) == 1 and not _mma_runnable(weights, x.device, cfg):
        cfg = pick_moe_config(t, kp, n_exp, hidden=h, intermediate=n_i, allow_mma=False)
        if cfg.get("MMA", 0) == 1:  # a hand-written config without a fallback
            cfg = default_moe_config(t, kp, n_exp, hidden=h, intermediate=n_i)
        _check_config(cfg, use_asm)
    xc = x.to(torch.bfloat16) if x.device.type == "cuda" else x
    if xc.stride(1) != 1:
        xc = xc.contiguous()
    cdt = xc.dtype
    tw = topk_weights.to(torch.float32).contiguous()
    bm = cfg["BLOCK_M"]
    split1 = cfg.get("SPLIT_K1", 1)
    split2 = cfg.get("SPLIT_K2", 1)
    gemv = cfg.get("GEMV", 0) == 1
    ids_flat = topk_ids.to(torch.int32).contiguous().view(-1)
    if gemv:  # one program per pair reads its expert id: no alignment
        sorted_ids = block_expert = None
    elif align is not None and align[2] == bm:
        p_max, b_max = align_bounds(t * kp, n_exp, bm)
        if align[0].numel() != p_max or align[1].numel() != b_max:
            raise ValueError(f"fused_moe: align holds {align[0].numel()} / {align[1].numel()} entries, moe_align's "
                             f"bounds for {t * kp} pairs over {n_exp} experts are {p_max} / {b_max}")
        sorted_ids, block_expert = align[0], align[1]
    else:
        sorted_ids, block_expert, _ = moe_align(ids_flat.view(t, kp), n_exp, bm)
    n_pairs = t * kp
    kern = _kernels()
    if cfg.get("MMA", 0) == 1:
        return _fused_moe_mma(xc, tw, ids_flat, sorted_ids, block_expert, weights, split1, split2, out, kern, bm)

    # GEMM1 (gate/up + SiLU-and-mul). Split-K: fp32 partials [split1, n_pairs, 2, I], finished by
    # _moe_silu_mul_kernel (sums the splits in order; every pair row is written by every split).
    hbuf = torch.empty((n_pairs, n_i), device=x.device, dtype=cdt)
    bn1, bk1 = cfg["BLOCK_N1"], cfg["BLOCK_K1"]
    s13 = weights.w13_scale.view(torch.uint8)
    split_gu = not gemv and cfg.get("SPLIT_GU", 0) == 1
    use_ws = split1 > 1 or split_gu  # fp32 partials, finished by _moe_silu_mul_kernel
    ws1 = torch.empty((split1, n_pairs, 2, n_i), device=x.device, dtype=torch.float32) if use_ws else hbuf
    if gemv:
        kern._moe_gemv1_kernel[(n_pairs, _cdiv(n_i, bn1), split1)](
            xc,
            weights.w13_packed,
            s13,
            weights.w13_gscale,
            hbuf,
            ws1,
            ids_flat,
            n_i,
            h,
            xc.stride(0),
            weights.w13_packed.stride(0),
            weights.w13_packed.stride(1),
            s13.stride(0),
            s13.stride(1),
            weights.w13_gscale.stride(0),
            hbuf.stride(0),
            ws1.stride(0) if split1 > 1 else 0,
            ws1.stride(1) if split1 > 1 else 0,
            TOPK=kp,
            BLOCK_N=bn1,
            BLOCK_K=bk1,
            SPLIT_K=split1,
            EVEN_K=h % (bk1 * split1) == 0,
            USE_ASM=use_asm,
            REPACKED=weights.repacked,
            num_warps=cfg["WARPS1"],
            num_stages=cfg["STAGES1"],
            **pdl_launch(xc.device),
        )
    else:
        kern._moe_gemm1_kernel[(block_expert.numel(), _cdiv(2 * n_i if split_gu else n_i, bn1), split1)](
            xc,
            weights.w13_packed,
            s13,
            weights.w13_gscale,
            hbuf,
            ws1,
            sorted_ids,
            block_expert,
            n_pairs,
            n_i,
            h,
            xc.stride(0),
            weights.w13_packed.stride(0),
            weights.w13_packed.stride(1),
            s13.stride(0),
            s13.stride(1),
            weights.w13_gscale.stride(0),
            hbuf.stride(0),
            ws1.stride(0) if use_ws else 0,
            ws1.stride(1) if use_ws else 0,
            TOPK=kp,
            BLOCK_M=bm,
            BLOCK_N=bn1,
            BLOCK_K=bk1,
            SPLIT_K=split1,
            EVEN=(h % (bk1 * split1) == 0 and n_i % bn1 == 0),
            USE_ASM=use_asm,
            REPACKED=weights.repacked,
            SPLIT_GU=split_gu,
            num_warps=cfg["WARPS1"],
            num_stages=cfg["STAGES1"],
            **pdl_launch(xc.device),
        )
    if use_ws:
        _silu_mul(kern, ws1, ids_flat, weights, hbuf, split1)

    # GEMM2 (down). Split-K: fp32 partials [split2, n_pairs, H] (global scale applied, topk weight not),
    # reduced over splits and slots (times the topk weight) by _moe_sum_kernel.
    if split2 > 1:
        ypair = torch.empty((split2, n_pairs, h), device=x.device, dtype=torch.float32)
        stride_ym, stride_ys = ypair.stride(1), ypair.stride(0)
    else:
        ypair = torch.empty((n_pairs, h), device=x.device, dtype=cdt)
        stride_ym, stride_ys = ypair.stride(0), 0
    bn2, bk2 = cfg["BLOCK_N2"], cfg["BLOCK_K2"]
    s2 = weights.w2_scale.view(torch.uint8)
    if gemv:
        kern._moe_gemv2_kernel[(n_pairs, _cdiv(h, bn2), split2)](
            hbuf,
            weights.w2_packed,
            s2,
            weights.w2_gscale,
            tw,
            ypair,
            ids_flat,
            h,
            n_i,
            hbuf.stride(0),
            weights.w2_packed.stride(0),
            weights.w2_packed.stride(1),
            s2.stride(0),
            s2.stride(1),
            weights.w2_gscale.stride(0),
            stride_ym,
            stride_ys,
            BLOCK_N=bn2,
            BLOCK_K=bk2,
            SPLIT_K=split2,
            EVEN_K=n_i % (bk2 * split2) == 0,
            USE_ASM=use_asm,
            REPACKED=weights.repacked,
            num_warps=cfg["WARPS2"],
            num_stages=cfg["STAGES2"],
            **pdl_launch(hbuf.device),
        )
    else:
        kern._moe_gemm2_kernel[(block_expert.numel(), _cdiv(h, bn2), split2)](
            hbuf,
            weights.w2_packed,
            s2,
            weights.w2_gscale,
            tw,
            ypair,
            sorted_ids,
            block_expert,
            n_pairs,
            h,
            n_i,
            hbuf.stride(0),
            weights.w2_packed.stride(0),
            weights.w2_packed.stride(1),
            s2.stride(0),
            s2.stride(1),
            weights.w2_gscale.stride(0),
            stride_ym,
            stride_ys,
            BLOCK_M=bm,
            BLOCK_N=bn2,
            BLOCK_K=bk2,
            SPLIT_K=split2,
            EVEN=(n_i % (bk2 * split2) == 0 and h % bn2 == 0),
            USE_ASM=use_asm,
            REPACKED=weights.repacked,
            num_warps=cfg["WARPS2"],
            num_stages=cfg["STAGES2"],
            **pdl_launch(hbuf.device),
        )

    _slot_sum(kern, ypair, tw, out, kp, split2, stride_ym, stride_ys, partials=False)
    return out
