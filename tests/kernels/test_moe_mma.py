"""The CUDA MoE kernels (csrc/moe_mma.cu, kernels/moe/mma_cuda.py): blocks of 16 pairs (decode kernel) and of
32 / 64 pairs (prefill kernel).

CPU: the weight shuffle, read back lane by lane as the kernel reads it (``moe_mma_emulated``), equals the
dense dequantized weights; for 32 / 64-pair blocks the emulation also follows the prefill kernel's x path
fragment by fragment (staged pieces, ldmatrix lane addresses, B / C fragment layouts, active n8 tiles) and
must equal the dense product; argument and config checks; configs with MMA = 1 fall back when the kernel
cannot run, and the T rule of tuned MMA entries.
GPU: the kernels' raw sums against codes x scales . x, and ``fused_moe`` with MMA configs against the fp32
reference at the model's shapes (decode-sized T for 16-pair blocks, T = 128-1024 for 32 / 64), on fresh
random inputs; CUDA-graph replays.
"""

from __future__ import annotations

import dataclasses
import struct

import pytest
import torch
from vibeqwen_kernels.moe import fused as F
from vibeqwen_kernels.moe import mma_cuda as M

from vibeqwen.checkpoint.quant import nvfp4_dequantize, nvfp4_quantize

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _blocks(ids: list[int], n_exp: int, bm: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align's output for block_m bm, built on the host: (sorted pair ids, block experts)."""
    n = len(ids)
    sorted_ids, bexp = [], []
    for e in range(n_exp):
        group = [p for p, i in enumerate(ids) if i == e]
        while group:
            chunk, group = group[:bm], group[bm:]
            sorted_ids += chunk + [n] * (bm - len(chunk))
            bexp.append(e)
    bexp.append(-1)  # a trailing empty block, as moe_align leaves them
    sorted_ids += [n] * bm
    return torch.tensor(sorted_ids, dtype=torch.int32), torch.tensor(bexp, dtype=torch.int32)


def _ids_with_counts(counts: dict[int, int], gen: torch.Generator) -> list[int]:
    """Expert ids of pairs in a random order with the given number of pairs per expert."""
    ids = [e for e, c in counts.items() for _ in range(c)]
    return [ids[i] for i in torch.randperm(len(ids), generator=gen)]


def _dequant8_integer_part(w: int) -> list[int]:
    """The integer operations of csrc/moe_mma.cu's ``dequant8`` on one 32-bit code word, in Python: the 4 bf16x2
    bit patterns before the scale multiply (a mask; a rotation right by 3 or 6 and a mask; a mask, a 32-bit
    multiply and a mask)."""
    rotr = lambda v, s: ((v >> s) | (v << (32 - s))) & 0xFFFFFFFF  # noqa: E731
    mask, rest, mul = 0x81C081C0, 0x001B001B, (1 << 2) | (1 << 7) | (1 << 12)
    return [w & mask, rotr(w, 3) & mask, rotr(w, 6) & mask, (((w & rest) * mul) & 0xFFFFFFFF) & mask]


def test_code_word_layout_matches_the_dequantizer():
    """Every code placed where ``code_bit_positions`` says comes out of the kernel's integer operations as bf16x2
    bits sign 15 (31), magnitude 8:6 (24:22), nothing else set: e2m1 * 2^-126 in each half; one code at a time
    (all 16 values in each of the 8 slots) and random full words."""
    pos = M.code_bit_positions()
    flat = sorted(b for r in pos for q in r for b in q)
    assert flat == list(range(32))
    assert (M.CODE_MASK, M.CODE_REST, M.CODE_REST_MUL) == (0x81C081C0, 0x001B001B, 4228)

    def word_of(codes):  # codes[r][q]
        return sum(((codes[r][q] >> b) & 1) << pos[r][q][b] for r in range(4) for q in range(2) for b in range(4))

    def expected(codes):
        return [sum(((codes[r][q] >> b) & 1) << (16 * q + (6, 7, 8, 15)[b]) for q in range(2) for b in range(4))
                for r in range(4)]

    cases = []
    for r in range(4):
        for q in range(2):
            for v in range(16):
                c = [[0, 0] for _ in range(4)]
                c[r][q] = v
                cases.append(c)
    gen = torch.Generator().manual_seed(0)
    cases += [torch.randint(0, 16, (4, 2), generator=gen).tolist() for _ in range(500)]
    for c in cases:
        assert _dequant8_integer_part(word_of(c)) == expected(c), c
    # the patterns read as e2m1 * 2^-126 (bf16: the high half of an fp32)
    from vibeqwen.checkpoint.quant import E2M1_VALUES

    for v in range(16):
        bits = expected([[v, 0]] + [[0, 0]] * 3)[0]
        val = struct.unpack("<f", struct.pack("<I", bits << 16))[0]
        assert val == E2M1_VALUES[v].item() * 2.0 ** -126


@pytest.mark.parametrize("repacked", [True, False])
@pytest.mark.parametrize("interleave", [False, True])
def test_shuffle_reads_back_the_dense_weights(repacked, interleave):
    """The shuffled copy (rows in tile order, or with the halves interleaved per tile: the gate|up layout) read
    back lane by lane: the emulated sums, in the original row order, equal dense weights . x."""
    torch.manual_seed(0)
    n_exp, n, k = 3, 32, 512
    w = torch.randn(n_exp, n, k) / k**0.5
    w[1, :, :64] *= 1e-4  # small blocks: subnormal e4m3 scales
    p, s, g = nvfp4_quantize(w)
    dense = nvfp4_dequantize(p, s, torch.ones_like(g), dtype=torch.float32)  # without the global scale
    packed = F._to_kernel_order(p) if repacked else p
    mw = M.shuffle_mma_weights(packed, s, repacked, interleave_halves=interleave)
    assert mw.codes.shape == (n_exp, n // 16, k // 64, 32, 16) and mw.scales.shape == (n_exp, n // 16, k // 64, 64)
    assert mw.halves_interleaved == interleave
    ids = [2, 0, 2, 1, 2, 2]  # 6 pairs, x row = pair // 2 (k' = 2)
    x = torch.randn(3, k)
    sorted_ids, bexp = _blocks(ids, n_exp)
    for split in (1, 2):
        out = torch.full((split, len(ids), n), float("nan"))
        M.moe_mma_emulated(x, 2, mw, None, sorted_ids, bexp, len(ids), split, out)
        total = out.sum(0)
        for pair, e in enumerate(ids):
            torch.testing.assert_close(total[pair], dense[e] @ x[pair // 2], rtol=1e-4, atol=1e-4 * dense[e].abs().max().item())


def test_e4m3_scale_copy_and_conversion():
    """The e4m3 copy of the block scales (shuffle_mma_weights(e4m3_copy=True)) holds each bf16 scale / 2^117 as an
    e4m3 byte in the same order (subnormal scales included); the kernel's conversion back (e4m3_scale_words, the
    CUDA code's integer and bf16 steps) gives the bf16 words bit for bit for every pair of nonnegative finite e4m3
    values; a NaN or a sign bit among the scales keeps no copy (the conversion assumes neither)."""
    torch.manual_seed(0)
    w = torch.randn(2, 32, 512) / 512**0.5
    w[1, :, :64] *= 1e-5  # subnormal e4m3 scales
    p, s, _ = nvfp4_quantize(w)
    s = s.view(torch.uint8).clone()
    s[0, 3, 8] = 0  # a zero scale (the quantizer makes none)
    mw = M.shuffle_mma_weights(p, s, False, interleave_halves=True, e4m3_copy=True)
    assert mw.scales_e4m3 is not None and mw.scales_e4m3.dtype == torch.uint8
    assert mw.scales_e4m3.shape == mw.scales.shape
    back = (mw.scales_e4m3.view(torch.float8_e4m3fn).float() * M.SCALE_BIAS).to(torch.bfloat16)
    assert torch.equal(back.view(torch.int16), mw.scales.view(torch.int16))
    c = mw.scales_e4m3
    assert bool((c == 0).any()) and bool((((c >> 3) == 0) & (c != 0)).any())  # a zero and subnormals
    assert M.shuffle_mma_weights(p, s, False).scales_e4m3 is None
    for bad in (0x7F, 0xB8, 0x80):  # NaN, -1.0, -0
        s2 = s.clone()
        s2[1, 5, 2] = bad
        assert M.shuffle_mma_weights(p, s2, False, e4m3_copy=True).scales_e4m3 is None
    b = torch.arange(128, dtype=torch.int64)
    b = b[b != 0x7F]
    pairs = (b[:, None] | (b[None, :] << 8)).reshape(-1)

    def bf16_bits(v):
        f = (v.to(torch.uint8).view(torch.float8_e4m3fn).float() * M.SCALE_BIAS).to(torch.bfloat16)
        return f.view(torch.int16).to(torch.int64) & 0xFFFF

    assert torch.equal(M.e4m3_scale_words(pairs), bf16_bits(pairs & 0xFF) | (bf16_bits(pairs >> 8) << 16))


def test_mlp_e4m3_switch(monkeypatch):
    """moe_mlp streams the e4m3 scales where both weights carry them, the early scale loads are off and
    VIBEQWEN_MOE_MLP_E4M3 is not 0; the copy is made unless VIBEQWEN_MOE_MLP_E4M3=0; other values raise."""
    monkeypatch.delenv("VIBEQWEN_MOE_MLP_E4M3", raising=False)
    w13, w2 = _mlp_weights()
    c13 = dataclasses.replace(w13, scales_e4m3=torch.zeros(w13.scales.shape, dtype=torch.uint8))
    c2 = dataclasses.replace(w2, scales_e4m3=torch.zeros(w2.scales.shape, dtype=torch.uint8))
    assert M.mlp_e4m3_copy()
    assert M.mlp_e4m3(c13, c2, False) and not M.mlp_e4m3(c13, c2, True)
    assert not M.mlp_e4m3(w13, c2, False) and not M.mlp_e4m3(c13, w2, False)
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_E4M3", "0")
    assert not M.mlp_e4m3(c13, c2, False) and not M.mlp_e4m3_copy()
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_E4M3", "1")
    assert M.mlp_e4m3(c13, c2, False) and M.mlp_e4m3_copy()
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_E4M3", "yes")
    with pytest.raises(ValueError, match="VIBEQWEN_MOE_MLP_E4M3"):
        M.mlp_e4m3(c13, c2, False)


@pytest.mark.parametrize("bm", [32, 64])
@pytest.mark.parametrize("split", [1, 2])
def test_large_blocks_emulated_match_dense(bm, split):
    """The prefill kernel's fragment path, emulated (inactive n8 tiles staged as NaN, so a read of one shows),
    equals dense weights . x for blocks of every fill: 1 pair, 7, 8, 9 (a second tile with one pair), a full
    block and one more (a full block plus a 1-pair block), with the down projection's global scale."""
    gen = torch.Generator().manual_seed(11)
    n_exp, n, k = 6, 32, 512
    w = torch.randn(n_exp, n, k, generator=gen) / k**0.5
    w[2, :, 128:192] *= 1e-4  # subnormal e4m3 scales in one chunk
    p, s, g = nvfp4_quantize(w)
    dense = nvfp4_dequantize(p, s, torch.ones_like(g), dtype=torch.float32)
    mw = M.shuffle_mma_weights(F._to_kernel_order(p), s, repacked=True)
    ids = _ids_with_counts({0: 1, 1: 7, 2: 8, 3: 9, 4: bm, 5: bm + 1}, gen)
    x = torch.randn(len(ids), k, generator=gen)
    sorted_ids, bexp = _blocks(ids, n_exp, bm)
    gscale = torch.rand(n_exp, n, generator=gen) + 0.5
    for gs in (None, gscale):
        out = torch.full((split, len(ids), n), float("nan"))
        M.moe_mma_emulated(x, 1, mw, gs, sorted_ids, bexp, len(ids), split, out, block_pairs=bm)
        total = out.sum(0)
        for pair, e in enumerate(ids):
            want = dense[e] @ x[pair]
            if gs is not None:
                want = want * gs[e]
            torch.testing.assert_close(total[pair], want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    # each split holds only its own K range
    if split == 2:
        pair = ids.index(4)
        torch.testing.assert_close(out[0, pair], dense[4][:, : k // 2] @ x[pair, : k // 2] * gscale[4],
                                   rtol=1e-4, atol=1e-4 * out[0, pair].abs().max().item())


def test_kernel_rows():
    assert M.kernel_rows(32, False).tolist() == list(range(32))
    assert M.kernel_rows(32, True).tolist() == [*range(0, 8), *range(16, 24), *range(8, 16), *range(24, 32)]
    with pytest.raises(ValueError, match="N % 32"):
        M.shuffle_mma_weights(torch.zeros(1, 48, 32, dtype=torch.uint8), torch.zeros(1, 48, 4, dtype=torch.uint8),
                              repacked=False, interleave_halves=True)


@pytest.mark.parametrize("bm", [16, 32])
def test_emulated_silu_epilogue(bm):
    """silu=True (interleaved gate|up weights, split 1): h = silu(gate * gscale) * (up * gscale) against the dense
    weights (both halves in the original row order), in bf16, for 16- and 32-pair blocks."""
    gen = torch.Generator().manual_seed(3)
    n_exp, n, k = 3, 64, 256
    p, s, g = nvfp4_quantize(torch.randn(n_exp, n, k, generator=gen) / k**0.5)
    dense = nvfp4_dequantize(p, s, torch.ones_like(g), dtype=torch.float32)
    mw = M.shuffle_mma_weights(p, s, repacked=False, interleave_halves=True)
    ids = [int(v) for v in torch.randint(0, n_exp, (bm + 3,), generator=gen)]
    sorted_ids, bexp = _blocks(ids, n_exp, bm)
    x = torch.randn(len(ids), k, generator=gen).to(torch.bfloat16)
    gscale = torch.rand(n_exp, n, generator=gen) + 0.5
    got = torch.zeros(1, len(ids), n // 2, dtype=torch.bfloat16)
    M.moe_mma_emulated(x, 1, mw, gscale, sorted_ids, bexp, len(ids), 1, got, bm, silu=True)
    for pair, e in enumerate(ids):
        v = dense[e] @ x[pair].float() * gscale[e]
        want = torch.nn.functional.silu(v[: n // 2]) * v[n // 2:]
        torch.testing.assert_close(got[0, pair].float(), want, rtol=2 ** -7, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("bm", [32, 64])
def test_interleaved_large_blocks_split_match_dense(bm):
    """Interleaved gate|up weights on the prefill kernel's path with K split in 2 and x rows shared by k' = 3
    pairs: each split's fp32 sums come back in the original row order (their sum = dense weights . x)."""
    gen = torch.Generator().manual_seed(21)
    n_exp, n, k = 4, 64, 512
    p, s, g = nvfp4_quantize(torch.randn(n_exp, n, k, generator=gen) / k**0.5)
    dense = nvfp4_dequantize(p, s, torch.ones_like(g), dtype=torch.float32)
    mw = M.shuffle_mma_weights(F._to_kernel_order(p), s, repacked=True, interleave_halves=True)
    ids = _ids_with_counts({0: 1, 1: 9, 2: bm, 3: bm + 2}, gen)
    x = torch.randn(-(-len(ids) // 3), k, generator=gen)
    sorted_ids, bexp = _blocks(ids, n_exp, bm)
    out = torch.full((2, len(ids), n), float("nan"))
    M.moe_mma_emulated(x, 3, mw, None, sorted_ids, bexp, len(ids), 2, out, block_pairs=bm)
    for pair, e in enumerate(ids):
        xr = x[pair // 3]
        half, full = dense[e][:, : k // 2] @ xr[: k // 2], dense[e] @ xr  # fp32, summed in another order
        torch.testing.assert_close(out[0, pair], half, rtol=1e-4, atol=1e-4 * half.abs().max().item())
        torch.testing.assert_close(out.sum(0)[pair], full, rtol=1e-4, atol=1e-4 * full.abs().max().item())


def test_large_block_emulation_reads_only_active_tiles():
    """A block with real pairs only in its first n8 tile: a wrong ldmatrix address would read the NaN-staged
    inactive tiles or the staging pad and poison the sums; x rows of other pairs never enter."""
    gen = torch.Generator().manual_seed(5)
    n, k = 16, 256
    p, s, _ = nvfp4_quantize(torch.randn(1, n, k, generator=gen))
    mw = M.shuffle_mma_weights(p, s, repacked=False)
    x = torch.randn(3, k, generator=gen)
    x[2] = float("nan")  # pair 2 is in no block
    sorted_ids = torch.tensor([0, 1] + [3] * 62 + [3] * 64, dtype=torch.int32)
    bexp = torch.tensor([0, -1], dtype=torch.int32)
    out = torch.zeros(1, 3, n)
    M.moe_mma_emulated(x, 1, mw, None, sorted_ids, bexp, 3, 1, out, block_pairs=64)
    assert torch.isfinite(out).all() and out[0, :2].abs().sum() > 0 and (out[0, 2] == 0).all()


def test_moe_mma_rejects_bad_inputs():
    """Each bad argument gets a ValueError naming it (before any kernel is looked for); valid arguments on the
    CPU get the RuntimeError that the kernel is not available here."""
    torch.manual_seed(0)
    p, s, _ = nvfp4_quantize(torch.randn(2, 32, 256))
    w = M.shuffle_mma_weights(p, s, repacked=False)
    ids = [0, 1, 1]
    sorted_ids, bexp = _blocks(ids, 2)
    x = torch.randn(3, 256).to(torch.bfloat16)
    out = torch.empty(1, 3, 32)

    def call(**kw):
        args = dict(x=x, x_row_div=1, w=w, gscale=None, sorted_ids=sorted_ids, block_expert=bexp, n_pairs=3,
                    split=1, out=out)
        args.update(kw)
        return M.moe_mma(**args)

    with pytest.raises(ValueError, match="does not split"):
        call(split=3)
    with pytest.raises(ValueError, match="persist_grid"):
        call(persist_grid=-1)
    with pytest.raises(ValueError, match="x must be bf16"):
        call(x=x.float())
    with pytest.raises(ValueError, match="16-byte"):
        call(x=torch.randn(3 * 256 + 1).to(torch.bfloat16)[1:].view(3, 256))
    with pytest.raises(ValueError, match="out must be float32"):
        call(out=torch.empty(1, 3, 16))
    with pytest.raises(ValueError, match="sorted_ids must be a contiguous int32"):
        call(sorted_ids=sorted_ids.long())
    with pytest.raises(ValueError, match="entries per block"):
        call(sorted_ids=sorted_ids[:16])
    with pytest.raises(ValueError, match="gscale must be float32"):
        call(gscale=torch.ones(2, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="block_pairs must be one of"):
        call(block_pairs=48)
    with pytest.raises(ValueError, match="kernel16 must be None or one of"):
        call(kernel16="fast")
    with pytest.raises(ValueError, match="block_pairs must be one of"):
        call(block_pairs=32.0)
    with pytest.raises(ValueError, match="32 entries per block"):
        call(block_pairs=32)  # sorted_ids made for blocks of 16
    sorted64, bexp64 = _blocks(ids, 2, 64)
    with pytest.raises(ValueError, match="does not split"):
        call(block_pairs=64, sorted_ids=sorted64, block_expert=bexp64, split=2)  # K = 256: one register group
    out16 = torch.empty(1, 3, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x_row_div must be an int >= 1"):
        call(x_row_div=0)
    with pytest.raises(ValueError, match="x must hold"):
        call(x=x[:2])
    with pytest.raises(ValueError, match="x must be bf16"):
        call(x=x.view(3, 1, 256))
    with pytest.raises(ValueError, match="gscale must be float32"):
        call(gscale=torch.ones(32))
    with pytest.raises(ValueError, match="gscale must be float32"):
        call(gscale=torch.ones(3, 32))  # one row per expert: 2
    with pytest.raises(ValueError, match="not a shuffle_mma_weights result"):
        call(w=M.MMAWeights(w.codes, w.scales.float(), w.n, w.k))
    with pytest.raises(ValueError, match="silu needs gscale"):
        call(out=out16[..., :16], silu=True, gscale=torch.ones(2, 32))  # weights not interleaved
    wi = M.shuffle_mma_weights(p, s, repacked=False, interleave_halves=True)
    with pytest.raises(ValueError, match="silu needs gscale"):
        call(w=wi, out=out16[..., :16], silu=True)  # no gscale
    with pytest.raises(ValueError, match=r"out must be bf16 \(silu\) \[1, 3, 16\]"):
        call(w=wi, out=out16, silu=True, gscale=torch.ones(2, 32))
    with pytest.raises(RuntimeError, match="not available"):
        call()
    with pytest.raises(RuntimeError, match="not available"):
        call(w=wi, out=torch.empty(1, 3, 16, dtype=torch.bfloat16), silu=True, gscale=torch.ones(2, 32))
    with pytest.raises(RuntimeError, match="not available"):
        call(block_pairs=64, sorted_ids=sorted64, block_expert=bexp64)


def test_decode_kernel_persist_switch(monkeypatch):
    monkeypatch.delenv("VIBEQWEN_MOE_DECODE_KERNEL", raising=False)
    monkeypatch.setenv("VIBEQWEN_MOE_PERSIST", "1")
    assert M.decode_kernel(512, 1, 288) == "regs2p"  # down at 32 tokens
    assert M.decode_kernel(2048, 2, 288) == "async2" and M.decode_kernel(512, 1, 72) == "regs"
    monkeypatch.setenv("VIBEQWEN_MOE_PERSIST", "0")
    assert M.decode_kernel(512, 1, 288) == "regs2"


def test_decode_kernel_rule(monkeypatch, caplog):
    """The async kernel for K ranges of 1024+ it is built for (two row tiles per warp from 64 pairs, four for an
    unsplit 2048-k range from 512), two row tiles from 256 pairs below that, else one; the env var forces one
    (async only where it is built)."""
    monkeypatch.delenv("VIBEQWEN_MOE_DECODE_KERNEL", raising=False)
    monkeypatch.delenv("VIBEQWEN_MOE_PERSIST", raising=False)
    assert M.decode_kernel(2048, 1, 9) == "async" and M.decode_kernel(2048, 2, 288) == "async2"
    assert M.decode_kernel(2048, 1, 63) == "async" and M.decode_kernel(2048, 1, 64) == "async2"
    assert M.decode_kernel(2048, 1, 511) == "async2" and M.decode_kernel(2048, 1, 576) == "async4"
    assert M.decode_kernel(2048, 2, 576) == "async2"  # a 1024-k range: two row tiles
    assert M.decode_kernel(2048, 4, 288) == "regs2" and M.decode_kernel(512, 1, 256) == "regs2"
    assert M.decode_kernel(512, 1, 255) == "regs" and M.decode_kernel(512, 2, 9) == "regs"
    assert M.decode_kernel(16384, 1, 9) == "regs"  # 256 chunks: no async kernel for it
    assert M.async_split_ok(512, 2) and M.async_split_ok(2048, 1) and not M.async_split_ok(4096, 1)
    assert not M.async_split_ok(2048, 3) and not M.async_split_ok(2048, 0)
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_KERNEL", "regs")
    assert M.decode_kernel(2048, 1, 9) == "regs"
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_KERNEL", "async")
    assert M.decode_kernel(512, 1, 9) == "async" and M.decode_kernel(16384, 1, 9) == "regs"
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_KERNEL", "async4")
    assert M.decode_kernel(512, 1, 9) == "async4" and M.decode_kernel(16384, 1, 9) == "regs"
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_KERNEL", "fast")  # not a choice: the rule, and a warning
    with caplog.at_level("WARNING", logger=M.__name__):
        assert M.decode_kernel(512, 1, 300) == "regs2"
    assert "VIBEQWEN_MOE_DECODE_KERNEL=fast ignored" in caplog.text


def test_split_ok():
    assert M.split_ok(2048, 1) and M.split_ok(2048, 8) and M.split_ok(512, 2)
    assert not M.split_ok(512, 4) and not M.split_ok(2048, 3) and not M.split_ok(2048, 0)
    assert not M.split_ok(16384, 2) and M.split_ok(16384, 4)  # the x tile must fit in shared memory
    # the prefill kernel stages 256-k pieces: its shared memory does not grow with K / split
    assert M.smem_bytes(2048, 1, 64) == M.smem_bytes(512, 2, 64) == 2 * 64 * 264 * 2
    assert M.smem_bytes(2048, 1, 32) == 2 * 32 * 264 * 2
    assert M.split_ok(16384, 1, 64) and M.split_ok(2048, 8, 32) and M.split_ok(512, 2, 64)
    assert not M.split_ok(512, 4, 64) and not M.split_ok(2048, 1, 48) and not M.split_ok(2048, 1, 128)


def test_mma_config_checks():
    cfg = dict(F.default_moe_config(1), MMA=1, GEMV=0, BLOCK_M=128)
    with pytest.raises(ValueError, match="MMA = 1 needs BLOCK_M in"):
        F._check_config(cfg, use_asm=False)
    with pytest.raises(ValueError, match="MMA = 1 needs BLOCK_M in"):
        F._check_config(dict(cfg, BLOCK_M=32, GEMV=1), use_asm=False)
    with pytest.raises(ValueError, match="MMA must be 0 or 1"):
        F._check_config(dict(cfg, BLOCK_M=16, MMA=2), use_asm=False)
    for bm in M.BLOCK_SIZES:
        F._check_config(dict(cfg, BLOCK_M=bm), use_asm=False)


def test_pick_moe_config_fallback(monkeypatch, tmp_path):
    """An MMA entry runs its tuned fallback where the CUDA kernel cannot run."""
    import json

    base = dict(F.default_moe_config(1), GEMV=0, SPLIT_GU=0)
    fallback = dict(base, SPLIT_K1=4)
    entry = dict(base, BLOCK_M=16, MMA=1, SPLIT_K1=2, SPLIT_K2=1, fallback=fallback)
    path = tmp_path / "moe.json"
    path.write_text(json.dumps({"configs": {"1": entry}}))
    monkeypatch.setenv("VIBEQWEN_MOE_CONFIGS", str(path))
    F._tuned_table.cache_clear()
    try:
        assert F.pick_moe_config(1)["MMA"] == 1
        cfg = F.pick_moe_config(1, allow_mma=False)
        assert cfg["MMA"] == 0 and cfg["SPLIT_K1"] == 4
        # past the sizes the kernel was tuned for, the nearest MMA entry runs its fallback too
        assert F.pick_moe_config(F.MMA_MAX_T)["MMA"] == 1
        assert F.pick_moe_config(F.MMA_MAX_T + 1)["MMA"] == 0
    finally:
        F._tuned_table.cache_clear()


def test_pick_moe_config_large_blocks(monkeypatch, tmp_path):
    """MMA entries with 32 / 64-pair blocks (the prefill kernel) serve any T they are nearest to; 16-pair MMA
    entries only T <= MMA_MAX_T."""
    import json

    base = dict(F.default_moe_config(1), GEMV=0, SPLIT_GU=0)
    fallback = dict(F.default_moe_config(1024), GEMV=0, SPLIT_GU=0)
    small = dict(base, BLOCK_M=16, MMA=1, SPLIT_K1=2, SPLIT_K2=1, fallback=base)
    large = dict(base, BLOCK_M=64, MMA=1, SPLIT_K1=1, SPLIT_K2=1, fallback=fallback)
    path = tmp_path / "moe.json"
    path.write_text(json.dumps({"configs": {"16": small, "1024": large}}))
    monkeypatch.setenv("VIBEQWEN_MOE_CONFIGS", str(path))
    F._tuned_table.cache_clear()
    try:
        assert F.pick_moe_config(F.MMA_MAX_T)["BLOCK_M"] == 16 and F.pick_moe_config(F.MMA_MAX_T)["MMA"] == 1
        for t in (200, 1024, 8192):  # nearest entry 1024
            cfg = F.pick_moe_config(t)
            assert cfg["MMA"] == 1 and cfg["BLOCK_M"] == 64, (t, cfg)
        assert F.pick_moe_config(1024, allow_mma=False) == {
            key: fallback.get(key, F.OPTIONAL_CONFIG_KEYS.get(key)) for key in F.CONFIG_KEYS}
        assert F.pick_moe_config(100)["MMA"] == 0  # nearest entry 16 (log2): its fallback beyond MMA_MAX_T
    finally:
        F._tuned_table.cache_clear()


def test_shuffled_copy_only_where_asked_or_on_a_gpu():
    """Shapes the kernel takes (I = 64, H = 256): no shuffled copy by default on the CPU; mma=True makes one."""
    torch.manual_seed(0)
    trip = []
    for n, k in ((64, 256), (64, 256), (256, 64)):
        p, s, g = nvfp4_quantize(torch.randn(2, n, k))
        trip.append([(p[e], s[e], g[e]) for e in range(2)])
    w = F.prepack_moe_nvfp4(*trip)
    assert w.w13_mma is None and w.w2_mma is None
    w = F.prepack_moe_nvfp4(*trip, mma=True)
    assert w.w13_mma.codes.shape == (2, 128 // 16, 256 // 64, 32, 16)
    assert w.w2_mma.codes.shape == (2, 256 // 16, 64 // 64, 32, 16)


# ------------------------------------------------------------------------------------------------ GPU

E_REAL, K_REAL, H_REAL, I_REAL = 256, 8, 2048, 512


@pytest.fixture(scope="module")
def mma_experts():
    if M.mma_library(torch.device("cuda")) is None:
        pytest.skip("the CUDA MoE kernel could not be built here")
    torch.manual_seed(2)
    trip, dense = [], []
    for n, k in ((I_REAL, H_REAL), (I_REAL, H_REAL), (H_REAL, I_REAL)):
        w = torch.randn(E_REAL + 1, n, k, device="cuda") / k**0.5
        p, s, g = nvfp4_quantize(w)
        trip.append([(p[e], s[e], g[e]) for e in range(E_REAL + 1)])
        dense.append(nvfp4_dequantize(p, s, g, dtype=torch.float32))
    weights = F.prepack_moe_nvfp4(*trip, device="cuda", mma=True)
    assert weights.w13_mma is not None
    return weights, *dense


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("split", [1, 4])
def test_gpu_kernel_raw_sums(split, mma_experts):
    """Raw fp32 split sums of the kernel = codes x block scales (no global scale) . x, times 2^-9."""
    weights = mma_experts[0]
    dev = torch.device("cuda")
    ids = [5, 256, 5, 7, 5] + [9] * 17  # expert 9 spans two blocks; the shared expert once
    n_pairs = len(ids)
    x = torch.randn(n_pairs, H_REAL, device=dev).to(torch.bfloat16)
    sorted_ids, bexp = _blocks(ids, E_REAL + 1)
    sorted_ids, bexp = sorted_ids.to(dev), bexp.to(dev)
    out = torch.full((split, n_pairs, 2 * I_REAL), float("nan"), device=dev)
    M.moe_mma(x, 1, weights.w13_mma, None, sorted_ids, bexp, n_pairs, split, out)
    # the dense weights the emulation reads back (checked on the CPU above), without global scales
    codes = M._codes_from_packed(weights.w13_packed, weights.repacked).float()
    from vibeqwen.checkpoint.quant import E2M1_VALUES

    vals = E2M1_VALUES.to(dev)[codes.long()]  # [E', 2I, H]
    sc = weights.w13_scale.float().repeat_interleave(16, dim=-1)
    dense = vals * sc  # without global scales
    for s in range(split):
        lo, hi = s * H_REAL // split, (s + 1) * H_REAL // split
        for pair, e in enumerate(ids):
            want = dense[e][:, lo:hi] @ x[pair, lo:hi].float()
            # fp32 sums in another order: near-cancelling entries differ by ~1e-4 of the terms' scale
            torch.testing.assert_close(out[s, pair] * 512.0, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [1, 3, 8, 32, 64])
@pytest.mark.parametrize("splits", [(1, 1), (2, 1), (4, 2), (8, 1)])
def test_gpu_fused_moe_mma(t, splits, mma_experts, monkeypatch):
    cfg = dict(F.default_moe_config(t), BLOCK_M=16, GEMV=0, SPLIT_GU=0, MMA=1, SPLIT_K1=splits[0],
               SPLIT_K2=splits[1])
    _check_fused_mma(mma_experts, t, cfg, monkeypatch)


def _check_fused_mma(mma_experts, t: int, cfg: dict, monkeypatch) -> None:
    """fused_moe with an MMA config: both GEMMs in the CUDA kernel for cfg's BLOCK_M (no silent fallback), the
    result within 5e-3 of the fp32 reference and of the Triton path on the same routing. (The two GEMM launches:
    test_gpu_mlp_fused_moe covers the one-launch moe_mlp that decode-sized T would take.)"""
    monkeypatch.setenv("VIBEQWEN_MOE_MLP", "0")
    weights, wg, wu, wd = mma_experts
    from vibeqwen_kernels.moe.naive import moe_experts_ref

    dev = torch.device("cuda")
    x = torch.randn(t, H_REAL, device=dev).to(torch.bfloat16)
    tw, ti = F.fused_router(torch.randn(t, E_REAL + 1, device=dev).to(torch.bfloat16), K_REAL)
    out = torch.full((t, H_REAL), float("nan"), device=dev, dtype=torch.bfloat16)
    blocks = []
    launch = M.moe_mma
    monkeypatch.setattr(M, "moe_mma", lambda *a, **k: blocks.append(a[9] if len(a) > 9 else k.get("block_pairs", 16))
                        or launch(*a, **k))
    y = F.fused_moe(x, tw, ti, weights, cfg, out=out)
    assert blocks == [cfg["BLOCK_M"]] * 2
    ref = moe_experts_ref(x.float(), tw.float(), ti.long(), wg, wu, wd)
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert err < 5e-3, err
    # the Triton path on the same routing agrees to bf16 rounding of the intermediates
    y2 = F.fused_moe(x, tw, ti, weights, dict(F.default_moe_config(t), MMA=0))
    assert ((y.float() - y2.float()).norm() / y2.float().norm()).item() < 5e-3


@pytest.mark.gpu
@requires_gpu
def test_gpu_mma_in_cuda_graph(mma_experts):
    """The launch is capturable: a replay with new inputs gives the eager result."""
    t = 4
    _check_graph_replay(mma_experts[0], t, dict(F.default_moe_config(t), BLOCK_M=16, GEMV=0, SPLIT_GU=0, MMA=1,
                                                SPLIT_K1=4, SPLIT_K2=1))


def _check_graph_replay(weights, t: int, cfg: dict) -> None:
    """fused_moe with cfg captured in a CUDA graph, replayed on new x and routing = the eager call on them."""
    dev = torch.device("cuda")
    x = torch.randn(t, H_REAL, device=dev).to(torch.bfloat16)
    tw, ti = F.fused_router(torch.randn(t, E_REAL + 1, device=dev).to(torch.bfloat16), K_REAL)
    out = torch.empty(t, H_REAL, device=dev, dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        F.fused_moe(x, tw, ti, weights, cfg, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        F.fused_moe(x, tw, ti, weights, cfg, out=out)
    x.copy_(torch.randn_like(x))
    tw2, ti2 = F.fused_router(torch.randn(t, E_REAL + 1, device=dev).to(torch.bfloat16), K_REAL)
    tw.copy_(tw2)
    ti.copy_(ti2)
    g.replay()
    torch.testing.assert_close(out, F.fused_moe(x, tw, ti, weights, cfg), rtol=0, atol=0)


@pytest.mark.gpu
@requires_gpu
def test_gpu_kernel_partial_tile_group():
    """N = 48 (3 row tiles: the CTA's fourth warp has no tile) and K = 512 in 2 splits, 40 pairs over 3 experts
    (blocks with both n8 halves in use), against codes x scales . x."""
    _check_partial_tiles(n=48, splits=(2,), kernel16=None, seed=3)


def _check_partial_tiles(n: int, splits: tuple[int, ...], kernel16: str | None, seed: int,
                         persist_grid: int = 0) -> None:
    """moe_mma with 16-pair blocks on an [N, 512] weight of 3 experts, 40 random pairs (blocks with both n8 halves
    in use), each K split in `splits`, the given 16-pair kernel (None: the rule's): the split sums (raw, times
    2^9) against codes x scales . x."""
    if M.mma_library(torch.device("cuda")) is None:
        pytest.skip("the CUDA MoE kernel could not be built here")
    torch.manual_seed(seed)
    dev = torch.device("cuda")
    n_exp, k = 3, 512
    p, s, g = nvfp4_quantize(torch.randn(n_exp, n, k, device=dev) / k**0.5)
    w = M.shuffle_mma_weights(p, s, repacked=False)
    dense = nvfp4_dequantize(p, s, torch.ones_like(g), dtype=torch.float32)
    ids = [int(v) for v in torch.randint(0, n_exp, (40,))]
    sorted_ids, bexp = _blocks(ids, n_exp)
    x = torch.randn(len(ids), k, device=dev).to(torch.bfloat16)
    for split in splits:
        out = torch.full((split, len(ids), n), float("nan"), device=dev)
        M.moe_mma(x, 1, w, None, sorted_ids.to(dev), bexp.to(dev), len(ids), split, out, kernel16=kernel16,
                  persist_grid=persist_grid)
        total = out.sum(0) * 512.0
        for pair, e in enumerate(ids):
            want = dense[e] @ x[pair].float()
            torch.testing.assert_close(total[pair], want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


def _decode_outputs(weights, which: str, split: int, ids: list[int], runs) -> list[torch.Tensor]:
    """The 16-pair GEMM ``which`` (gate_up: raw sums, down: global scales, silu: the SiLU epilogue) of random x rows
    for pairs ``ids`` in ``split`` K splits, once per (kernel16, persist_grid) of ``runs``, into NaN-filled outputs."""
    dev = torch.device("cuda")
    n_pairs = len(ids)
    sorted_ids, bexp = (v.to(dev) for v in _blocks(ids, E_REAL + 1))
    if which == "down":
        w, gs, k, n = weights.w2_mma, weights.w2_gscale, I_REAL, H_REAL
    else:
        w, gs, k, n = weights.w13_mma, weights.w13_gscale if which == "silu" else None, H_REAL, 2 * I_REAL
    x = torch.randn(n_pairs, k, device=dev).to(torch.bfloat16)
    outs = []
    for kern, grid in runs:
        if which == "silu":
            out = torch.full((1, n_pairs, n // 2), float("nan"), device=dev, dtype=torch.bfloat16)
            M.moe_mma(x, 1, w, gs, sorted_ids, bexp, n_pairs, 1, out, silu=True, kernel16=kern, persist_grid=grid)
        else:
            out = torch.full((split, n_pairs, n), float("nan"), device=dev)
            M.moe_mma(x, 1, w, gs, sorted_ids, bexp, n_pairs, split, out, kernel16=kern, persist_grid=grid)
        outs.append(out)
    return outs


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("which,split", [("gate_up", 1), ("gate_up", 2), ("gate_up", 4), ("gate_up", 8),
                                         ("down", 1), ("down", 2), ("silu", 1)])
def test_gpu_decode_kernels_same_sums(which, split, mma_experts):
    """The 16-pair kernels (one or two row tiles per warp through registers, 8 warps of 1, 2 or 4 row tiles
    through cp.async rings) give the same sums bit for bit (the same products in the same order), for every chunk count the async kernel is
    built for (32, 16, 8, 4 per split), blocks with one and both n8 halves, raw sums, the global-scale and the SiLU
    epilogues; test_gpu_kernel_raw_sums checks them against the dense product."""
    torch.manual_seed(11 + split)
    ids = [5, 256, 5, 7, 5] + [9] * 17 + [int(v) for v in torch.randint(0, E_REAL + 1, (40,))]
    assert M.async_split_ok(I_REAL if which == "down" else H_REAL, split)
    outs = _decode_outputs(mma_experts[0], which, split, ids, [(kern, 0) for kern in M.DECODE_KERNELS])
    assert bool(torch.isfinite(outs[0]).all())
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("which,split", [("gate_up", 1), ("gate_up", 2), ("gate_up", 4), ("gate_up", 8), ("down", 1),
                                         ("down", 2), ("silu", 1)])
def test_gpu_async_ring_steps_same_sums(which, split, mma_experts, monkeypatch):
    """The cp.async kernels' ring in steps of 4 chunks (the default) and of one chunk (VIBEQWEN_MOE_RING_STEP=1): the
    same sums bit for bit, for 1, 2 and 4 row tiles per warp and 32, 16, 8 and 4 chunks a split (one ring step a
    tile at 4), with both n8 halves in some blocks."""
    torch.manual_seed(41 + split)
    ids = [5, 256, 5, 7, 5] + [9] * 17 + [int(v) for v in torch.randint(0, E_REAL + 1, (40,))]
    outs = []
    for step in ("4", "1"):
        monkeypatch.setenv("VIBEQWEN_MOE_RING_STEP", step)
        assert M.ring_step() == int(step)
        torch.manual_seed(7)  # the same x
        outs += _decode_outputs(mma_experts[0], which, split, ids, [(kern, 0) for kern in M.ASYNC_KERNELS])
    assert bool(torch.isfinite(outs[0]).all())
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("which,split", [("down", 1), ("down", 2), ("gate_up", 2), ("silu", 1)])
def test_gpu_persistent_kernel_many_items(which, split, mma_experts):
    """regs2p (a grid of resident CTAs) = regs2 bit for bit with more items than CTAs: 600 pairs over the 257
    experts (~230 blocks x 8-16 row groups: several items per CTA, ranges crossing blocks and splits), on the
    resident grid and on 7 CTAs."""
    torch.manual_seed(31 + split)
    ids = [int(v) for v in torch.randint(0, E_REAL + 1, (600,))] + [7] * 20  # and a block of both n8 halves
    # the resident grid, and 7 CTAs
    outs = _decode_outputs(mma_experts[0], which, split, ids, [("regs2", 0), ("regs2p", 0), ("regs2p", 7)])
    assert bool(torch.isfinite(outs[0]).all())
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("n", [48, 80, 144])
@pytest.mark.parametrize("kern", ["regs2", "async", "async2", "async4", "regs2p", "regs2p/2"])
def test_gpu_decode_kernels_partial(n, kern):
    """Matrices ending inside a CTA's row tiles (N = 48, 80, 144: warps with no tile, or fewer than their 2 or 4),
    K = 512 in 1 and 2 splits (the async kernels' rings of 8 and 4 chunks), against codes x scales . x. regs2p/2:
    the persistent kernel on 2 CTAs (several items each: ranges across blocks and splits, warps without a tile in an
    item prefetching the next one's)."""
    kern, _, grid = kern.partition("/")
    _check_partial_tiles(n=n, splits=(1, 2), kernel16=kern, seed=5, persist_grid=int(grid or 0))


# ------------------------------------------------------------------------- GPU: 32 / 64-pair blocks (prefill)


def _dense_no_gscale(packed: torch.Tensor, scales: torch.Tensor, repacked: bool) -> torch.Tensor:
    """codes x block scales, fp32 [E', N, K], without the global scales (what the raw sums multiply)."""
    from vibeqwen.checkpoint.quant import E2M1_VALUES

    codes = M._codes_from_packed(packed, repacked).long()
    return E2M1_VALUES.to(packed.device)[codes] * scales.float().repeat_interleave(16, dim=-1)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("bm", [32, 64])
@pytest.mark.parametrize("which,split", [("gate_up", 1), ("gate_up", 4), ("down", 1), ("down", 2)])
@pytest.mark.parametrize("wgmma", [True, False])
def test_gpu_large_kernel_raw_sums(bm, which, split, wgmma, mma_experts):
    """The prefill kernels' (wgmma and mma.sync) fp32 split sums at the model's shapes (gate|up: N 1024, K 2048,
    raw sums; down: N 2048, K 512, global scale applied) against codes x scales . x, for blocks of every fill: 1, 7,
    8, 9 pairs, full blocks, a full block + 1 pair, the shared expert in several blocks; x rows shared by k' = 3
    pairs (gate/up)."""
    weights = mma_experts[0]
    dev = torch.device("cuda")
    if wgmma and not M.wgmma_available(dev):
        pytest.skip("no wgmma kernel on this device")
    gen = torch.Generator().manual_seed(100 + bm + split)
    counts = {3: 1, 17: 7, 40: 8, 41: 9, 99: bm, 100: bm + 1, 256: 3 * bm - 5}
    ids = _ids_with_counts(counts, gen)
    n_pairs = len(ids)
    used = torch.tensor(sorted(counts), device=dev)
    if which == "gate_up":
        w, gscale, row_div, n, k = weights.w13_mma, None, 3, 2 * I_REAL, H_REAL
        packed, scales = weights.w13_packed[used], weights.w13_scale[used]
    else:
        w, gscale, row_div, n, k = weights.w2_mma, weights.w2_gscale, 1, H_REAL, I_REAL
        packed, scales = weights.w2_packed[used], weights.w2_scale[used]
    dense = dict(zip(sorted(counts), _dense_no_gscale(packed, scales, weights.repacked)))
    x = torch.randn(-(-n_pairs // row_div), k, device=dev).to(torch.bfloat16)
    sorted_ids, bexp = _blocks(ids, E_REAL + 1, bm)
    out = torch.full((split, n_pairs, n), float("nan"), device=dev)
    M.moe_mma(x, row_div, w, gscale, sorted_ids.to(dev), bexp.to(dev), n_pairs, split, out, block_pairs=bm,
              wgmma=wgmma)
    for s in range(split):
        lo, hi = s * k // split, (s + 1) * k // split
        for pair, e in enumerate(ids):
            want = dense[e][:, lo:hi] @ x[pair // row_div, lo:hi].float()
            got = out[s, pair] * 512.0 if gscale is None else out[s, pair]
            if gscale is not None:
                want = want * gscale[e]
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("bm", [32, 64])
@pytest.mark.parametrize("wgmma", [True, False])
@pytest.mark.parametrize("n,k", [(48, 768), (48, 512), (272, 512), (320, 512)])
def test_gpu_large_kernel_partial_tile_group(bm, wgmma, n, k):
    """CTAs whose warps run out of row tiles, against codes x scales . x (1 split, pairs over 4 experts): N = 48
    with K = 768 in 3 pieces (3 row tiles: five of the CTA's 8 warps have none; the wgmma kernel's second
    warpgroup multiplies tile 0 and stores nothing); K = 512 (two pieces: the mma.sync kernel's two row tiles per
    warp) with N = 48, 272, 320 (17 / 20 row tiles: the second pass of some or all warps past the matrix)."""
    if M.mma_library(torch.device("cuda")) is None:
        pytest.skip("the CUDA MoE kernel could not be built here")
    if wgmma and not M.wgmma_available(torch.device("cuda")):
        pytest.skip("no wgmma kernel on this device")
    torch.manual_seed(30 + bm + n)
    dev = torch.device("cuda")
    n_exp = 4
    p, s, g = nvfp4_quantize(torch.randn(n_exp, n, k, device=dev) / k**0.5)
    w = M.shuffle_mma_weights(p, s, repacked=False)
    dense = nvfp4_dequantize(p, s, torch.ones_like(g), dtype=torch.float32)
    ids = [int(v) for v in torch.randint(0, n_exp, (3 * bm,))]
    sorted_ids, bexp = _blocks(ids, n_exp, bm)
    x = torch.randn(len(ids), k, device=dev).to(torch.bfloat16)
    out = torch.full((1, len(ids), n), float("nan"), device=dev)
    M.moe_mma(x, 1, w, None, sorted_ids.to(dev), bexp.to(dev), len(ids), 1, out, block_pairs=bm, wgmma=wgmma)
    for pair, e in enumerate(ids):
        want = dense[e] @ x[pair].float()
        torch.testing.assert_close(out[0, pair] * 512.0, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


def _large_cfg(t: int, bm: int, splits: tuple[int, int]) -> dict:
    return dict(F.default_moe_config(t), BLOCK_M=bm, GEMV=0, SPLIT_GU=0, MMA=1, SPLIT_K1=splits[0],
                SPLIT_K2=splits[1])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [128, 256, 1024])
@pytest.mark.parametrize("bm", [32, 64])
@pytest.mark.parametrize("splits", [(1, 1), (2, 2)])
def test_gpu_fused_moe_large_blocks(t, bm, splits, mma_experts, monkeypatch):
    """fused_moe with the prefill kernel (moe_align with block_m 32 / 64 at T = 128-1024) against the fp32
    reference and the Triton path."""
    _check_fused_mma(mma_experts, t, _large_cfg(t, bm, splits), monkeypatch)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("bm", [32, 64])
def test_gpu_large_blocks_in_cuda_graph(bm, mma_experts):
    """The prefill kernel's launches are capturable: a replay with new inputs gives the eager result."""
    _check_graph_replay(mma_experts[0], 128, _large_cfg(128, bm, (2, 1)))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("bm", [16, 32, 64])
def test_gpu_silu_epilogue(bm, mma_experts):
    """The gate|up kernels' SiLU-and-mul epilogue (interleaved weights, split 1): h against silu(g) * u of the same
    kernel's fp32 output (original row order) with the global scales, within bf16 rounding."""
    weights = mma_experts[0]
    assert weights.w13_mma.halves_interleaved
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(17 + bm)
    ids = _ids_with_counts({4: 1, 8: bm - 1, 100: bm + 5, 256: 2 * bm}, gen)
    n_pairs = len(ids)
    sorted_ids, bexp = _blocks(ids, E_REAL + 1, bm)
    x = torch.randn(-(-n_pairs // 3), H_REAL, device=dev).to(torch.bfloat16)
    raw = torch.empty(1, n_pairs, 2 * I_REAL, device=dev)
    M.moe_mma(x, 3, weights.w13_mma, None, sorted_ids.to(dev), bexp.to(dev), n_pairs, 1, raw, bm)
    got = torch.empty(1, n_pairs, I_REAL, device=dev, dtype=torch.bfloat16)
    M.moe_mma(x, 3, weights.w13_mma, weights.w13_gscale, sorted_ids.to(dev), bexp.to(dev), n_pairs, 1, got, bm,
              silu=True)
    e = torch.tensor(ids, device=dev)
    v = raw[0] * 512.0 * weights.w13_gscale[e]
    g, u = v[:, :I_REAL], v[:, I_REAL:]
    want = g * torch.sigmoid(g) * u
    torch.testing.assert_close(got[0].float(), want, rtol=2 ** -7, atol=1e-5 * want.abs().max().item())


# ------------------------------------------------------------------- gate|up, SiLU and down in one launch


def test_mlp_switches(monkeypatch):
    """Two slices of I unless forced to one; the pair bound and the off switch; the CTA shape's rule (a CTA per n8
    half where a CTA per block would run in 1.0-1.45 waves) and switch; the early scale loads' switch."""
    for name in ("VIBEQWEN_MOE_MLP_SPLIT", "VIBEQWEN_MOE_MLP", "VIBEQWEN_MOE_MLP_MIN_PAIRS", "VIBEQWEN_MOE_MLP_CTA",
                 "VIBEQWEN_MOE_MLP_EARLY_SCALES", "VIBEQWEN_MOE_MLP_GROUP", "VIBEQWEN_MOE_MLP_PREFETCH"):
        monkeypatch.delenv(name, raising=False)
    # the L2 prefetch: the 16-column CTA's unless asked otherwise, and only for the streams it is built for (e4m3,
    # the rule's group)
    streams = [(True, "16", 4), (True, "8", 1), (True, "16", 1), (True, "8", 4), (False, "8", 1), (False, "16", 1)]
    assert [M.mlp_prefetch(*a) for a in streams] == [True, False, False, False, False, False]
    for v, want in (("1", [True, True]), ("8", [False, True]), ("16", [True, False]), ("0", [False, False])):
        monkeypatch.setenv("VIBEQWEN_MOE_MLP_PREFETCH", v)
        assert [M.mlp_prefetch(*a) for a in streams] == want + [False] * 4, v
    for v in ("on", "4", ""):
        monkeypatch.setenv("VIBEQWEN_MOE_MLP_PREFETCH", v)
        with pytest.raises(ValueError, match="VIBEQWEN_MOE_MLP_PREFETCH"):
            M.mlp_prefetch(True, "8", 1)
    monkeypatch.delenv("VIBEQWEN_MOE_MLP_PREFETCH")
    # row tiles a ring step: 4 for the 16-column CTA with the e4m3 scales, else 1, unless the switch asks (e4m3 only)
    assert [M.mlp_group(e, c) for c in ("16", "8") for e in (True, False)] == [4, 1, 1, 1]
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_GROUP", "2")
    assert [M.mlp_group(e, c) for c in ("16", "8") for e in (True, False)] == [2, 1, 2, 1]
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_GROUP", "3")
    with pytest.raises(ValueError, match="VIBEQWEN_MOE_MLP_GROUP"):
        M.mlp_group(True)
    monkeypatch.delenv("VIBEQWEN_MOE_MLP_GROUP")
    assert not M.mlp_early_scales()
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_EARLY_SCALES", "1")
    assert M.mlp_early_scales()
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_EARLY_SCALES", "yes")
    with pytest.raises(ValueError, match="VIBEQWEN_MOE_MLP_EARLY_SCALES"):
        M.mlp_early_scales()
    monkeypatch.delenv("VIBEQWEN_MOE_MLP_EARLY_SCALES")
    assert M.mlp_split(9) == M.mlp_split(9 * 64) == 2
    assert [M.mlp_cta(9 * t) for t in (1, 16, 22, 23, 32, 41, 42, 64)] == ["16"] * 3 + ["8"] * 3 + ["16"] * 2
    assert M.mlp_cta(9 * 3600, 2, 8) == M.mlp_cta(9, 1, 8) == "16"  # odd shapes: no arithmetic error
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_SPLIT", "1")
    assert M.mlp_split(9 * 64) == 1
    assert not M.mlp_wanted(M.MLP_MIN_PAIRS - 1) and M.mlp_wanted(M.MLP_MIN_PAIRS)
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_MIN_PAIRS", "9")
    assert M.mlp_wanted(9)
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_MIN_PAIRS", "abc")
    with pytest.raises(ValueError, match="VIBEQWEN_MOE_MLP_MIN_PAIRS"):
        M.mlp_wanted(9)
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_SPLIT", "4")
    with pytest.raises(ValueError, match="VIBEQWEN_MOE_MLP_SPLIT"):
        M.mlp_split(9)
    monkeypatch.setenv("VIBEQWEN_MOE_MLP", "0")
    assert not M.mlp_wanted(9 * 64)
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_CTA", "8")
    assert M.mlp_cta(9 * 64) == "8"
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_CTA", "4")
    with pytest.raises(ValueError, match="VIBEQWEN_MOE_MLP_CTA"):
        M.mlp_cta(9)


def _mlp_weights(e_count: int = 2):
    """Small-count full-size shuffled experts (codes and scales zero: the checks read only shapes and dtypes)."""
    w13 = M.MMAWeights(torch.zeros(e_count, 2 * I_REAL // 16, H_REAL // 64, 32, 16, dtype=torch.uint8),
                       torch.zeros(e_count, 2 * I_REAL // 16, H_REAL // 64, 64, dtype=torch.bfloat16), 2 * I_REAL,
                       H_REAL, True)
    w2 = M.MMAWeights(torch.zeros(e_count, H_REAL // 16, I_REAL // 64, 32, 16, dtype=torch.uint8),
                      torch.zeros(e_count, H_REAL // 16, I_REAL // 64, 64, dtype=torch.bfloat16), H_REAL, I_REAL)
    return w13, w2


def test_moe_mlp_rejects_bad_inputs():
    """ValueError on every machine, before any launch: the split, the weights' shapes and interleaving, the output."""
    w13, w2 = _mlp_weights()
    n_pairs = 9
    x = torch.zeros(1, H_REAL, dtype=torch.bfloat16)
    gs13, gs2 = torch.ones(2, 2 * I_REAL), torch.ones(2, H_REAL)
    sorted_ids, bexp = _blocks([0] * 8 + [1], 2)
    out = torch.zeros(1, n_pairs, H_REAL)

    def call(**kw):
        a = dict(x=x, x_row_div=9, w13=w13, gs13=gs13, w2=w2, gs2=gs2, sorted_ids=sorted_ids, block_expert=bexp,
                 n_pairs=n_pairs, split=1, out=out)
        a.update(kw)
        return M.moe_mlp(**a)

    for kw, match in (
        (dict(split=3), "split must be 1 or 2"),
        (dict(split=True), "split must be 1 or 2"),
        (dict(w13=M.MMAWeights(w13.codes, w13.scales, w13.n, w13.k, False)), "interleaved gate|up"),
        (dict(w13=w2), "interleaved gate|up"),
        (dict(w2=w13), "the down weight"),
        (dict(out=torch.zeros(2, n_pairs, H_REAL)), "out must be a contiguous float32"),
        (dict(out=torch.zeros(1, n_pairs, H_REAL, dtype=torch.bfloat16)), "out must be a contiguous float32"),
        (dict(gs2=torch.ones(2, 2 * I_REAL)), "gs2 must be float32"),
        (dict(gs13=None), "gs13 must be a tensor"),
        (dict(x=torch.zeros(1, H_REAL)), "x must be bf16"),
        (dict(x_row_div=1), "x must hold"),
        (dict(sorted_ids=sorted_ids.long()), "sorted_ids must be"),
        (dict(n_pairs=9.0), "n_pairs must be"),
        (dict(split=1.0), "split must be 1 or 2"),
        (dict(w2=M.MMAWeights(w2.codes[:, :-1], w2.scales, w2.n, w2.k)), "w2 is not a shuffle_mma_weights"),
        (dict(w2=M.MMAWeights(w2.codes, w2.scales.float(), w2.n, w2.k)), "w2 is not a shuffle_mma_weights"),
        (dict(w2=M.MMAWeights(w2.codes[:1], w2.scales[:1], w2.n, w2.k)), "experts"),
        (dict(out=torch.zeros(1, 1, H_REAL).expand(1, n_pairs, H_REAL)), "out must be a contiguous"),
        (dict(out=None), "out must be a tensor"),
        (dict(gs2=None), "gs2 must be a tensor"),
        (dict(x_row_div=2**32 + 1), "x_row_div"),
        (dict(block_expert=bexp[:0]), "block_expert must hold a block"),
        (dict(x=torch.zeros(2, H_REAL, dtype=torch.bfloat16)[:, :8].as_strided((2, H_REAL), (8, 1))), "row stride"),
    ):
        with pytest.raises(ValueError, match=match):
            call(**kw)
    # an e4m3 copy of the scales the launch would read: its dtype, shape and layout
    ok13 = torch.zeros(w13.scales.shape, dtype=torch.uint8)
    ok2 = torch.zeros(w2.scales.shape, dtype=torch.uint8)
    for bad in (ok2, ok13.float(), ok13.transpose(-1, -2).contiguous().transpose(-1, -2)[..., :64]):
        with pytest.raises(ValueError, match="scales_e4m3 must be"):
            call(w13=dataclasses.replace(w13, scales_e4m3=bad), w2=dataclasses.replace(w2, scales_e4m3=ok2))


def _mlp_pair_ids(case: str, gen: torch.Generator) -> list[int]:
    """Expert ids of the pairs: 'mixed' (a block with both n8 halves, an expert over two blocks, the shared expert,
    random others), 'decode32' (32 tokens' top-8 + shared slot, as the model routes), 'one' (a single pair)."""
    if case == "one":
        return [17]
    if case == "decode32":
        ids = []
        for _ in range(32):
            ids += [int(v) for v in torch.randperm(E_REAL, generator=gen)[:K_REAL]] + [E_REAL]
        return ids
    rand = [int(v) for v in torch.randint(0, E_REAL + 1, (40,), generator=gen)]
    return [5, 256, 5, 7, 5] + [9] * 17 + [3] * 12 + rand


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize(("early", "scales", "group"),
                         [("1", "bf16", "1"), ("0", "bf16", "1"), ("0", "e4m3", "1"), ("0", "e4m3", "2"),
                          ("0", "e4m3", "4"), ("0", "e4m3", "prefetch")])
@pytest.mark.parametrize("cta", list(M.MLP_CTAS))
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("case", ["mixed", "decode32", "one"])
def test_gpu_mlp_same_sums_as_two_launches(split, case, cta, early, scales, group, mma_experts, monkeypatch):
    """moe_mlp's partials = the SiLU gate|up launch (unsplit) followed by the down launch in `split` K splits, bit for
    bit: the same products in the same order (x rows per pair through x_row_div 9, as the model passes them), with
    the global scales requested early or where they are used (the default), streaming the e4m3 block scales
    (converted in the kernel to the same bf16 words), and with ring steps of 1, 2 or 4 row tiles; "prefetch": the
    rule's group with each next ring step prefetched into L2 (VIBEQWEN_MOE_MLP_PREFETCH)."""
    weights = mma_experts[0]
    prefetch = group == "prefetch"
    if prefetch:
        group = "4" if cta == "16" else "1"
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_PREFETCH", "1" if prefetch else "0")
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_CTA", cta)
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_EARLY_SCALES", early)
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_GROUP", group)
    # unset streams the e4m3 copy where the loader kept one (the default): bf16 asks for the bf16 scales
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_E4M3", "0" if scales == "bf16" else "1")
    w13, w2 = weights.w13_mma, weights.w2_mma
    if scales == "e4m3":  # the bf16 scales NaN: a launch that read them instead would not match
        w13, w2 = (dataclasses.replace(
            w, scales=torch.full_like(w.scales, float("nan")),
            scales_e4m3=(w.scales.float() / M.SCALE_BIAS).to(torch.float8_e4m3fn).view(torch.uint8)) for w in (w13, w2))
        assert M.mlp_e4m3(w13, w2, False)
    assert M.mlp_group(scales == "e4m3", cta) == int(group)
    assert M.mlp_prefetch(scales == "e4m3", cta, int(group)) == prefetch
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(7 + split)
    ids = _mlp_pair_ids(case, gen)
    n_pairs = len(ids)
    sorted_ids, bexp = (v.to(dev) for v in _blocks(ids, E_REAL + 1))
    x = torch.randn((n_pairs + 8) // 9, H_REAL, device=dev).to(torch.bfloat16)
    h = torch.full((1, n_pairs, I_REAL), float("nan"), device=dev, dtype=torch.bfloat16)
    M.moe_mma(x, 9, weights.w13_mma, weights.w13_gscale, sorted_ids, bexp, n_pairs, 1, h, silu=True)
    want = torch.full((split, n_pairs, H_REAL), float("nan"), device=dev)
    M.moe_mma(h[0], 1, weights.w2_mma, weights.w2_gscale, sorted_ids, bexp, n_pairs, split, want)
    got = torch.full_like(want, float("nan"))
    M.moe_mlp(x, 9, w13, weights.w13_gscale, w2, weights.w2_gscale, sorted_ids, bexp, n_pairs, split, got)
    assert bool(torch.isfinite(want).all())
    assert torch.equal(got, want)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("cta", list(M.MLP_CTAS))
def test_gpu_mlp_e4m3_copy_from_the_loader(cta, monkeypatch):
    """prepack_moe_nvfp4 by default keeps the e4m3 copy, and moe_mlp streaming it equals moe_mlp
    with the bf16 scales (VIBEQWEN_MOE_MLP_E4M3=0) bit for bit, with zero and subnormal block scales among them (the
    hardware cvt on the values the CPU test mirrors)."""
    if M.mma_library(torch.device("cuda")) is None:
        pytest.skip("the CUDA MoE kernel could not be built here")
    monkeypatch.setenv("VIBEQWEN_MOE_MLP_CTA", cta)
    monkeypatch.delenv("VIBEQWEN_MOE_MLP_EARLY_SCALES", raising=False)
    dev = torch.device("cuda")
    torch.manual_seed(5)
    n_exp, trip = 3, []
    for n, k in ((I_REAL, H_REAL), (I_REAL, H_REAL), (H_REAL, I_REAL)):
        w = torch.randn(n_exp, n, k, device=dev) / k**0.5
        w[1, :, :64] *= 1e-5  # subnormal e4m3 scales
        p, s, g = nvfp4_quantize(w)
        s = s.view(torch.uint8).clone()
        s[2, :7, 1] = 0  # zero scales (the quantizer makes none)
        trip.append([(p[e], s[e].view(torch.float8_e4m3fn), g[e]) for e in range(n_exp)])
    monkeypatch.delenv("VIBEQWEN_MOE_MLP_E4M3", raising=False)
    weights = F.prepack_moe_nvfp4(*trip, device=dev, mma=True)
    assert weights.w13_mma.scales_e4m3 is not None and weights.w2_mma.scales_e4m3 is not None
    gen = torch.Generator().manual_seed(3)
    ids = [int(v) for v in torch.randint(0, n_exp, (60,), generator=gen)]
    n_pairs = len(ids)
    sorted_ids, bexp = (v.to(dev) for v in _blocks(ids, n_exp))
    x = torch.randn((n_pairs + 8) // 9, H_REAL, device=dev).to(torch.bfloat16)
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("VIBEQWEN_MOE_MLP_E4M3", flag)
        out = torch.full((2, n_pairs, H_REAL), float("nan"), device=dev)
        M.moe_mlp(x, 9, weights.w13_mma, weights.w13_gscale, weights.w2_mma, weights.w2_gscale, sorted_ids, bexp,
                  n_pairs, 2, out)
        outs.append(out)
    assert bool(torch.isfinite(outs[1]).all())
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [16, 32, 64])
def test_gpu_mlp_fused_moe(t, mma_experts, monkeypatch):
    """fused_moe at decode-sized T runs moe_mlp (no moe_mma launch): equal bit for bit to the two launches with its
    splits (SPLIT_K1 1, SPLIT_K2 = mlp_split), within 5e-3 of the fp32 reference; a CUDA-graph replay on new inputs
    equals the eager call."""
    weights, wg, wu, wd = mma_experts
    from vibeqwen_kernels.moe.naive import moe_experts_ref

    monkeypatch.delenv("VIBEQWEN_MOE_MLP", raising=False)
    monkeypatch.delenv("VIBEQWEN_MOE_MLP_SPLIT", raising=False)
    dev = torch.device("cuda")
    x = torch.randn(t, H_REAL, device=dev).to(torch.bfloat16)
    tw, ti = F.fused_router(torch.randn(t, E_REAL + 1, device=dev).to(torch.bfloat16), K_REAL)
    cfg = dict(F.default_moe_config(t), BLOCK_M=16, GEMV=0, SPLIT_GU=0, MMA=1, SPLIT_K1=2, SPLIT_K2=1)
    launches, mlps = [], []
    launch, mlp = M.moe_mma, M.moe_mlp
    monkeypatch.setattr(M, "moe_mma", lambda *a, **k: launches.append(1) or launch(*a, **k))
    monkeypatch.setattr(M, "moe_mlp", lambda *a, **k: mlps.append(a[9]) or mlp(*a, **k))
    y = F.fused_moe(x, tw, ti, weights, cfg)
    assert launches == [] and mlps == [M.mlp_split(t * (K_REAL + 1))]
    split = M.mlp_split(t * (K_REAL + 1))
    monkeypatch.setenv("VIBEQWEN_MOE_MLP", "0")
    y2 = F.fused_moe(x, tw, ti, weights, dict(cfg, SPLIT_K1=1, SPLIT_K2=split))
    assert len(launches) == 2
    assert torch.equal(y, y2)
    ref = moe_experts_ref(x.float(), tw.float(), ti.long(), wg, wu, wd)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 5e-3
    monkeypatch.delenv("VIBEQWEN_MOE_MLP")
    _check_graph_replay(weights, t, cfg)


@pytest.mark.gpu
@requires_gpu
def test_gpu_mlp_not_below_its_bound(mma_experts, monkeypatch):
    """Below MLP_MIN_PAIRS pairs (8 tokens) fused_moe keeps the gate|up and down launches."""
    monkeypatch.delenv("VIBEQWEN_MOE_MLP", raising=False)
    monkeypatch.delenv("VIBEQWEN_MOE_MLP_MIN_PAIRS", raising=False)
    t = 8
    assert t * (K_REAL + 1) < M.MLP_MIN_PAIRS
    dev = torch.device("cuda")
    x = torch.randn(t, H_REAL, device=dev).to(torch.bfloat16)
    tw, ti = F.fused_router(torch.randn(t, E_REAL + 1, device=dev).to(torch.bfloat16), K_REAL)
    calls = []
    launch, mlp = M.moe_mma, M.moe_mlp
    monkeypatch.setattr(M, "moe_mma", lambda *a, **k: calls.append("mma") or launch(*a, **k))
    monkeypatch.setattr(M, "moe_mlp", lambda *a, **k: calls.append("mlp") or mlp(*a, **k))
    F.fused_moe(x, tw, ti, mma_experts[0], dict(F.default_moe_config(t), BLOCK_M=16, GEMV=0, SPLIT_GU=0, MMA=1))
    assert calls == ["mma", "mma"]

