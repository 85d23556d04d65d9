"""The expert GEMMs in CUDA (``csrc/moe_mma.cu``): weight shuffling, launch, and an emulation.

:func:`fused_moe` runs them for configs with ``MMA = 1``: both expert GEMMs stream NVFP4 codes straight into
the tensor cores' register fragments (bf16, fp32 accumulation). Blocks of 16 pairs (moe_align's ``block_m``)
run a decode kernel (``mma.m16n8k16``, tuned for T <= 64 on the H200; weights through registers, or through
cp.async rings in shared memory for long K ranges: :func:`decode_kernel`); blocks of 32 or 64 pairs a prefill
kernel: ``moe_mma_large_kernel`` (each dequantized A fragment into up to 8 n8 tiles by ``mma.sync``) or, for the
block sizes in :data:`WGMMA_BLOCK_PAIRS` on Hopper, ``moe_wgmma_kernel`` (one ``wgmma`` per warpgroup and k16
step). Epilogues: fp32 sums, or h = silu(gate) * up in bf16 (gate|up without a K split). The alignment, split-K SiLU-and-mul and slot-sum kernels are the Triton ones.

* :func:`shuffle_mma_weights` -- ``[E', N, K/2]`` codes + ``[E', N, K/16]`` scales -> the kernels' layout
  (load time, on the weights' device; the Triton layout stays too: the shuffled copy costs the experts' size
  again plus 11% for its bf16 block scales, ~19 GB for the full model); gate|up rows interleaved per tile.
* :func:`moe_mma` -- one launch (``VIBEQWEN_MOE_WGMMA=0`` or ``wgmma=False`` keeps 32-pair blocks on mma.sync).
* :func:`moe_mlp` -- both GEMMs of 16-pair blocks with the SiLU between them in one launch (h kept in shared memory;
  ``fused_moe`` runs it from :data:`MLP_MIN_PAIRS` pairs, :func:`mlp_wanted`), the same bits as two :func:`moe_mma`
  launches with gate|up unsplit and down in :func:`mlp_split` K splits.
* :func:`moe_mma_emulated` -- the same in PyTorch, reading the shuffled layout exactly as the kernels' lanes do,
  and for 32/64-pair blocks following ``moe_mma_large_kernel``'s x path fragment by fragment (the wgmma
  kernel's core-matrix staging has no CPU model: the GPU tests run both kernels against the reference).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass

import torch
from vibeqwen_kernels.cuda_build import device_capability, hopper_library
from vibeqwen_kernels.pdl import pdl_mode
from vibeqwen_kernels.switches import env_switch

#: pairs per expert block of the decode kernel: its two n8 MMA halves (moe_align's block_m)
BLOCK_PAIRS = 16
#: the block sizes the kernels take: 16 (decode kernel), 32 and 64 (prefill kernel, 4 or 8 n8 tiles)
BLOCK_SIZES = (16, 32, 64)
#: 64-k chunks per register group: a split's K range must be a multiple of 64 * CHUNK_GROUP
CHUNK_GROUP = 4
#: k per x piece the prefill kernel stages (one register group), and its staged row length in bf16 (+16 bytes)
PIECE_K = 64 * CHUNK_GROUP
PIECE_STRIDE = PIECE_K + 8
#: the kernels' block scales are stored as bf16 (e4m3 value) * 2^117: times the codes placed as bf16 bits
#: (e2m1 * 2^-126) the product is e2m1 * scale * 2^-9, always a normal bf16 (csrc/moe_mma.cu, ``dequant8``)
SCALE_BIAS = 2.0 ** 117

# The code word of one lane and k16 step (32 bits, 8 E2M1 codes): where ``dequant8`` (csrc/moe_mma.cu) finds
# each code. A register a[r] of the mma.m16n8k16 A fragment holds two bf16 (half q = 0, 1: k = 2t + q, + 8 for
# r >= 2; row g, + 8 for odd r); code bit b (m, e0, e1, sign) must land on bf16x2 bit 16q + (6, 7, 8, 15)[b].
# a[0] = w & CODE_MASK, a[1] = rotr(w, 3) & CODE_MASK, a[2] = rotr(w, 6) & CODE_MASK,
# a[3] = ((w & CODE_REST) * CODE_REST_MUL) & CODE_MASK: the 8 bits no rotation reaches, spread by one multiply
# (its three shifted copies, by 2, 7 and 12, never overlap, so the sum has no carries). 8 integer operations for
# 8 codes, one of them on the FMA pipe, against 15 for bytes of two nibbles.
CODE_MASK = 0x81C081C0
CODE_REST = 0x001B001B
CODE_REST_MUL = (1 << 2) | (1 << 7) | (1 << 12)
_CODE_DEST = (6, 7, 8, 15)


@functools.lru_cache(maxsize=None)
def code_bit_positions() -> tuple:
    """``pos[r][q][b]``: the bit of a step's 32-bit code word holding bit b of the E2M1 code that register a[r]'s
    half q takes (see the constants above). A permutation of 0..31."""
    rest = {i for i in range(32) if CODE_REST >> i & 1}
    pos = []
    for r in range(4):
        per_half = []
        for q in range(2):
            bits = []
            for b in range(4):
                d = 16 * q + _CODE_DEST[b]
                if r < 3:
                    bits.append((d + 3 * r) % 32)
                else:
                    (src,) = [d - o for o in (2, 7, 12) if d - o in rest]
                    bits.append(src)
            per_half.append(tuple(bits))
        pos.append(tuple(per_half))
    return tuple(pos)


@dataclass
class MMAWeights:
    """One stacked NVFP4 matrix set in the kernel layout (see ``csrc/moe_mma.cu``).

    codes: uint8 ``[E', N/16, K/64, 32, 16]``; scales: bf16 ``[E', N/16, K/64, 64]``, the e4m3 block scales
    times :data:`SCALE_BIAS` (exact); n, k: the matrix shape (N output rows, K inputs) per expert;
    halves_interleaved: row tile t holds rows 8t..8t+7 of the first N/2 rows, then the same of the second half
    (:func:`kernel_rows`), else rows 16t..16t+15; scales_e4m3: None, or the same block scales as e4m3 bytes, uint8
    ``[E', N/16, K/64, 64]`` in ``scales``' order (:func:`moe_mlp` reads them with :func:`mlp_e4m3`)."""

    codes: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int
    halves_interleaved: bool = False
    scales_e4m3: torch.Tensor | None = None


def kernel_rows(n: int, halves_interleaved: bool) -> torch.Tensor:
    """int64 ``[N]``: the original row of each kernel row (row 16t + i of tile t); identity without interleaving.
    Interleaved: 16t + i -> 8t + i (i < 8), N/2 + 8t + i - 8 (i >= 8), so a tile's rows g and g + 8 are the
    gate and up rows j = 8t + g of a gate|up matrix."""
    r = torch.arange(n)
    if not halves_interleaved:
        return r
    t, i = r // 16, r % 16
    return torch.where(i < 8, 8 * t + i, n // 2 + 8 * t + i - 8)


def _codes_from_packed(packed: torch.Tensor, repacked: bool) -> torch.Tensor:
    """uint8 ``[..., K/2]`` packed NVFP4 -> E2M1 codes uint8 ``[..., K]`` (k order)."""
    lead, kh = packed.shape[:-1], packed.shape[-1]
    if repacked:  # byte 8g+j: k 16g+j (low), 16g+8+j (high)
        g = packed.reshape(*lead, kh // 8, 8)
        return torch.cat((g & 0x0F, g >> 4), dim=-1).reshape(*lead, 2 * kh)
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*lead, 2 * kh)


def shuffle_mma_weights(packed: torch.Tensor, scales: torch.Tensor, repacked: bool,
                        experts_per_step: int = 16, interleave_halves: bool = False,
                        e4m3_copy: bool = False) -> MMAWeights:
    """Stacked experts -> the CUDA kernel's fragment layout.

    Args:
        packed: uint8 ``[E', N, K/2]`` (``MoEWeights.w13_packed`` / ``w2_packed``).
        scales: float8_e4m3fn or uint8 ``[E', N, K/16]``.
        repacked: ``MoEWeights.repacked`` (the nibble order of ``packed``).
        experts_per_step: experts converted at a time (bounds the temporary memory).
        interleave_halves: rows in :func:`kernel_rows` order (the gate|up matrix: lets the kernel finish
            silu(gate) * up in its epilogue; its fp32 outputs still come back in the original row order).
        e4m3_copy: also keep the block scales as e4m3 bytes in the kernel order (``scales_e4m3``: an eighth of
            the codes' bytes more), unless a scale is NaN or has its sign bit set (-0 included): the kernel's
            conversion is exact for every nonnegative finite e4m3 value (block scales are nonnegative).

    Returns:
        :class:`MMAWeights` on ``packed``'s device.

    Raises:
        ValueError: N not a multiple of 16 (32 with ``interleave_halves``) or K not a multiple of 64.
    """
    e_count, n, kh = packed.shape
    k = 2 * kh
    if n % 16 or k % 64 or (interleave_halves and n % 32):
        raise ValueError(f"shuffle_mma_weights: need N % 16 == 0 (N % 32 to interleave halves) and K % 64 == 0, "
                         f"got N={n}, K={k}")
    s8 = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    rows = kernel_rows(n, interleave_halves).to(packed.device) if interleave_halves else None
    nt, kc = n // 16, k // 64
    pos = code_bit_positions()
    codes_out = torch.empty((e_count, nt, kc, 32, 16), dtype=torch.uint8, device=packed.device)
    scales_out = torch.empty((e_count, nt, kc, 64), dtype=torch.bfloat16, device=packed.device)
    e4m3_out = torch.empty((e_count, nt, kc, 64), dtype=torch.uint8, device=packed.device) if e4m3_copy else None
    for e0 in range(0, e_count, experts_per_step):
        e1 = min(e_count, e0 + experts_per_step)
        c = _codes_from_packed(packed[e0:e1], repacked)  # [e, N, K]
        sc = s8[e0:e1]
        if rows is not None:
            c, sc = c.index_select(1, rows), sc.index_select(1, rows)
        # row = 16 T + 8 h + g; k = 64 C + 16 j + 8 half + 2 t + q; register a[h + 2 half], its half q
        c = c.reshape(e1 - e0, nt, 2, 8, kc, 4, 2, 4, 2)  # e, T, h, g, C, j, half, t, q
        word = torch.zeros((e1 - e0, nt, 8, kc, 4, 4), dtype=torch.int64, device=packed.device)  # e,T,g,C,j,t
        for r, per_half in enumerate(pos):
            for q, bits in enumerate(per_half):
                code = c[:, :, r & 1, :, :, :, r >> 1, :, q].to(torch.int64)
                for b, bit in enumerate(bits):
                    word |= ((code >> b) & 1) << bit
        # -> e, T, C, g, t, j (lane = 4 g + t; word j = bytes 4j..4j+3, little-endian)
        word = torch.where(word >= 1 << 31, word - (1 << 32), word)  # as int32 bits
        word = word.permute(0, 1, 3, 2, 5, 4).to(torch.int32).contiguous()
        codes_out[e0:e1] = word.view(torch.uint8).reshape(e1 - e0, nt, kc, 32, 16)
        s = sc.reshape(e1 - e0, nt, 2, 8, kc, 4)  # e, T, h, g, C, j
        s = s.permute(0, 1, 4, 3, 5, 2).reshape(e1 - e0, nt, kc, 64)  # e, T, C, g, j, h
        # e4m3 -> fp32 -> * 2^117 -> bf16: exact (4 significant bits; 2^-9 * 2^117 .. 448 * 2^117 are normal)
        scales_out[e0:e1] = (s.view(torch.float8_e4m3fn).float() * SCALE_BIAS).to(torch.bfloat16)
        if e4m3_out is not None:
            e4m3_out[e0:e1] = s
            if bool(((s & 0x7F) == 0x7F).any() or (s & 0x80).any()):  # a NaN or a sign bit (the kernel's shift)
                logging.getLogger(__name__).warning(
                    "shuffle_mma_weights: a block scale of experts %d-%d is NaN or has its sign bit set: no e4m3 copy "
                    "of this matrix's scales (VIBEQWEN_MOE_MLP_E4M3 has no effect on it)", e0, e1 - 1)
                e4m3_out = None
    return MMAWeights(codes_out, scales_out, n, k, interleave_halves, e4m3_out)


def _weight_tile(w: MMAWeights, e: int, tile: int, c_lo: int, c_hi: int) -> torch.Tensor:
    """fp32 ``[16, K]`` rows of expert e's 16-row tile, read lane by lane from the shuffled code words
    (:func:`code_bit_positions`) and scales as the kernel's lanes read them (the scales' 2^117 taken out, no
    2^-9 bias), chunks [c_lo, c_hi) filled, the rest zero."""
    from vibeqwen.checkpoint.quant import E2M1_VALUES

    dev = w.codes.device
    table = E2M1_VALUES.to(device=dev, dtype=torch.float32)
    lane = torch.arange(32, device=dev)
    g, t = lane // 4, lane % 4
    wt = torch.zeros(16, w.k, dtype=torch.float32, device=dev)
    pos = code_bit_positions()
    for c in range(c_lo, c_hi):
        words = w.codes[e, tile, c].contiguous().view(torch.int32).long()  # [32, 4]: step j's code word
        sc = w.scales[e, tile, c].view(8, 4, 2).float() / SCALE_BIAS  # g, j, h
        for j in range(4):
            for r in range(4):
                h, half = r & 1, r >> 1
                for q in range(2):
                    code = sum(((words[:, j] >> bit) & 1) << b for b, bit in enumerate(pos[r][q]))
                    kk = 64 * c + 16 * j + 8 * half + 2 * t + q
                    wt[g + 8 * h, kk] = table[code] * sc[g, j, h]
    return wt


def _ldmatrix_x4(buf: torch.Tensor, addr: torch.Tensor) -> torch.Tensor:
    """``ldmatrix.sync.aligned.m8n8.x4.b16`` on a flat buffer of b16 elements: ``addr[l]`` is the element offset
    of row l % 8 of matrix l // 8; returns ``[32 lanes, 4 registers, 2]``: register j of lane l holds elements
    (row l // 4, columns 2 (l % 4), 2 (l % 4) + 1) of matrix j (PTX ISA, "Warp-level matrix load instruction")."""
    lane = torch.arange(32, device=buf.device)
    src = addr.view(4, 8)[:, lane // 4]  # [matrix j, lane]: the row address lane l receives from
    idx = src.t()[:, :, None] + 2 * (lane % 4)[:, None, None] + torch.arange(2, device=buf.device)
    return buf[idx]


def _emulate_large_block(x: torch.Tensor, x_row_div: int, w: MMAWeights, e: int, ids: list[int], n_pairs: int,
                         split: int, full: torch.Tensor) -> None:
    """One block of the prefill kernel (``moe_mma_large_kernel``), fragment by fragment: the active n8 tiles
    (up to the last real pair), the x pieces staged as ``[pair][PIECE_STRIDE]`` (padding pairs of active tiles
    zero, inactive tiles NaN: a read of them shows), the ldmatrix.x4 lane addresses of the kernel, the
    m16n8k16 B and C fragment layouts and the epilogue's pair of each accumulator. Writes the raw sums to
    ``full[s, pair, kernel row]``."""
    dev = x.device
    bp = len(ids)
    lane = torch.arange(32, device=dev)
    g, t = lane // 4, lane % 4
    real = [i for i, p in enumerate(ids) if p < n_pairs]
    if not real:
        return
    nact = (real[-1] + 8) // 8
    kc = w.k // 64
    per = kc // split
    for s in range(split):
        k0 = s * per * 64
        for tile in range(w.n // 16):
            wt = _weight_tile(w, e, tile, s * per, (s + 1) * per)
            acc = torch.zeros(nact, 32, 4, dtype=torch.float32, device=dev)  # [tile p, lane, c0..c3]
            for pc in range(per // CHUNK_GROUP):
                buf = torch.full((bp, PIECE_STRIDE), float("nan"), device=dev)
                buf[: nact * 8, :PIECE_K] = 0.0
                for col in range(nact * 8):
                    if ids[col] < n_pairs:
                        kk = k0 + pc * PIECE_K
                        buf[col, :PIECE_K] = x[ids[col] // x_row_div, kk:kk + PIECE_K].float()
                flat = buf.view(-1)
                lane_off = (lane & 7) * PIECE_STRIDE + (lane >> 3) * 8
                for i in range(CHUNK_GROUP):
                    for j in (0, 2):
                        kstep = k0 + pc * PIECE_K + 64 * i + 16 * j  # k of step j (then j + 1) of chunk i
                        for p in range(nact):
                            b = _ldmatrix_x4(flat, lane_off + p * 8 * PIECE_STRIDE + (4 * i + j) * 16)
                            for half in range(2):  # steps j, j + 1: registers (b0 b1), (b2 b3)
                                bmat = torch.empty(16, 8, device=dev)  # B[k][n]: k 2t + q (+8), n = g
                                for q in range(2):
                                    bmat[2 * t + q, g] = b[:, 2 * half, q]
                                    bmat[2 * t + 8 + q, g] = b[:, 2 * half + 1, q]
                                a = wt[:, kstep + 16 * half:kstep + 16 * half + 16]
                                cmat = a @ bmat  # [16 rows, 8 columns]
                                acc[p, :, 0] += cmat[g, 2 * t]
                                acc[p, :, 1] += cmat[g, 2 * t + 1]
                                acc[p, :, 2] += cmat[g + 8, 2 * t]
                                acc[p, :, 3] += cmat[g + 8, 2 * t + 1]
            row0 = tile * 16 + g
            for p in range(nact):
                for cc in range(2):
                    pairs = torch.tensor([ids[8 * p + 2 * tt + cc] for tt in range(4)], device=dev)[t]
                    ok = pairs < n_pairs
                    for r, rows in ((cc, row0), (2 + cc, row0 + 8)):
                        full[s, pairs[ok], rows[ok]] = acc[p, :, r][ok]


def moe_mma_emulated(x: torch.Tensor, x_row_div: int, w: MMAWeights, gscale: torch.Tensor | None,
                     sorted_ids: torch.Tensor, block_expert: torch.Tensor, n_pairs: int, split: int,
                     out: torch.Tensor, block_pairs: int = BLOCK_PAIRS,
                     silu: bool = False) -> torch.Tensor:
    """What :func:`moe_mma` computes, in fp32 PyTorch, reading ``w`` lane by lane as the kernel does
    (scales applied as e4m3 values, the stored 2^117 taken out; the kernel's 2^-9 dequantization bias and
    ``gscale * 2^9`` cancel, so without ``gscale`` the result here is 2^9 times the kernel's raw sums). Blocks of
    16 pairs: the weight tile read lane by lane times the x columns. Blocks of 32 / 64 pairs: also the prefill
    kernel's x path fragment by fragment (staged pieces, ldmatrix addresses, B and C fragment layouts). Sums land
    in kernel row order, then go out as :func:`moe_mma`'s epilogue writes them (original rows, or h = silu(gate)
    * up). For tests of the shuffle and the indexing: Python loops, tiny shapes only.

    Args and layout as :func:`moe_mma` (x ``[rows, K]`` any float dtype, ``gscale`` float32 ``[E', N]`` or
    None, ``sorted_ids`` / ``block_expert`` int32 from moe_align with block_m ``block_pairs``, ``out`` float32
    ``[split, n_pairs, N]``; with ``silu`` bf16 ``[1, n_pairs, N/2]``), on any device. Writes and returns ``out``
    (rows of pairs in no block untouched). No checks: wrong shapes raise whatever indexing raises."""
    kc = w.k // 64
    per = kc // split
    full = torch.zeros(split, n_pairs, w.n, dtype=torch.float32, device=x.device)  # kernel row order, raw
    expert_of = {}
    for blk in range(block_expert.numel()):
        e = int(block_expert[blk])
        if e < 0:
            continue
        pairs = [int(p) for p in sorted_ids[blk * block_pairs:(blk + 1) * block_pairs]]
        expert_of.update({p: e for p in pairs if p < n_pairs})
        if block_pairs != BLOCK_PAIRS:
            _emulate_large_block(x, x_row_div, w, e, pairs, n_pairs, split, full)
            continue
        for s in range(split):
            acc = torch.zeros(w.n, BLOCK_PAIRS, dtype=torch.float32, device=x.device)
            xcols = torch.zeros(BLOCK_PAIRS, w.k, dtype=torch.float32, device=x.device)
            for col, p in enumerate(pairs):
                if p < n_pairs:
                    xcols[col] = x[p // x_row_div].float()
            for tile in range(w.n // 16):
                wt = _weight_tile(w, e, tile, s * per, (s + 1) * per)
                acc[tile * 16:(tile + 1) * 16] = wt @ xcols.t()
            for col, p in enumerate(pairs):
                if p < n_pairs:  # the kernel writes only real pairs; padding columns are dropped the same way
                    full[s, p] = acc[:, col]
    rows = kernel_rows(w.n, w.halves_interleaved).to(x.device)
    for p, e in expert_of.items():
        v = torch.empty_like(full[:, p])
        v[:, rows] = full[:, p]  # original row order
        if gscale is not None:
            v = v * gscale[e]
        if silu:
            g, u = v[:, : w.n // 2], v[:, w.n // 2:]
            out[:, p] = (g * torch.sigmoid(g) * u).to(out.dtype)
        else:
            out[:, p] = v.to(out.dtype)
    return out


def mma_library(device: torch.device):
    """The built ``csrc/moe_mma.cu`` for ``device`` (None on CPU, before sm_90, or when it cannot be built)."""
    p, i = ctypes.c_void_p, ctypes.c_int  # pointers (and the stream), ints
    return hopper_library("moe_mma", device, {
        "vq_moe_mma_smem_bytes": [i, i, i],
        "vq_moe_mma_launch": [p, i, i, p, p, p, i, p, ctypes.c_longlong, i, p, p, i, i, i, i, i, i, i, i, i, i, i, i,
                              p],
        "vq_moe_mlp_smem_bytes": [i],
        "vq_moe_mlp_launch": [p, i, i, p, p, p, i, p, p, p, i, p, ctypes.c_longlong, i, p, p, i, i, i, i, i, i, i, i,
                              i, i, i, p],
    })


#: block sizes that run on the wgmma kernel by default. H200, fused MoE at model shapes (bench_moe.py): 32-pair
#: blocks (3 CTAs per SM) T = 256 262 -> 234 us, T = 512 299 -> 275 us against mma.sync; 64-pair blocks (2 CTAs
#: per SM, 112 registers) T = 1024 408 -> 413 us, and 14.1 -> 14.5 ms per 1k-token prefill: they stay on mma.sync.
WGMMA_BLOCK_PAIRS = (32,)


@functools.lru_cache(maxsize=None)
def wgmma_available(device: torch.device) -> bool:
    """Whether 32/64-pair blocks run on the wgmma kernel on ``device``: the library is built for sm_90a (Hopper)
    and ``VIBEQWEN_MOE_WGMMA`` is not ``0`` (then they run on the mma.sync kernel, ``moe_mma_large_kernel``).
    Decided once per device and process (every MoE call asks)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            and os.environ.get("VIBEQWEN_MOE_WGMMA", "1") != "0" and mma_library(device) is not None)


#: The 16-pair blocks' kernels (``vq_moe_mma_launch``'s ``decode_kernel``): ``"regs"`` moe_mma_kernel<1> (4 warps,
#: one row tile each, weights through registers, one register group prefetched), ``"regs2"`` moe_mma_kernel<2> (two
#: row tiles per warp: the block's x staged once per 128 rows), ``"async"`` / ``"async2"`` / ``"async4"``
#: moe_mma_async_kernel with 1 / 2 / 4 row tiles per warp (8 warps, weights through cp.async rings in shared memory
#: that stay full across a warp's tiles), ``"regs2p"`` moe_mma_persist_kernel<2> (regs2's tiles from a grid of
#: resident CTAs taking contiguous ranges of (block, split, row group) items; measured slower on the H200, the rule
#: does not pick it: bench/results/h200_notes.md, twenty-fourth session). The same sums bit for bit.
DECODE_KERNELS = {"regs": 0, "regs2": 1, "async": 2, "async2": 3, "async4": 4, "regs2p": 5}
#: the kernels that need :func:`async_split_ok`
ASYNC_KERNELS = ("async", "async2", "async4")
#: H200, per GEMM at model shapes, us (regs / regs2 / async / async2 / async4; bench/kernels/bench_moe_decode.py,
#: thirteenth session): gate|up unsplit at T = 1 10.7 / 14.7 / 9.6 / 14.7 / 24.8, T = 8 36.5 / 39.0 / 27.5 / 25.4 /
#: 38.1, T = 32 90.8 / 83.5 / 67.8 / 68.7 / 81.6, T = 64 123.1 / 109.4 / 89.9 / 90.7 / 87.9; gate|up in 2 splits at
#: T = 32 68.4 / 66.3 / 68.5 / 63.6 / 65.0, T = 64 92.8 / 90.3 / 92.8 / 84.4 / 88.8; down (K 512) at T = 1 6.1 / 7.2 /
#: 6.6 / 7.7 / 10.8, T = 8 19.0 / 18.7 / 22.6 / 20.5 / 20.1, T = 32 44.4 / 41.0 / 51.0 / 43.2 / 41.4, T = 64 60.3 /
#: 55.8 / 68.7 / 57.5 / 56.4. So: for K ranges of 1024+ the async kernel, with two row tiles per warp from 64 pairs
#: (T >= 8: its rings stay full across tiles; below that the halved grid leaves SMs idle) and four for an unsplit
#: 2048-k range from 512 pairs (T >= 57); for short ones two row tiles through registers from 256 pairs (T >= 29),
#: else one.
ASYNC_MIN_K = 1024
ASYNC2_MIN_PAIRS = 64
ASYNC4_MIN_K = 2048
ASYNC4_MIN_PAIRS = 512
REGS2_MIN_PAIRS = 256


def ring_step() -> int:
    """Chunks the async kernels request per ring step: 4 (one wait, one commit and 5 uniform cp.async a lane per 4
    chunks), or 1 with ``VIBEQWEN_MOE_RING_STEP=1`` (per chunk, lanes 0-7 copying the scales: the kernels' earlier
    ring, for measuring). The same sums bit for bit. Read at every launch, so a CUDA graph keeps what it was captured
    with."""
    return 1 if os.environ.get("VIBEQWEN_MOE_RING_STEP") == "1" else 4


def _decode_kernel_code(name: str) -> int:
    """``vq_moe_mma_launch``'s ``decode_kernel`` for a :data:`DECODE_KERNELS` name (async ones: 6-8 for
    :func:`ring_step` 1)."""
    return DECODE_KERNELS[name] + (4 if name in ASYNC_KERNELS and ring_step() == 1 else 0)


def decode_kernel(k: int, split: int, n_pairs: int) -> str:
    """The 16-pair kernel for K / split and ``n_pairs`` pairs (one of :data:`DECODE_KERNELS`; the rule above).
    ``VIBEQWEN_MOE_DECODE_KERNEL=regs|regs2|async|async2|async4|regs2p`` forces one (for measuring; the async ones
    where the split is one they are built for); ``VIBEQWEN_MOE_PERSIST=1`` runs ``regs2p`` where the rule picks
    ``regs2`` (in decode with ``VIBEQWEN_MOE_MLP=0``: the down GEMM from 256 pairs), to measure the persistent grid on
    that GEMM alone. (From
    :data:`MLP_MIN_PAIRS` pairs ``fused_moe`` runs :func:`moe_mlp` instead of these GEMMs unless
    ``VIBEQWEN_MOE_MLP=0``.)"""
    forced = os.environ.get("VIBEQWEN_MOE_DECODE_KERNEL")
    if forced:
        if forced in DECODE_KERNELS and (forced not in ASYNC_KERNELS or async_split_ok(k, split)):
            return forced
        _warn_forced(forced, k, split)
    if k // split >= ASYNC_MIN_K and async_split_ok(k, split):
        if n_pairs < ASYNC2_MIN_PAIRS:
            return "async"
        return "async4" if k // split >= ASYNC4_MIN_K and n_pairs >= ASYNC4_MIN_PAIRS else "async2"
    if n_pairs >= REGS2_MIN_PAIRS:
        return "regs2p" if os.environ.get("VIBEQWEN_MOE_PERSIST") == "1" else "regs2"
    return "regs"


@functools.cache
def _warn_forced(forced: str, k: int, split: int) -> None:
    """Logged once per value and shape: a VIBEQWEN_MOE_DECODE_KERNEL the rule replaces."""
    logging.getLogger(__name__).warning(
        "VIBEQWEN_MOE_DECODE_KERNEL=%s ignored for K=%d in %d splits (one of %s; async* only for 4, 8, 16 or 32 "
        "64-k chunks per split): the rule picks", forced, k, split, ", ".join(DECODE_KERNELS))


def async_split_ok(k: int, split: int) -> bool:
    """Whether moe_mma_async_kernel (:data:`ASYNC_KERNELS`) is built for K / split (4, 8, 16 or 32 64-k chunks)."""
    return split >= 1 and k % (64 * split) == 0 and k // (64 * split) in (4, 8, 16, 32)


#: dynamic shared memory the kernel may use (its x tile): 227 KB per block on an H100/H200, less its static
#: arrays (the 64-pair kernel's pair ids and row offsets: under 1 KB)
MAX_SMEM_BYTES = 226 * 1024


def smem_bytes(k: int, split: int, block_pairs: int = BLOCK_PAIRS) -> int:
    """Dynamic shared memory of one launch (``vq_moe_mma_smem_bytes``): the decode kernel stages 16 x columns of
    K / split bf16 values (+16 padding); the mma.sync prefill kernel two x pieces of ``block_pairs`` x
    PIECE_STRIDE bf16 (33.8 KB at 32 pairs, 67.6 KB at 64, whatever K and the split). The wgmma kernel needs
    less (``vq_moe_wgmma_smem_bytes``: no padding), so this bound serves both."""
    if block_pairs == BLOCK_PAIRS:
        return BLOCK_PAIRS * (k // split + 16) * 2
    return 2 * block_pairs * PIECE_STRIDE * 2


def split_ok(k: int, split: int, block_pairs: int = BLOCK_PAIRS) -> bool:
    """Whether K splits into ``split`` ranges of whole register groups (the kernels' requirement) whose x
    tile fits in shared memory, for a block size the kernels take."""
    return (block_pairs in BLOCK_SIZES and split >= 1 and k % (64 * CHUNK_GROUP * split) == 0
            and smem_bytes(k, split, block_pairs) <= MAX_SMEM_BYTES)


def moe_mma(x: torch.Tensor, x_row_div: int, w: MMAWeights, gscale: torch.Tensor | None,
            sorted_ids: torch.Tensor, block_expert: torch.Tensor, n_pairs: int, split: int,
            out: torch.Tensor, block_pairs: int = BLOCK_PAIRS, wgmma: bool | None = None,
            silu: bool = False, check: bool = True, kernel16: str | None = None,
            persist_grid: int = 0) -> torch.Tensor:
    """``out[s, pair, n] = sum_{k in split s} W[e, n, k] x[pair // x_row_div, k]`` (fp32) for every real pair
    of every expert block (``moe_align`` with ``block_m = block_pairs``), times ``gscale[e, n] * 2^9`` when
    ``gscale`` is given; without it the raw sums carry the dequantization's 2^-9 (as the Triton MMA kernels'
    split partials do). Launches on the current stream, no sync (CUDA-graph safe), with programmatic dependent
    launch where `vibeqwen_kernels.pdl.pdl_enabled`.

    Args:
        x: bf16 ``[rows, K]``, last dim contiguous, rows 16-byte aligned (data pointer and row stride).
        x_row_div: the x row of pair p is ``p // x_row_div`` (k' for the gate/up GEMM, 1 for down).
        w: :class:`MMAWeights` from :func:`shuffle_mma_weights`.
        gscale: float32 ``[E', N]`` or None.
        sorted_ids, block_expert: int32, from ``moe_align(topk_ids, E', block_pairs)``.
        n_pairs: T * k' (the sentinel in ``sorted_ids``).
        split: K splits (:func:`split_ok`).
        out: float32 ``[split, n_pairs, N]`` (last two dims contiguous; pairs not in any block are untouched).
        block_pairs: pairs per expert block, one of :data:`BLOCK_SIZES`: 16 runs the decode kernel, 32 / 64
            the prefill kernel.
        wgmma: for 32 / 64-pair blocks, run the wgmma kernel (True; needs :func:`wgmma_available`) or the
            mma.sync one (False); None: the wgmma kernel for the block sizes in :data:`WGMMA_BLOCK_PAIRS`
            where :func:`wgmma_available`. Ignored for 16-pair blocks.
        silu: the gate|up GEMM finished in the epilogue: ``out`` bf16 ``[1, n_pairs, N/2]`` gets
            h = silu(gate * gscale) * (up * gscale) (rows j and N/2 + j; needs ``w.halves_interleaved``,
            ``gscale`` and split 1).
        check: validate the arguments (False: the caller built them and checked what varies per call, as
            ``vibeqwen_kernels.nvfp4.mma`` does for the LM head; saves the host time of ~20 checks a call).
        kernel16: the 16-pair blocks' kernel, one of :data:`DECODE_KERNELS` (None: :func:`decode_kernel`; those of
            :data:`ASYNC_KERNELS` need :func:`async_split_ok`); the same sums whichever. Ignored for 32 / 64-pair blocks.
        persist_grid: CTAs of the ``regs2p`` kernel (0: SMs x its occupancy; tests set a few to give each CTA
            several items). Ignored by the other kernels.

    Raises:
        ValueError: bad split, shapes, dtypes, devices or alignment (checked first, on any machine).
        RuntimeError: the library is not available on ``x``'s device, or the launch failed.
    """
    if check:
        _check_args(x, x_row_div, w, gscale, sorted_ids, block_expert, n_pairs, split, out, block_pairs, silu)
        if kernel16 is not None and (kernel16 not in DECODE_KERNELS
                                     or (kernel16 in ASYNC_KERNELS and not async_split_ok(w.k, split))):
            raise ValueError(f"moe_mma: kernel16 must be None or one of {tuple(DECODE_KERNELS)} (the async ones for K "
                             f"/ split of 4, 8, 16 or 32 64-k chunks), got {kernel16!r} for K={w.k}, split {split}")
        if type(persist_grid) is not int or persist_grid < 0:
            raise ValueError(f"moe_mma: persist_grid must be an int >= 0, got {persist_grid!r}")
    return _launch(x, x_row_div, w, gscale, sorted_ids, block_expert, n_pairs, split, out, block_pairs, wgmma, silu,
                   kernel16, persist_grid)


def _check_weights(w: MMAWeights, device: torch.device, what: str) -> None:
    """ValueError unless ``w`` is a :func:`shuffle_mma_weights` result (codes uint8 [E', N/16, K/64, 32, 16], scales
    bf16 [E', N/16, K/64, 64], both contiguous) on ``device``."""
    e_count = w.codes.shape[0] if w.codes.dim() else 0
    if (w.codes.dtype != torch.uint8 or w.scales.dtype != torch.bfloat16
            or tuple(w.scales.shape) != (e_count, w.n // 16, w.k // 64, 64)
            or tuple(w.codes.shape) != (e_count, w.n // 16, w.k // 64, 32, 16)
            or not w.codes.is_contiguous() or not w.scales.is_contiguous()):
        raise ValueError(f"{what} is not a shuffle_mma_weights result (codes uint8 [E', N/16, K/64, 32, 16], "
                         "scales bf16 [E', N/16, K/64, 64], contiguous)")
    if w.codes.device != device or w.scales.device != device:
        raise ValueError(f"{what}: the weights must be on {device}")


def _check_args(x, x_row_div, w, gscale, sorted_ids, block_expert, n_pairs, split, out, block_pairs, silu) -> None:
    """:func:`moe_mma`'s argument checks (raises ValueError); out None: not checked (:func:`moe_mlp`'s h)."""
    if type(block_pairs) is not int or block_pairs not in BLOCK_SIZES:
        raise ValueError(f"moe_mma: block_pairs must be one of {BLOCK_SIZES} (moe_align's block_m), got {block_pairs!r}")
    if not split_ok(w.k, split, block_pairs):
        raise ValueError(f"moe_mma: K={w.k} does not split into {split} x {64 * CHUNK_GROUP}-multiples")
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.stride(-1) != 1 or x.shape[-1] != w.k:
        raise ValueError(f"moe_mma: x must be bf16 [rows, {w.k}] with a contiguous last dim")
    if (type(x_row_div) is not int or not 1 <= x_row_div < 2**31  # a C int in the launch
            or x.shape[0] * x_row_div < n_pairs):
        raise ValueError(f"moe_mma: x_row_div must be an int >= 1 and x must hold ceil(n_pairs / x_row_div) rows "
                         f"(n_pairs {n_pairs}, x_row_div {x_row_div!r}, {x.shape[0]} rows)")
    _check_weights(w, x.device, "moe_mma: w")
    e_count = w.codes.shape[0]
    if x.data_ptr() % 16 or x.stride(0) % 8:
        raise ValueError("moe_mma: x rows must start at 16-byte boundaries (the kernel reads 16 bytes at a time)")
    if silu and (gscale is None or split != 1 or not w.halves_interleaved):
        raise ValueError("moe_mma: silu needs gscale, split 1 and weights shuffled with interleave_halves=True")
    out_dtype, out_n = (torch.bfloat16, w.n // 2) if silu else (torch.float32, w.n)
    if out is not None and (out.dtype != out_dtype or tuple(out.shape) != (split, n_pairs, out_n)
                            or out.stride(2) != 1):
        kind = "bf16 (silu)" if silu else "float32"
        raise ValueError(f"moe_mma: out must be {kind} [{split}, {n_pairs}, {out_n}] with a contiguous last dim")
    for name, ids in (("sorted_ids", sorted_ids), ("block_expert", block_expert)):
        if ids.dtype != torch.int32 or ids.device != x.device or not ids.is_contiguous():
            raise ValueError(f"moe_mma: {name} must be a contiguous int32 tensor on {x.device}")
    if sorted_ids.numel() < block_pairs * block_expert.numel():
        raise ValueError(f"moe_mma: sorted_ids needs {block_pairs} entries per block ({block_expert.numel()} blocks)")
    if out is not None and out.device != x.device:
        raise ValueError("moe_mma: x, the weights and out must be on one device")
    if gscale is not None and (gscale.dim() != 2 or gscale.dtype != torch.float32 or gscale.device != x.device
                               or tuple(gscale.shape) != (e_count, w.n) or gscale.stride(1) != 1):
        # both halves' scales with silu
        raise ValueError(f"moe_mma: gscale must be float32 [{e_count}, {w.n}] on {x.device} with a contiguous "
                         f"last dim")


def _launch(x, x_row_div, w, gscale, sorted_ids, block_expert, n_pairs, split, out, block_pairs, wgmma, silu,
            kernel16=None, persist_grid=0):
    """One launch of checked arguments (see :func:`moe_mma`)."""
    lib = mma_library(x.device)
    if lib is None:
        raise RuntimeError("moe_mma: the CUDA kernel is not available on this device")
    if wgmma is None:  # by default only where it measured faster (WGMMA_BLOCK_PAIRS)
        use_wgmma = block_pairs in WGMMA_BLOCK_PAIRS and wgmma_available(x.device)
    else:
        use_wgmma = bool(wgmma)
    if use_wgmma and block_pairs != BLOCK_PAIRS and device_capability(x.device) != (9, 0):
        raise RuntimeError("moe_mma: the wgmma kernel needs an sm_90 (Hopper) device")
    gs_ptr, gs_stride = (gscale.data_ptr(), gscale.stride(0)) if gscale is not None else (None, 0)
    rc = lib.vq_moe_mma_launch(
        x.data_ptr(), x_row_div, x.stride(0), w.codes.data_ptr(), w.scales.data_ptr(), gs_ptr, gs_stride,
        out.data_ptr(), out.stride(0), out.stride(1), sorted_ids.data_ptr(), block_expert.data_ptr(),
        block_expert.numel(), n_pairs, w.n, w.k, split, block_pairs, 1 if gscale is not None else 0,
        (1 if w.halves_interleaved else 0) | (2 if silu else 0), 1 if use_wgmma else 0,
        _decode_kernel_code(decode_kernel(w.k, split, n_pairs) if kernel16 is None else kernel16), persist_grid,
        pdl_mode(x.device),
        ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream),
    )
    if rc != 0:
        raise RuntimeError(f"moe_mma: launch failed with CUDA error {rc}")
    return out


# ------------------------------------------------------------------------ gate|up, SiLU and down in one launch

#: the shapes moe_mlp_kernel is built for (Qwen3.6-35B-A3B's hidden and expert intermediate sizes)
MLP_HIDDEN, MLP_INTERMEDIATE = 2048, 512
#: pairs (T * k') from which the decode MoE takes moe_mlp (fewer: the gate|up and down launches);
#: ``VIBEQWEN_MOE_MLP=0`` turns it off, ``VIBEQWEN_MOE_MLP_MIN_PAIRS`` moves the bound (read at every call)
MLP_MIN_PAIRS = 144
#: moe_mlp's CTA shapes (``vq_moe_mlp_launch``'s ``cta``): "16" a CTA per 16-pair block (66 KB of x + 40 KB of rings:
#: 2 CTAs per SM), "8" a CTA per n8 half of a block (33 KB of x: 3 CTAs per SM at 2 slices, whose kernel takes 80
#: registers)
MLP_CTAS = {"16": 0, "8": 1}
#: the range of one-CTA-a-block waves (2 slices x the expected blocks / (2 x 132 SMs)) where "8" runs instead of
#: "16". H200, fused_moe per call at 2 slices (us; two launches / "16" / "8"): T = 16 (0.78 waves) 85.6 / 70.1 / 86.4,
#: T = 32 (1.25) 113.6 / 122.8 / 112.1, T = 64 (1.72) 152.6 / 139.8 / 177.6 (bench_moe_decode.py --fused-only;
#: bench/results/h200_notes.md, thirtieth session).
MLP_CTA8_WAVES = (1.0, 1.45)


def mlp_cta(n_pairs: int, num_experts: int = 257, top_k: int = 8) -> str:
    """The CTA shape (:data:`MLP_CTAS`) of a :func:`moe_mlp` launch for ``n_pairs`` pairs: "8" where a CTA a block
    would run in 1.0-1.45 waves of 2 CTAs per SM (:data:`MLP_CTA8_WAVES`; blocks expected: the distinct routed experts
    of T = n_pairs / (top_k + 1) uniformly routed tokens, and ceil(T / 16) for the shared expert), else "16".
    ``VIBEQWEN_MOE_MLP_CTA`` forces one (read at every call).

    Raises:
        ValueError: another ``VIBEQWEN_MOE_MLP_CTA`` value."""
    v = os.environ.get("VIBEQWEN_MOE_MLP_CTA")
    if v is not None:
        if v not in MLP_CTAS:
            raise ValueError(f"VIBEQWEN_MOE_MLP_CTA must be one of {tuple(MLP_CTAS)}, got {v!r}")
        return v
    t = max(1, n_pairs // (top_k + 1))
    routed = max(num_experts - 1, 1)
    blocks = routed * (1 - (1 - min(top_k / routed, 1.0)) ** t) + (t + 15) // 16
    waves = 2 * blocks / (2 * 132)
    return "8" if MLP_CTA8_WAVES[0] < waves < MLP_CTA8_WAVES[1] else "16"


def mlp_split(n_pairs: int) -> int:
    """The intermediate slices of a :func:`moe_mlp` launch for ``n_pairs`` pairs: 2 (``VIBEQWEN_MOE_MLP_SPLIT=1``: 1,
    for measuring; read at every call).

    Raises:
        ValueError: ``VIBEQWEN_MOE_MLP_SPLIT`` other than 1 or 2."""
    v = os.environ.get("VIBEQWEN_MOE_MLP_SPLIT", "2")
    if v not in ("1", "2"):
        raise ValueError(f"VIBEQWEN_MOE_MLP_SPLIT must be 1 or 2, got {v!r}")
    return int(v)


def mlp_early_scales() -> bool:
    """Whether :func:`moe_mlp` requests each row tile's global scales ahead of their use (before a gate|up tile's K
    loop; a warp's down tiles' all at once while h is stored), so that no warp waits for them after a K loop:
    ``VIBEQWEN_MOE_MLP_EARLY_SCALES=1``. Off by default: on an H100 the decode step at batch 32 took 9.142 / 9.136 ms
    with it against 9.086 / 9.075 without (two interleaved runs, thirty-sixth session), and on an H200 7.627 / 7.627
    against 7.574 / 7.588 (thirty-seventh), although Nsight Compute on the H200 had put ~9% of the warps' stall
    samples on those reads. The same results either way. Read at every call, so a CUDA graph keeps what it was
    captured with.

    Raises:
        ValueError: ``VIBEQWEN_MOE_MLP_EARLY_SCALES`` other than 0 or 1."""
    return env_switch("VIBEQWEN_MOE_MLP_EARLY_SCALES", "0")


#: row tiles a ring step of :func:`moe_mlp` can take (``vq_moe_mlp_launch``'s ``group``)
MLP_GROUPS = (1, 2, 4)
#: the group :func:`mlp_group` picks for each CTA shape with the e4m3 scales (the one the prefetch is built for)
MLP_RULE_GROUP = {"16": 4, "8": 1}


def mlp_group(e4m3: bool, cta: str = "8") -> int:
    """Row tiles each ring step of a :func:`moe_mlp` warp's weight stream covers, for CTA shape ``cta``
    (:data:`MLP_CTAS`): with the e4m3 scales 4 for a CTA per block ("16": one 64-k chunk of 4 tiles a step, whose x
    fragments are read once for the 4 and whose global scales come in one round trip after them; 16 more fp32
    accumulators a lane, room the 16-column kernel has at 2 CTAs an SM), else 1 (4 consecutive chunks of one tile:
    the 8-column kernel, at 3 CTAs an SM under 80 registers, ran its 24- and 32-token launches 3-4% slower with 2 or
    4). H100, decode ms a step (forty-fifth session, bench/results/h200_notes.md): b16 5.816 / 5.795 against 5.886 /
    5.891 with 1, b48 11.390 / 11.388 against 11.485 / 11.486, b32 (8 columns) the same. ``VIBEQWEN_MOE_MLP_GROUP``
    = 1, 2 or 4 forces one for the e4m3 scales (for measuring; read at every call). The same sums either way (each
    tile's chunks in k order).

    Raises:
        ValueError: ``VIBEQWEN_MOE_MLP_GROUP`` other than 1, 2 or 4."""
    v = os.environ.get("VIBEQWEN_MOE_MLP_GROUP", str(MLP_RULE_GROUP[cta]))
    if v not in ("1", "2", "4"):
        raise ValueError(f"VIBEQWEN_MOE_MLP_GROUP must be 1, 2 or 4, got {v!r}")
    return int(v) if e4m3 else 1


def mlp_prefetch(e4m3: bool, cta: str, group: int) -> bool:
    """Whether a :func:`moe_mlp` launch prefetches each warp's next ring step into L2 as it requests one
    (csrc/moe_mma.cu, ``mlp_request``'s PF): one more step of DRAM reads in flight a warp without more shared
    memory. Built for the default streams only (the e4m3 scales with the rule's group: 4 for the CTA per block, 1
    for the CTA per n8 half); elsewhere it is off. ``VIBEQWEN_MOE_MLP_PREFETCH`` names the CTA shapes
    (:data:`MLP_CTAS`) that prefetch: "16" (the default), "8", "1" both, "0" neither. H100, decode ms a step, one
    engine, interleaved (bench/results/h200_notes.md, fifty-fourth session; means of the repeats): the CTA per block
    (b16, b48, b64; call 3) 5.967 / 11.566 / 13.274 -> 5.921 / 11.495 / 13.224 (-0.4 to -0.8% in each call), the CTA
    per n8 half (b32, 3 CTAs an SM; call 1) 8.559 -> 8.652 (+1.1%). Not yet measured on an H200. The same results
    either way. Read at every call, so a CUDA graph keeps what it was captured with.

    Raises:
        ValueError: ``VIBEQWEN_MOE_MLP_PREFETCH`` other than 0, 1, 16 or 8."""
    v = os.environ.get("VIBEQWEN_MOE_MLP_PREFETCH", "16")
    if v not in ("0", "1", *MLP_CTAS):
        raise ValueError(f"VIBEQWEN_MOE_MLP_PREFETCH must be 0, 1, 16 or 8, got {v!r}")
    return v in ("1", cta) and e4m3 and group == MLP_RULE_GROUP[cta]


def mlp_e4m3_copy() -> bool:
    """Whether the loader keeps the experts' block scales as e4m3 bytes too (``MMAWeights.scales_e4m3``, ~2 GB for
    the model), for :func:`moe_mlp` to stream: unless ``VIBEQWEN_MOE_MLP_E4M3=0`` when the weights are prepacked.
    On by default: a decode step at batch 32 took 8.54 ms against 9.05 with the bf16 scales on an H100
    (bench/results/h200_notes.md, fortieth session).

    Raises:
        ValueError: ``VIBEQWEN_MOE_MLP_E4M3`` other than 0 or 1."""
    return env_switch("VIBEQWEN_MOE_MLP_E4M3", "1")


def mlp_e4m3(w13: MMAWeights, w2: MMAWeights, early: bool) -> bool:
    """Whether a :func:`moe_mlp` launch streams the e4m3 block scales (576 bytes a 64-k chunk of 16 rows against 640
    with the bf16 ones, converted to the same bf16 words a ring step at a time in the kernel: the same bits): where
    both weights carry them (:func:`mlp_e4m3_copy` at load), the early scale loads are off, and
    ``VIBEQWEN_MOE_MLP_E4M3`` is not 0 now (read at every call, so a CUDA graph keeps what it was captured with).

    Raises:
        ValueError: ``VIBEQWEN_MOE_MLP_E4M3`` other than 0 or 1."""
    # unset: on where the copy exists (it does unless the variable was 0 at load)
    return (env_switch("VIBEQWEN_MOE_MLP_E4M3", "1") and not early and w13.scales_e4m3 is not None
            and w2.scales_e4m3 is not None)


def e4m3_scale_words(pairs: torch.Tensor) -> torch.Tensor:
    """The kernel's conversion (``e4m3_scale_word`` in csrc/moe_mma.cu) in PyTorch integer and bf16 ops, for the CPU
    tests: int64 ``[...]`` 16-bit pairs of nonnegative finite e4m3 bytes (row g's low, row g + 8's high) -> int64
    bf16x2 words (each scale * 2^117, row g's low). The f16 step is exact (torch's e4m3 -> f16 conversion stands in
    for the cvt)."""
    lo = (pairs & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16)
    hi = ((pairs >> 8) & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16)
    h = (lo.to(torch.int64) & 0xFFFF) | ((hi.to(torch.int64) & 0xFFFF) << 16)
    t = h >> 3
    halves = torch.stack((t & 0xFFFF, t >> 16), -1)
    halves = torch.where(halves >= 1 << 15, halves - (1 << 16), halves).to(torch.int16).view(torch.bfloat16)
    halves = halves * torch.tensor(2.0**115, dtype=torch.bfloat16) * torch.tensor(2.0**114, dtype=torch.bfloat16)
    bits = halves.view(torch.int16).to(torch.int64) & 0xFFFF
    return bits[..., 0] | (bits[..., 1] << 16)


def mlp_wanted(n_pairs: int) -> bool:
    """Whether the decode MoE runs gate|up, SiLU and down as one :func:`moe_mlp` launch for ``n_pairs`` pairs (the
    shapes and weights permitting: :func:`mlp_supported`): from :data:`MLP_MIN_PAIRS` unless ``VIBEQWEN_MOE_MLP=0``.
    Read at every call, so a CUDA graph keeps what it was captured with.

    Raises:
        ValueError: ``VIBEQWEN_MOE_MLP_MIN_PAIRS`` that is not a positive integer."""
    if os.environ.get("VIBEQWEN_MOE_MLP", "1") == "0":
        return False
    v = os.environ.get("VIBEQWEN_MOE_MLP_MIN_PAIRS", str(MLP_MIN_PAIRS))
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"VIBEQWEN_MOE_MLP_MIN_PAIRS must be a positive integer, got {v!r}")
    return n_pairs >= int(v)


def mlp_supported(w13: MMAWeights, w2: MMAWeights, device: torch.device) -> bool:
    """Whether :func:`moe_mlp` can run these weights on ``device``: the built library, gate|up shuffled with its
    halves interleaved, and the model's shapes (H = 2048, I = 512)."""
    return (w13.halves_interleaved and (w13.n, w13.k) == (2 * MLP_INTERMEDIATE, MLP_HIDDEN)
            and (w2.n, w2.k) == (MLP_HIDDEN, MLP_INTERMEDIATE) and not w2.halves_interleaved
            and mma_library(device) is not None)


def moe_mlp(x: torch.Tensor, x_row_div: int, w13: MMAWeights, gs13: torch.Tensor, w2: MMAWeights,
            gs2: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, n_pairs: int, split: int,
            out: torch.Tensor) -> torch.Tensor:
    """The expert MLP of 16-pair blocks in one launch (``moe_mlp_kernel``): for every real pair p of expert e,
    ``h = silu(gs13[e, :I] * (W_gate[e] x)) * (gs13[e, I:] * (W_up[e] x))`` rounded to bf16 (x = x[p // x_row_div]),
    then ``out[s, p, n] = gs2[e, n] * sum_{k in slice s} W_down[e, n, k] h[k]`` (fp32; I in ``split`` slices), with
    the dequantization's 2^9 folded as in :func:`moe_mma`. The same bits as :func:`moe_mma` with ``silu=True``
    (unsplit) followed by :func:`moe_mma` of the down weight with ``split`` K splits: the sums the slot sum reduces
    (``fused_moe``'s ``SPLIT_K2 = split``). Launches on the current stream, no sync (CUDA-graph safe).

    Args:
        x: bf16 ``[rows, H]``, last dim contiguous, rows 16-byte aligned (data pointer and row stride).
        x_row_div: the x row of pair p is ``p // x_row_div`` (k').
        w13, gs13: the gate|up weight (:func:`shuffle_mma_weights` with ``interleave_halves=True``, ``[E', 2I, H]``)
            and its float32 global scales ``[E', 2I]``. Their block scales are read as e4m3 bytes
            (``scales_e4m3``) where :func:`mlp_e4m3` says so, else as bf16.
        w2, gs2: the down weight (``[E', H, I]``) and float32 ``[E', H]``.
        sorted_ids, block_expert: int32, ``moe_align(topk_ids, E', 16)``'s.
        n_pairs: T * k' (the sentinel in ``sorted_ids``).
        split: 1 or 2 slices of I (:func:`mlp_split`).
        out: float32 ``[split, n_pairs, H]``, contiguous (pairs not in any block are untouched).

    Raises:
        ValueError: shapes, dtypes, devices, alignment or split (the e4m3 scales' too, where they are read), or a bad
            ``VIBEQWEN_MOE_MLP_CTA``, ``VIBEQWEN_MOE_MLP_E4M3``, ``VIBEQWEN_MOE_MLP_GROUP`` or
            ``VIBEQWEN_MOE_MLP_PREFETCH`` (checked first, on any machine).
        RuntimeError: the library is not available on ``x``'s device, or the launch failed.
    """
    if type(split) is not int or split not in (1, 2):
        raise ValueError(f"moe_mlp: split must be 1 or 2, got {split!r}")
    if type(n_pairs) is not int or n_pairs < 1:
        raise ValueError(f"moe_mlp: n_pairs must be an int >= 1, got {n_pairs!r}")
    if not w13.halves_interleaved or (w13.n, w13.k) != (2 * MLP_INTERMEDIATE, MLP_HIDDEN):
        raise ValueError(f"moe_mlp: w13 must be the interleaved gate|up weight [E', {2 * MLP_INTERMEDIATE}, "
                         f"{MLP_HIDDEN}], got [{w13.n}, {w13.k}] (interleaved {w13.halves_interleaved})")
    if w2.halves_interleaved or (w2.n, w2.k) != (MLP_HIDDEN, MLP_INTERMEDIATE):
        raise ValueError(f"moe_mlp: w2 must be the down weight [E', {MLP_HIDDEN}, {MLP_INTERMEDIATE}], got "
                         f"[{w2.n}, {w2.k}]")
    for name, v in (("x", x), ("gs13", gs13), ("gs2", gs2), ("sorted_ids", sorted_ids),
                    ("block_expert", block_expert), ("out", out)):
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"moe_mlp: {name} must be a tensor, got {type(v).__name__}")
    # the checks moe_mma makes of each GEMM's operands
    _check_args(x, x_row_div, w13, gs13, sorted_ids, block_expert, n_pairs, 1, None, BLOCK_PAIRS, True)
    _check_weights(w2, x.device, "moe_mlp: w2")
    if w13.codes.shape[0] != w2.codes.shape[0]:
        raise ValueError(f"moe_mlp: w13 has {w13.codes.shape[0]} experts, w2 {w2.codes.shape[0]}")
    if block_expert.numel() < 1 or x.stride(0) < MLP_HIDDEN:
        raise ValueError(f"moe_mlp: block_expert must hold a block and x's row stride must be >= {MLP_HIDDEN}")
    cta_name = mlp_cta(n_pairs, w13.codes.shape[0], max(x_row_div - 1, 1))  # raises on a bad switch
    early = int(mlp_early_scales())  # raises on a bad switch
    e4m3 = mlp_e4m3(w13, w2, bool(early))  # raises likewise
    group = mlp_group(e4m3, cta_name)  # raises likewise
    prefetch = int(mlp_prefetch(e4m3, cta_name, group))  # raises likewise
    if e4m3:
        for name, w in (("w13", w13), ("w2", w2)):
            c = w.scales_e4m3
            if not (isinstance(c, torch.Tensor) and c.dtype == torch.uint8 and c.shape == w.scales.shape
                    and c.is_contiguous() and c.device == x.device and c.data_ptr() % 16 == 0):
                raise ValueError(f"moe_mlp: {name}.scales_e4m3 must be a contiguous, 16-byte aligned uint8 tensor of "
                                 f"its scales' shape {tuple(w.scales.shape)} on {x.device}")
    if out.dtype != torch.float32 or tuple(out.shape) != (split, n_pairs, MLP_HIDDEN) or not out.is_contiguous():
        raise ValueError(f"moe_mlp: out must be a contiguous float32 [{split}, {n_pairs}, {MLP_HIDDEN}] tensor")
    if out.device != x.device:
        raise ValueError("moe_mlp: x, the weights and out must be on one device")
    if gs2.dim() != 2 or gs2.dtype != torch.float32 or gs2.device != x.device or tuple(gs2.shape) != (
            w2.codes.shape[0], MLP_HIDDEN) or gs2.stride(1) != 1:
        raise ValueError(f"moe_mlp: gs2 must be float32 [{w2.codes.shape[0]}, {MLP_HIDDEN}] on {x.device} with a "
                         f"contiguous last dim")
    lib = mma_library(x.device)
    if lib is None:
        raise RuntimeError("moe_mlp: the CUDA kernel is not available on this device")
    rc = lib.vq_moe_mlp_launch(
        x.data_ptr(), x_row_div, x.stride(0), w13.codes.data_ptr(),
        (w13.scales_e4m3 if e4m3 else w13.scales).data_ptr(), gs13.data_ptr(), gs13.stride(0), w2.codes.data_ptr(),
        (w2.scales_e4m3 if e4m3 else w2.scales).data_ptr(), gs2.data_ptr(), gs2.stride(0), out.data_ptr(),
        out.stride(0), out.stride(1), sorted_ids.data_ptr(), block_expert.data_ptr(), block_expert.numel(), n_pairs,
        MLP_HIDDEN, MLP_INTERMEDIATE, split, MLP_CTAS[cta_name], early, int(e4m3), group, prefetch, pdl_mode(x.device),
        ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream),
    )
    if rc != 0:
        raise RuntimeError(f"moe_mlp: launch failed with CUDA error {rc}")
    return out

