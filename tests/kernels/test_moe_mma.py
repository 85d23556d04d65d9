"""The CUDA decode MoE kernel (csrc/moe_mma.cu, kernels/moe/mma_cuda.py).

CPU: the weight shuffle, read back lane by lane as the kernel reads it (``moe_mma_emulated``), equals the
dense dequantized weights; configs with MMA = 1 fall back when the kernel cannot run.
GPU: the kernel's raw sums against the emulation, and ``fused_moe`` with MMA configs against the fp32
reference at the model's shapes for decode-sized T, on fresh random inputs.
"""

from __future__ import annotations

import pytest
import torch
from vibeqwen_kernels.moe import fused as F
from vibeqwen_kernels.moe import mma_cuda as M

from vibeqwen.checkpoint.quant import nvfp4_dequantize, nvfp4_quantize

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _blocks(ids: list[int], n_exp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align's output for block_m 16, built on the host: (sorted pair ids, block experts)."""
    n = len(ids)
    sorted_ids, bexp = [], []
    for e in range(n_exp):
        group = [p for p, i in enumerate(ids) if i == e]
        while group:
            chunk, group = group[:16], group[16:]
            sorted_ids += chunk + [n] * (16 - len(chunk))
            bexp.append(e)
    bexp.append(-1)  # a trailing empty block, as moe_align leaves them
    sorted_ids += [n] * 16
    return torch.tensor(sorted_ids, dtype=torch.int32), torch.tensor(bexp, dtype=torch.int32)


@pytest.mark.parametrize("repacked", [True, False])
def test_shuffle_reads_back_the_dense_weights(repacked):
    torch.manual_seed(0)
    n_exp, n, k = 3, 32, 512
    w = torch.randn(n_exp, n, k) / k**0.5
    w[1, :, :64] *= 1e-4  # small blocks: subnormal e4m3 scales
    p, s, g = nvfp4_quantize(w)
    dense = nvfp4_dequantize(p, s, torch.ones_like(g), dtype=torch.float32)  # without the global scale
    packed = F._to_kernel_order(p) if repacked else p
    mw = M.shuffle_mma_weights(packed, s, repacked)
    assert mw.codes.shape == (n_exp, n // 16, k // 64, 32, 16) and mw.scales.shape == (n_exp, n // 16, k // 64, 64)
    ids = [2, 0, 2, 1, 2, 2]  # 6 pairs, x row = pair // 2 (k' = 2)
    x = torch.randn(3, k)
    sorted_ids, bexp = _blocks(ids, n_exp)
    for split in (1, 2):
        out = torch.full((split, len(ids), n), float("nan"))
        M.moe_mma_emulated(x, 2, mw, None, sorted_ids, bexp, len(ids), split, out)
        total = out.sum(0)
        for pair, e in enumerate(ids):
            torch.testing.assert_close(total[pair], dense[e] @ x[pair // 2], rtol=1e-4, atol=1e-4 * dense[e].abs().max().item())


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
    with pytest.raises(RuntimeError, match="not available"):
        call()


def test_split_ok():
    assert M.split_ok(2048, 1) and M.split_ok(2048, 8) and M.split_ok(512, 2)
    assert not M.split_ok(512, 4) and not M.split_ok(2048, 3) and not M.split_ok(2048, 0)
    assert not M.split_ok(16384, 2) and M.split_ok(16384, 4)  # the x tile must fit in shared memory


def test_mma_config_checks():
    cfg = dict(F.default_moe_config(1), MMA=1, GEMV=0, BLOCK_M=32)
    with pytest.raises(ValueError, match="MMA = 1 needs BLOCK_M"):
        F._check_config(cfg, use_asm=False)
    with pytest.raises(ValueError, match="MMA must be 0 or 1"):
        F._check_config(dict(cfg, BLOCK_M=16, MMA=2), use_asm=False)


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
    weights, wg, wu, wd = mma_experts
    from vibeqwen_kernels.moe.naive import moe_experts_ref

    dev = torch.device("cuda")
    x = torch.randn(t, H_REAL, device=dev).to(torch.bfloat16)
    tw, ti = F.fused_router(torch.randn(t, E_REAL + 1, device=dev).to(torch.bfloat16), K_REAL)
    cfg = dict(F.default_moe_config(t), BLOCK_M=16, GEMV=0, SPLIT_GU=0, MMA=1, SPLIT_K1=splits[0],
               SPLIT_K2=splits[1])
    out = torch.full((t, H_REAL), float("nan"), device=dev, dtype=torch.bfloat16)
    calls = []
    launch = M.moe_mma
    monkeypatch.setattr(M, "moe_mma", lambda *a, **k: calls.append(1) or launch(*a, **k))
    y = F.fused_moe(x, tw, ti, weights, cfg, out=out)
    assert len(calls) == 2  # both GEMMs in the CUDA kernel, no silent fallback
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
    weights = mma_experts[0]
    dev = torch.device("cuda")
    t = 4
    cfg = dict(F.default_moe_config(t), BLOCK_M=16, GEMV=0, SPLIT_GU=0, MMA=1, SPLIT_K1=4, SPLIT_K2=1)
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
    if M.mma_library(torch.device("cuda")) is None:
        pytest.skip("the CUDA MoE kernel could not be built here")
    torch.manual_seed(3)
    dev = torch.device("cuda")
    n_exp, n, k, split = 3, 48, 512, 2
    p, s, g = nvfp4_quantize(torch.randn(n_exp, n, k, device=dev) / k**0.5)
    w = M.shuffle_mma_weights(p, s, repacked=False)
    dense = nvfp4_dequantize(p, s, torch.ones_like(g), dtype=torch.float32)
    ids = [int(v) for v in torch.randint(0, n_exp, (40,))]
    sorted_ids, bexp = _blocks(ids, n_exp)
    x = torch.randn(len(ids), k, device=dev).to(torch.bfloat16)
    out = torch.full((split, len(ids), n), float("nan"), device=dev)
    M.moe_mma(x, 1, w, None, sorted_ids.to(dev), bexp.to(dev), len(ids), split, out)
    total = out.sum(0) * 512.0
    for pair, e in enumerate(ids):
        want = dense[e] @ x[pair].float()
        torch.testing.assert_close(total[pair], want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
