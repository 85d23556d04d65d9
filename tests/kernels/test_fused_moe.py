"""Fused NVFP4 MoE (router, moe_align, grouped SwiGLU GEMMs) against the PyTorch references.

Reference: ``route_topk_ref`` + ``moe_experts_ref`` on the dequantized experts + the shared expert
``swiglu_mlp_ref(x) * sigmoid(gate_logit)``, all in float32.

Tolerance (GPU, bf16). The weights widen to bf16 exactly and every product accumulates in fp32, so the
differences from the fp32 reference are three roundings to bf16 (unit roundoff u = 2^-9): x itself is
given in bf16 (both sides use it), h = silu(g) * u is stored in bf16 (its error passes through W_down
as noise of relative size ~u/sqrt(3)), each pair's weighted output is stored in bf16 before the fp32
sum over the 9 slots (~u/sqrt(3) of each term), and the final sum is rounded to bf16 (<= u relative).
Together ~1.5e-3 relative in the Frobenius norm (the interpreter's fp16 run, u = 2^-11, shows 3.4e-4,
i.e. 1.4e-3 scaled to bf16). We assert
    ||y - ref|| / ||ref|| <= 5e-3   and   |y - ref| <= 1e-2 * |ref| + 1.5e-2 * rms(ref)   elementwise
(the absolute term is ~7 standard deviations of the noise, for outputs near zero after cancellation).
The router is fp32 throughout: its weights match to 1e-6 and its expert ids exactly (random logits have
no ties). Outputs are poisoned with NaN first where the API allows, so an unwritten element fails.
Interpreter runs (fp32 activations) differ from the fp32 reference by summation order only (< 1e-5);
fp16 activations round h and the pair outputs to fp16 (< 2e-3).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from vibeqwen_kernels.moe import fused as F
from vibeqwen_kernels.moe.naive import moe_experts_ref, route_topk_ref, swiglu_mlp_ref

from vibeqwen.checkpoint.quant import nvfp4_dequantize, nvfp4_quantize

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_gpu = pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA GPU"
)

REL_FRO = 5e-3
RTOL = 1e-2
ATOL_RMS = 1.5e-2


def _triton_version() -> tuple[int, int]:
    import triton

    return tuple(int(v) for v in triton.__version__.split(".")[:2])


# The subprocess imports this file's helpers (and torch, F, the references) by path.
_PRELUDE = textwrap.dedent(
    f"""
    import importlib.util
    _spec = importlib.util.spec_from_file_location("_moe_test_helpers", {os.path.abspath(__file__)!r})
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    globals().update({{k: v for k, v in vars(_mod).items() if not k.startswith("__")}})
    """
)


def _run_interpreted(scripts: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Run each script (with this file's helpers in scope) in one subprocess under Triton's interpreter
    (TRITON_INTERPRET must be set before triton is imported). Returns name -> ("ok" | "fail", output)."""
    if not HAS_TRITON:
        pytest.skip("needs triton")
    if _triton_version() < (3, 9):
        pytest.skip("the interpreter tests need triton >= 3.9 (see test_nvfp4_linear.py)")
    runner = _PRELUDE + textwrap.dedent(
        f"""
        import contextlib, io, json, traceback
        _results = {{}}
        for _name, _src in json.loads({json.dumps(json.dumps(scripts))}).items():
            _buf = io.StringIO()
            try:
                with contextlib.redirect_stdout(_buf):
                    exec(_src, dict(globals()))
                _results[_name] = ("ok", _buf.getvalue())
            except BaseException:
                _results[_name] = ("fail", _buf.getvalue() + traceback.format_exc())
        print("@@RESULTS@@" + json.dumps(_results))
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-c", runner], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert res.returncode == 0, res.stderr[-4000:]
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("@@RESULTS@@")][-1]
    return {k: tuple(v) for k, v in json.loads(line[len("@@RESULTS@@") :]).items()}


# Helpers, also imported by the interpreter subprocesses (from this file, by path).
def make_experts(n_exp, h, i, device, repack=True):
    """(MoEWeights, dense fp32 gate [E', I, H], up, down [E', H, I]) for random NVFP4 experts."""
    trip = []
    dense = []
    for n, k in ((i, h), (i, h), (h, i)):
        w = torch.randn(n_exp, n, k, device=device) / k**0.5
        p, s, g = nvfp4_quantize(w)  # one global scale per expert matrix
        trip.append([(p[e], s[e], g[e]) for e in range(n_exp)])
        dense.append(nvfp4_dequantize(p, s, g, dtype=torch.float32))
    return F.prepack_moe_nvfp4(*trip, device=device, repack=repack), *dense


def moe_ref(x, logits, top_k, wg, wu, wd):
    """fp32 reference: routed experts (route_topk_ref) + sigmoid-gated shared expert (number E)."""
    e = logits.shape[1] - 1
    xf = x.float()
    rw, ri = route_topk_ref(logits[:, :e], top_k)
    routed = moe_experts_ref(xf, rw, ri, wg[:e], wu[:e], wd[:e])
    shared = swiglu_mlp_ref(xf, wg[e], wu[e], wd[e]) * torch.sigmoid(logits[:, e:].float())
    return routed + shared


def moe_ref_routed(x, tw, ti, wg, wu, wd):
    """fp32 reference for a given routing: sum_s tw[t, s] * expert_{ti[t, s]}(x[t]) (shared = expert E)."""
    return moe_experts_ref(x.float(), tw.float(), ti.long(), wg, wu, wd)


def check_router(logits, top_k, tw, ti):
    """fused_router's output against route_topk_ref, robust to ties (bf16 logits repeat values): the
    chosen ids are distinct and carry the k largest probabilities; weights and shared column match."""
    e = logits.shape[1] - 1
    probs = torch.softmax(logits[:, :e].float(), dim=-1)
    rw, _ = route_topk_ref(logits[:, :e], top_k)
    ids = ti[:, :top_k].long()
    assert ((ids >= 0) & (ids < e)).all() and (ti[:, top_k] == e).all()
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all(), "repeated expert in one token"
    top = torch.topk(probs, top_k, dim=-1).values
    torch.testing.assert_close(probs.gather(1, ids), top, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(tw[:, :top_k], rw, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tw[:, top_k], torch.sigmoid(logits[:, e].float()), rtol=1e-5, atol=1e-6)


def rel(y, ref):
    assert torch.isfinite(y).all(), "non-finite or unwritten output"
    return ((y.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_align(ids, n_exp, bm, sorted_ids, bexp, npad):
    """moe_align's invariants against a direct count."""
    ids = ids.reshape(-1).long().cpu()
    sorted_ids, bexp, npad = sorted_ids.cpu().long(), bexp.cpu().long(), int(npad.item())
    n = ids.numel()
    p_max, b_max = F.align_bounds(n, n_exp, bm)
    assert sorted_ids.numel() == p_max and bexp.numel() == b_max
    counts = torch.bincount(ids, minlength=n_exp)
    padded = (counts + bm - 1) // bm * bm
    assert npad == int(padded.sum()) and npad % bm == 0 and npad <= p_max
    start = 0
    for e in range(n_exp):
        seg = sorted_ids[start : start + int(padded[e])]
        real = seg[: int(counts[e])]
        assert real.tolist() == torch.nonzero(ids == e).flatten().tolist(), e  # pair order
        assert (seg[int(counts[e]) :] == n).all(), e
        assert (bexp[start // bm : (start + int(padded[e])) // bm] == e).all(), e
        start += int(padded[e])
    assert (sorted_ids[npad:] == n).all()
    assert (bexp[npad // bm :] == -1).all()


_SCRIPTS = {
    "router_align": """
        torch.manual_seed(0)
        for t, e, k, dt in [(1, 8, 2, torch.float32), (5, 8, 2, torch.float16), (33, 20, 4, torch.float32)]:
            logits = torch.randn(t, e + 1).to(dt)
            w, ids = F.fused_router(logits, k)
            assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == (t, k + 1)
            check_router(logits, k, w, ids)
            rw, ri = route_topk_ref(logits[:, :e], k)
            if dt == torch.float32:  # no ties: the same ids in the same order
                assert torch.equal(ids[:, :k].long(), ri), (ids, ri)
            torch.testing.assert_close(w[:, :k], rw, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(w[:, k], torch.sigmoid(logits[:, e].float()), rtol=1e-6, atol=1e-6)
            assert (ids[:, k] == e).all()
        logits = torch.randn(3, 8)
        w, ids = F.fused_router(logits, 3, shared=False)
        rw, ri = route_topk_ref(logits, 3)
        assert w.shape == (3, 3) and torch.equal(ids.long(), ri)
        torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-6)
        # align: random ids, a skewed distribution (empty experts), counts that are multiples of bm
        for t, kp, n_exp, bm in [(37, 3, 9, 16), (20, 4, 40, 32), (16, 1, 5, 16), (1, 9, 257, 16)]:
            ids = torch.randint(0, n_exp, (t, kp), dtype=torch.int32)
            check_align(ids, n_exp, bm, *F.moe_align(ids, n_exp, bm))
        ids = torch.randint(0, 3, (50, 2), dtype=torch.int32) * 2
        check_align(ids, 7, 16, *F.moe_align(ids, 7, 16))
        ids = torch.zeros(16, 2, dtype=torch.int32)
        check_align(ids, 4, 16, *F.moe_align(ids, 4, 16))
        # both align paths: the all-to-all kernel up to 128 pairs (decode shapes, one expert for all,
        # the last expert only) and the chunked one past it (one chunk, a partial chunk, whole chunks, more
        # chunks than one scan tile of 16)
        for t, kp, n_exp, bm in [(8, 9, 257, 16), (14, 9, 257, 16), (15, 9, 257, 16), (3, 9, 257, 64),
                                 (128, 2, 257, 16), (300, 9, 257, 64), (256, 8, 256, 32)]:
            ids = torch.randint(0, n_exp, (t, kp), dtype=torch.int32)
            check_align(ids, n_exp, bm, *F.moe_align(ids, n_exp, bm))
        for ids in (torch.zeros(60, 2, dtype=torch.int32), torch.full((7, 9), 256, dtype=torch.int32),
                    torch.zeros(100, 2, dtype=torch.int32), torch.full((40, 9), 256, dtype=torch.int32)):
            check_align(ids, 257, 16, *F.moe_align(ids, 257, 16))
        print("ok")
""",
    "fused_moe": """
        torch.manual_seed(0)
        E, K = 8, 2
        W, wg, wu, wd = make_experts(E + 1, 64, 32, "cpu")
        cfg_even = dict(BLOCK_M=16, BLOCK_N1=32, BLOCK_K1=64, WARPS1=1, STAGES1=1,
                        BLOCK_N2=64, BLOCK_K2=32, WARPS2=1, STAGES2=1)
        worst32 = worst16 = 0.0
        for t, dt, cfg in [(1, torch.float32, None), (5, torch.float16, cfg_even), (33, torch.float32, cfg_even)]:
            x = torch.randn(t, 64).to(dt)
            logits = torch.randn(t, E + 1)
            tw, ti = F.fused_router(logits, K)
            y = F.fused_moe(x, tw, ti, W, cfg, out=torch.full((t, 64), float("nan"), dtype=dt))
            assert y.dtype == dt and y.shape == (t, 64)
            r = rel(y, moe_ref(x, logits, K, wg, wu, wd))
            if dt == torch.float32:
                worst32 = max(worst32, r)
            else:
                worst16 = max(worst16, r)
        # ragged shapes (H = 80, I = 48: masked K and N tails), BLOCK_M = 32, checkpoint nibble order
        W, wg, wu, wd = make_experts(E + 1, 80, 48, "cpu", repack=False)
        cfg = dict(BLOCK_M=32, BLOCK_N1=32, BLOCK_K1=32, WARPS1=1, STAGES1=1,
                   BLOCK_N2=32, BLOCK_K2=32, WARPS2=1, STAGES2=1)
        x = torch.randn(13, 80)
        logits = torch.randn(13, E + 1)
        tw, ti = F.fused_router(logits, K)
        worst32 = max(worst32, rel(F.fused_moe(x, tw, ti, W, cfg), moe_ref(x, logits, K, wg, wu, wd)))
        # a config for the CUDA kernel (MMA = 1) where it cannot run (no shuffled copy, no GPU): the fallback
        # config runs, here the default one
        assert W.w13_mma is None
        cfg_mma = dict(F.default_moe_config(13), BLOCK_M=16, GEMV=0, SPLIT_GU=0, MMA=1, SPLIT_K1=2, SPLIT_K2=1)
        assert torch.equal(F.fused_moe(x, tw, ti, W, cfg_mma), F.fused_moe(x, tw, ti, W))
        print(worst32, worst16)
""",
    "split_k": """
        torch.manual_seed(2)
        E, K = 8, 2
        W, wg, wu, wd = make_experts(E + 1, 64, 32, "cpu")
        base = dict(BLOCK_M=16, BLOCK_N1=32, BLOCK_K1=16, WARPS1=1, STAGES1=1,
                    BLOCK_N2=32, BLOCK_K2=16, WARPS2=1, STAGES2=1)
        worst32 = worst16 = 0.0
        # H = 64 = 4 K blocks of 16 for GEMM1, I = 32 = 2 blocks for GEMM2: even splits, uneven ones
        # (3 splits of 4 blocks: 2 + 2 + 0) and splits past the end (empty programs write zeros)
        for t, dt, s1, s2, bk1 in [(1, torch.float32, 2, 2, 32), (1, torch.float32, 8, 4, 16),
                                   (5, torch.float16, 3, 2, 16), (5, torch.float32, 4, 3, 16),
                                   (33, torch.float32, 2, 1, 16), (33, torch.float16, 1, 2, 16)]:
            cfg = dict(base, BLOCK_K1=bk1, SPLIT_K1=s1, SPLIT_K2=s2)
            x = torch.randn(t, 64).to(dt)
            logits = torch.randn(t, E + 1)
            tw, ti = F.fused_router(logits, K)
            y = F.fused_moe(x, tw, ti, W, cfg, out=torch.full((t, 64), float("nan"), dtype=dt))
            assert y.dtype == dt and y.shape == (t, 64)
            r = rel(y, moe_ref(x, logits, K, wg, wu, wd))
            if dt == torch.float32:
                worst32 = max(worst32, r)
                # the split changes only the fp32 summation order
                y1 = F.fused_moe(x, tw, ti, W, base)
                assert (y - y1).abs().max().item() <= 1e-5 * y1.abs().max().item(), (t, s1, s2)
            else:
                worst16 = max(worst16, r)
        # ragged shapes: H = 80 (5 groups of 16; BLOCK_K1 = 32 -> blocks of 2, 2, 1 groups: split 2 ends
        # in a partial block), I = 48 (3 blocks of 16 in 2 splits: 2 + 1), masked N tails, BLOCK_M = 32,
        # checkpoint nibble order, pairs past one finishing block (13 * 3 = 39 > 16)
        W, wg, wu, wd = make_experts(E + 1, 80, 48, "cpu", repack=False)
        cfg = dict(base, BLOCK_M=32, BLOCK_K1=32, SPLIT_K1=2, SPLIT_K2=2)
        x = torch.randn(13, 80)
        logits = torch.randn(13, E + 1)
        tw, ti = F.fused_router(logits, K)
        worst32 = max(worst32, rel(F.fused_moe(x, tw, ti, W, cfg), moe_ref(x, logits, K, wg, wu, wd)))
        print(worst32, worst16)
""",
    "gemv": """
        torch.manual_seed(3)
        E, K = 8, 2
        base = dict(BLOCK_M=16, BLOCK_N1=16, BLOCK_K1=32, WARPS1=1, STAGES1=1,
                    BLOCK_N2=32, BLOCK_K2=16, WARPS2=1, STAGES2=1, GEMV=1)
        worst32 = worst16 = 0.0
        # H = 64, I = 32 (repacked nibbles), then H = 80, I = 48 (checkpoint order): N tails (BLOCK_N past
        # I / H: clamped rows), K tails without EVEN_K, even, uneven and empty K splits
        for hh, ii, repack in [(64, 32, True), (80, 48, False)]:
            W, wg, wu, wd = make_experts(E + 1, hh, ii, "cpu", repack=repack)
            for t, dt, s1, s2, bn1 in [(1, torch.float32, 1, 1, 16), (1, torch.float32, 2, 2, 32),
                                       (3, torch.float16, 3, 2, 16), (5, torch.float32, 4, 3, 64)]:
                cfg = dict(base, BLOCK_N1=bn1, SPLIT_K1=s1, SPLIT_K2=s2)
                x = torch.randn(t, hh).to(dt)
                logits = torch.randn(t, E + 1)
                tw, ti = F.fused_router(logits, K)
                y = F.fused_moe(x, tw, ti, W, cfg, out=torch.full((t, hh), float("nan"), dtype=dt))
                assert y.dtype == dt and y.shape == (t, hh)
                r = rel(y, moe_ref(x, logits, K, wg, wu, wd))
                if dt == torch.float32:
                    worst32 = max(worst32, r)
                    # the tensor-core path on the same inputs, gate/up fused (s1 even) or split across programs
                    # (s1 odd; a 32-row block straddles gate and up when I = 48): only the fp32 summation
                    # order differs
                    gu = s1 % 2
                    mma = dict(base, BLOCK_N1=32, BLOCK_K1=16, GEMV=0, SPLIT_GU=gu, SPLIT_K1=s1)
                    y1 = F.fused_moe(x, tw, ti, W, mma)
                    assert (y - y1).abs().max().item() <= 1e-5 * y1.abs().max().item(), (t, s1, s2, gu)
                else:
                    worst16 = max(worst16, r)
        print(worst32, worst16)
""",
}


@pytest.fixture(scope="module")
def interpreted():
    """Runs every interpreter script in one subprocess (one torch/triton start-up); returns a lookup
    name -> that script's stdout (fails the calling test with the script's traceback)."""
    results = _run_interpreted({k: textwrap.dedent(v) for k, v in _SCRIPTS.items()})

    def get(name: str) -> str:
        status, text = results[name]
        assert status == "ok", text[-4000:]
        return text

    return get


# ------------------------------------------------------------------------------ interpreter (CPU) tests


@pytest.mark.slow
def test_interpreter_router_and_align(interpreted):
    """fused_router vs route_topk_ref (+ shared gate) and moe_align's invariants, in the interpreter."""
    out = interpreted("router_align")
    assert out.strip().splitlines()[-1] == "ok"


def test_interpreter_gemv(interpreted):
    """The CUDA-core decode path (GEMV = 1: one program per pair, no alignment) against the reference and
    the tensor-core path: split and unsplit K, ragged H / I, both nibble orders, fp32 and fp16."""
    out = interpreted("gemv")
    worst32, worst16 = map(float, out.strip().splitlines()[-1].split())
    assert worst32 < 1e-5, worst32
    assert worst16 < 2e-3, worst16


def test_interpreter_split_k(interpreted):
    """Split-K GEMM1 (fp32 partials + finishing kernel) and GEMM2 (partials reduced in the slot sum):
    SPLIT_K1 in {1, 2, 3, 4, 8}, SPLIT_K2 in {1, 2, 3, 4}, even, uneven and empty K splits, partial
    K blocks, T in {1, 5, 13, 33}, fp32 and fp16 activations, against the reference and SPLIT = 1."""
    out = interpreted("split_k")
    worst32, worst16 = map(float, out.strip().splitlines()[-1].split())
    assert worst32 < 1e-5, worst32
    assert worst16 < 2e-3, worst16


def test_interpreter_fused_moe(interpreted):
    """fused_router + fused_moe vs the fp32 reference, T in {1, 5, 33}, fp32 and fp16 activations,
    default and explicit configs (multi-step K, several N blocks, ragged H/I, checkpoint nibble order)."""
    out = interpreted("fused_moe")
    worst32, worst16 = map(float, out.strip().splitlines()[-1].split())
    assert worst32 < 1e-5, worst32
    assert worst16 < 2e-3, worst16


# ------------------------------------------------------------------------------------- CPU-only tests


def test_slot_sum_block(monkeypatch):
    """About two programs an SM at decode sizes (256-column blocks up to 64 tokens of H = 2048), 1024 columns from 132
    tokens, never past H's power of two; the measuring switch and its bad values."""
    monkeypatch.delenv("VIBEQWEN_MOE_SUM_BLOCK", raising=False)
    assert [F.slot_sum_block(t, 2048) for t in (1, 8, 32, 64, 100, 131, 132, 8192)] == [256] * 4 + [512] * 2 + [1024] * 2
    assert F.slot_sum_block(1, 64) == 64 and F.slot_sum_block(1, 8) == 16
    monkeypatch.setenv("VIBEQWEN_MOE_SUM_BLOCK", "1024")
    assert F.slot_sum_block(32, 2048) == 1024 and F.slot_sum_block(32, 64) == 64
    for bad in ("1000", "8", "8192", "x"):
        monkeypatch.setenv("VIBEQWEN_MOE_SUM_BLOCK", bad)
        with pytest.raises(ValueError, match="VIBEQWEN_MOE_SUM_BLOCK"):
            F.slot_sum_block(32, 2048)


def test_prepack_layout():
    """Stacking order (routed then shared, gate rows then up rows), per-row global scales, repack."""
    n_exp, h, i = 3, 32, 16
    trip = [[nvfp4_quantize(torch.randn(n, k)) for _ in range(n_exp)] for n, k in ((i, h), (i, h), (h, i))]
    w = F.prepack_moe_nvfp4(*trip)
    assert (w.num_experts, w.hidden, w.intermediate) == (n_exp, h, i)
    assert w.w13_packed.shape == (n_exp, 2 * i, h // 2) and w.w13_scale.shape == (n_exp, 2 * i, h // 16)
    assert w.w2_packed.shape == (n_exp, h, i // 2) and w.w2_gscale.shape == (n_exp, h)
    gate, up, down = trip
    for e in range(n_exp):
        assert torch.equal(F._unpack_kernel_order(w.w13_packed[e, :i]), gate[e][0])
        assert torch.equal(F._unpack_kernel_order(w.w13_packed[e, i:]), up[e][0])
        assert torch.equal(F._unpack_kernel_order(w.w2_packed[e]), down[e][0])
        assert torch.equal(w.w13_scale[e, i:].view(torch.uint8), up[e][1].view(torch.uint8))
        assert (w.w13_gscale[e, :i] == gate[e][2]).all() and (w.w13_gscale[e, i:] == up[e][2]).all()
        assert (w.w2_gscale[e] == down[e][2]).all()
    w2 = F.prepack_moe_nvfp4(*trip, repack=False)
    assert not w2.repacked and torch.equal(w2.w13_packed[1, :i], gate[1][0])
    # byte 8g+j: k = 16g+j low nibble, 16g+8+j high nibble
    p = gate[0][0]
    assert (w.w13_packed[0, 0, 0] >> 4) == (p[0, 4] & 15)
    with pytest.raises(ValueError, match="same non-zero number"):
        F.prepack_moe_nvfp4(gate, up[:2], down)
    with pytest.raises(ValueError, match="expected"):
        F.prepack_moe_nvfp4(gate, up, [gate[0]] * n_exp)
    with pytest.raises(TypeError):
        F.prepack_moe_nvfp4(gate, up, [(1, 2)] * n_exp)


def test_align_bounds_and_configs(monkeypatch, tmp_path):
    # B_max covers the worst case: every group one pair over a multiple of block_m
    assert F.align_bounds(9, 257, 16) == (10 * 16, 10)
    assert F.align_bounds(64 * 9, 257, 16) == ((36 + 257) * 16, 36 + 257)
    for t in (1, 8, 64, 1024, 8192):
        cfg = F.default_moe_config(t)
        F._check_config(cfg, use_asm=True)
        assert set(cfg) == set(F.CONFIG_KEYS)
    assert F.default_moe_config(1)["BLOCK_M"] == 16 and F.default_moe_config(8192)["BLOCK_M"] == 128
    # decode splits K: (distinct experts x N blocks x split) ~ 6 programs per SM, >= 256 of K per split
    for t in (1, 2, 4, 8, 16, 28):
        cfg = F.default_moe_config(t)
        d = min(257, 9 * t)
        p1 = d * (512 // cfg["BLOCK_N1"]) * cfg["SPLIT_K1"]
        p2 = d * (2048 // cfg["BLOCK_N2"]) * cfg["SPLIT_K2"]
        assert 2048 // cfg["SPLIT_K1"] >= 256 and 512 // cfg["SPLIT_K2"] >= 256
        assert p1 >= 4 * 132 or cfg["SPLIT_K1"] == 8, (t, cfg)
        assert p2 >= 4 * 132 or cfg["SPLIT_K2"] == 2, (t, cfg)
        assert cfg["SPLIT_K1"] == 1 or p1 // 2 < 6 * 132, (t, cfg)
    assert F.default_moe_config(1)["SPLIT_K1"] == 8 and F.default_moe_config(1)["SPLIT_K2"] == 2
    assert F.default_moe_config(64)["SPLIT_K1"] == 1 and F.default_moe_config(1024)["SPLIT_K2"] == 1
    for key, bad in (("SPLIT_K1", 0), ("SPLIT_K2", 1.5), ("SPLIT_K1", 65), ("GEMV", 1.0), ("GEMV", 2), ("GEMV", True),
                     ("SPLIT_GU", 2)):
        with pytest.raises(ValueError, match=key):
            F._check_config(dict(F.default_moe_config(1), **{key: bad}), use_asm=True)
    # the CUDA-core path takes narrow column blocks; the tensor-core path needs 16
    narrow = dict(F.default_moe_config(1), BLOCK_N1=8, BLOCK_K1=256, WARPS1=2)
    F._check_config(dict(narrow, GEMV=1), use_asm=True)
    with pytest.raises(ValueError, match="BLOCK_N1"):
        F._check_config(dict(narrow, GEMV=0), use_asm=True)
    old = {k: v for k, v in F.default_moe_config(1).items() if not k.startswith("SPLIT")}
    F._check_config(old, use_asm=True)  # configs from before split-K (no SPLIT keys) stay valid
    # tuned table: nearest T in log2; absent or broken files fall back to the heuristic; entries
    # without SPLIT keys mean no split
    table = {
        "configs": {
            "1": dict(old, BLOCK_N1=32),
            "8": dict(F.default_moe_config(1), SPLIT_K1=4, SPLIT_K2=2),
            "1024": F.default_moe_config(8192),
        }
    }
    path = tmp_path / "moe.json"
    path.write_text(__import__("json").dumps(table))
    monkeypatch.setenv("VIBEQWEN_MOE_CONFIGS", str(path))
    F._tuned_table.cache_clear()
    try:
        cfg = F.pick_moe_config(1)
        assert cfg["BLOCK_N1"] == 32 and cfg["SPLIT_K1"] == 1 and cfg["SPLIT_K2"] == 1
        cfg = F.pick_moe_config(6)
        assert cfg["SPLIT_K1"] == 4 and cfg["SPLIT_K2"] == 2
        assert F.pick_moe_config(2000)["BLOCK_M"] == 128
        assert cfg["GEMV"] == 0 and F.pick_moe_config(1)["GEMV"] == 0  # absent GEMV key: tensor cores
        # the table holds for the shapes it was tuned for only (a tiny test model gets the heuristic)
        assert F.pick_moe_config(1, 3, 9, hidden=64, intermediate=32) == F.default_moe_config(
            1, 3, 9, hidden=64, intermediate=32)
        monkeypatch.setenv("VIBEQWEN_MOE_CONFIGS", str(tmp_path / "missing.json"))
        F._tuned_table.cache_clear()
        assert F.pick_moe_config(2) == F.default_moe_config(2)
    finally:
        F._tuned_table.cache_clear()


def test_rejects_bad_inputs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    trip = [[nvfp4_quantize(torch.randn(n, k)) for _ in range(3)] for n, k in ((16, 32), (16, 32), (32, 16))]
    w = F.prepack_moe_nvfp4(*trip)
    ids = torch.zeros(2, 2, dtype=torch.int32)
    tw = torch.ones(2, 2)
    with pytest.raises(ValueError, match="needs CUDA"):
        F.fused_moe(torch.randn(2, 32), tw, ids, w)
    with pytest.raises(ValueError, match="needs CUDA"):
        F.fused_router(torch.randn(2, 9), 2)
    with pytest.raises(ValueError, match="needs CUDA"):
        F.moe_align(ids, 3, 16)
    with pytest.raises(ValueError, match="H=48"):
        F.fused_moe(torch.randn(2, 48), tw, ids, w)
    with pytest.raises(ValueError, match="k'"):
        F.fused_moe(torch.randn(2, 32), torch.ones(2, 3), ids, w)
    with pytest.raises(TypeError):
        F.fused_moe(torch.randn(2, 32), tw, ids, trip)
    with pytest.raises(ValueError, match="top_k"):
        F.fused_router(torch.randn(2, 9), 9)
    with pytest.raises(ValueError, match="power of two"):
        F.moe_align(ids, 3, 24)
    with pytest.raises(ValueError, match="fewer than 4"):
        F._check_config(dict(F.default_moe_config(1), BLOCK_N1=16, BLOCK_K1=16), use_asm=True)


# ------------------------------------------------------------------------------------------ GPU tests

E_REAL, K_REAL, H_REAL, I_REAL = 256, 8, 2048, 512


def _check(y: torch.Tensor, ref: torch.Tensor) -> None:
    r = rel(y, ref)
    assert r <= REL_FRO, f"relative error {r:.2e} > {REL_FRO}"
    rms = ref.pow(2).mean().sqrt().item()
    torch.testing.assert_close(y.float(), ref, rtol=RTOL, atol=ATOL_RMS * rms + 1e-30)


@pytest.fixture(scope="module")
def real_experts():
    torch.manual_seed(1)
    return make_experts(E_REAL + 1, H_REAL, I_REAL, torch.device("cuda"))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [1, 8, 32, 64, 1024], ids=lambda t: f"T{t}")
def test_gpu_real_shapes(t, real_experts):
    W, wg, wu, wd = real_experts
    dev = torch.device("cuda")
    x = torch.randn(t, H_REAL, device=dev).to(torch.bfloat16)
    logits = torch.randn(t, E_REAL + 1, device=dev).to(torch.bfloat16)
    tw, ti = F.fused_router(logits, K_REAL)
    check_router(logits, K_REAL, tw, ti)  # bf16 logits: ties possible, so not id-for-id
    out = torch.full((t, H_REAL), float("nan"), device=dev, dtype=torch.bfloat16)
    y = F.fused_moe(x, tw, ti, W, out=out)
    assert y is out
    _check(y, moe_ref_routed(x, tw, ti, wg, wu, wd))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [3, 200], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("which", ["decode", "mid", "prefill", "portable"])
def test_gpu_configs(t, which, real_experts, monkeypatch):
    """Every heuristic config family at two T (decode: split-K GEMMs), and the portable (non-PTX)
    dequantizer."""
    W, wg, wu, wd = real_experts
    dev = torch.device("cuda")
    cfg = {
        "decode": F.default_moe_config(1),
        "mid": F.default_moe_config(512),
        "prefill": F.default_moe_config(8192),
        "portable": F.default_moe_config(t),
    }[which]
    if which == "portable":
        monkeypatch.setenv("VIBEQWEN_NVFP4_PORTABLE", "1")
    x = torch.randn(t, H_REAL, device=dev).to(torch.bfloat16)
    logits = torch.randn(t, E_REAL + 1, device=dev)
    tw, ti = F.fused_router(logits, K_REAL)
    _check(F.fused_moe(x, tw, ti, W, cfg), moe_ref(x, logits, K_REAL, wg, wu, wd))


_SPLIT_CONFIGS = {
    # GEMM1: 2048 = 16 blocks of 128 in 2 / 3 (6 + 6 + 4) / 8 splits, 8 splits of one 256 block;
    # GEMM2: 512 = 4 blocks of 128 in 1 / 3 (2 + 2 + 0: an empty split) / 4 splits
    "k1x2": {"SPLIT_K1": 2, "SPLIT_K2": 1},
    "k1x3k2x3": {"SPLIT_K1": 3, "SPLIT_K2": 3},
    "k1x8k2x4": {"SPLIT_K1": 8, "SPLIT_K2": 4},
    "bk256k1x8k2x2": {"BLOCK_K1": 256, "SPLIT_K1": 8, "SPLIT_K2": 2},
    "split_gu": {"SPLIT_GU": 1, "SPLIT_K1": 1, "SPLIT_K2": 1, "BLOCK_N1": 128, "WARPS1": 8},
    "split_gu_k1x2": {"SPLIT_GU": 1, "SPLIT_K1": 2, "SPLIT_K2": 1},
    "gemv": {"GEMV": 1, "SPLIT_K1": 1, "SPLIT_K2": 1, "BLOCK_N1": 16, "BLOCK_K1": 256, "BLOCK_N2": 16, "BLOCK_K2": 256, "STAGES1": 1,
             "STAGES2": 1},
    "gemv_k1x4k2x2": {"GEMV": 1, "BLOCK_N1": 32, "BLOCK_K1": 256, "BLOCK_N2": 32, "BLOCK_K2": 128,
                      "SPLIT_K1": 4, "SPLIT_K2": 2, "STAGES1": 1, "STAGES2": 1},
    "n32k1x4k2x2": {
        "BLOCK_N1": 32,
        "BLOCK_K1": 256,
        "SPLIT_K1": 4,
        "SPLIT_K2": 2,
        "STAGES1": 2,
        "STAGES2": 2,
    },
}


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [1, 8, 33], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("which", sorted(_SPLIT_CONFIGS))
def test_gpu_split_k(t, which, real_experts):
    """Split-K GEMM1/GEMM2 at the model's shapes (decode block sizes), poisoned output, and the same
    result bit for bit on a second call (deterministic: no float atomics)."""
    W, wg, wu, wd = real_experts
    dev = torch.device("cuda")
    cfg = dict(F.default_moe_config(1), **_SPLIT_CONFIGS[which])
    x = torch.randn(t, H_REAL, device=dev).to(torch.bfloat16)
    logits = torch.randn(t, E_REAL + 1, device=dev)
    tw, ti = F.fused_router(logits, K_REAL)
    out = torch.full((t, H_REAL), float("nan"), device=dev, dtype=torch.bfloat16)
    y = F.fused_moe(x, tw, ti, W, cfg, out=out)
    _check(y, moe_ref(x, logits, K_REAL, wg, wu, wd))
    assert torch.equal(F.fused_moe(x, tw, ti, W, cfg), y)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t,bm", [(1, 16), (64, 16), (1024, 64), (8192, 128)], ids=str)
def test_gpu_align(t, bm):
    dev = torch.device("cuda")
    logits = torch.randn(t, E_REAL + 1, device=dev)
    _, ti = F.fused_router(logits, K_REAL)
    check_align(ti, E_REAL + 1, bm, *F.moe_align(ti, E_REAL + 1, bm))
    ids = torch.randint(0, 4, (t, 9), device=dev, dtype=torch.int32)  # skewed: most experts empty
    check_align(ids, E_REAL + 1, bm, *F.moe_align(ids, E_REAL + 1, bm))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("n_pairs,n_exp,bm,skew", [
    (129, 257, 16, False), (576, 257, 16, False), (1000, 3, 16, False), (9 * 256, 257, 64, True),
    (4608, 257, 32, False), (4609, 257, 64, False), (9 * 1024, 257, 64, False), (9 * 8192, 257, 64, False),
    (5000, 1024, 128, False), (777, 1, 64, False), (40000, 40, 16, True),
], ids=str)
def test_gpu_align_cuda_matches_triton(monkeypatch, n_pairs, n_exp, bm, skew):
    """The one-launch CUDA alignment (csrc/moe_align.cu) against the three Triton launches: equal outputs position
    for position on fresh random ids (uniform, or most pairs on 2 experts), with the invariants checked too; and
    moe_align picks it exactly for 129..ALIGN_CUDA_MAX_PAIRS pairs."""
    from vibeqwen_kernels.moe import align_cuda

    dev = torch.device("cuda")
    if not align_cuda.align_supported(n_exp, dev):
        pytest.skip("the CUDA alignment does not build here (nvcc, sm_90+)")
    if skew:
        ids = torch.where(torch.rand(n_pairs, device=dev) < 0.9, torch.randint(0, 2, (n_pairs,), device=dev),
                          torch.randint(0, n_exp, (n_pairs,), device=dev)).to(torch.int32)
    else:
        ids = torch.randint(0, n_exp, (n_pairs,), device=dev, dtype=torch.int32)
    p_max, b_max = F.align_bounds(n_pairs, n_exp, bm)
    # garbage in the outputs: the kernel must write every entry
    got = (torch.full((p_max,), -7, device=dev, dtype=torch.int32), torch.full((b_max,), -7, device=dev,
           dtype=torch.int32), torch.full((1,), -7, device=dev, dtype=torch.int32))
    align_cuda.moe_align_cuda(ids, n_exp, bm, *got)
    check_align(ids, n_exp, bm, *got)
    monkeypatch.setenv("VIBEQWEN_CUDA_ALIGN", "0")
    want = F.moe_align(ids.view(1, -1), n_exp, bm)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    monkeypatch.delenv("VIBEQWEN_CUDA_ALIGN")
    calls = []
    real = align_cuda.moe_align_cuda
    monkeypatch.setattr(align_cuda, "moe_align_cuda", lambda *a: calls.append(1) or real(*a))
    again = F.moe_align(ids.view(1, -1), n_exp, bm)
    assert bool(calls) == (n_pairs <= align_cuda.ALIGN_CUDA_MAX_PAIRS)
    for g, w in zip(again, want):
        assert torch.equal(g, w)
    # the launcher's argument checks
    with pytest.raises(ValueError):
        real(ids.long(), n_exp, bm, *got)
    with pytest.raises(ValueError):
        real(ids, n_exp, bm, got[0][:-1], got[1], got[2])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("split", [False, True], ids=["picked", "split"])
def test_gpu_cuda_graph(split, real_experts):
    """router + fused_moe captured once, replayed on new inputs (no host sync, shape-only grids);
    also with split-K GEMMs (workspaces allocated inside the capture)."""
    W, wg, wu, wd = real_experts
    dev = torch.device("cuda")
    t = 16
    cfg = dict(F.default_moe_config(1), SPLIT_K1=4, SPLIT_K2=2) if split else None
    x = torch.randn(t, H_REAL, device=dev).to(torch.bfloat16)
    logits = torch.randn(t, E_REAL + 1, device=dev).to(torch.bfloat16)

    def step():
        tw, ti = F.fused_router(logits, K_REAL)
        return tw, ti, F.fused_moe(x, tw, ti, W, cfg)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tw, ti, y = step()
    for _ in range(2):
        x.copy_(torch.randn(t, H_REAL, device=dev))
        logits.copy_(torch.randn(t, E_REAL + 1, device=dev))
        g.replay()
        torch.cuda.synchronize()
        check_router(logits, K_REAL, tw, ti)
        _check(y, moe_ref_routed(x, tw, ti, wg, wu, wd))


def test_tuner_candidates_pass_the_config_check():
    """Every configuration bench_moe.py --tune tries is one fused_moe accepts (GPU dequantizer rules), at every
    token count it tries it for, so a tuned winner is never rejected at run time."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "bench" / "kernels" / "bench_moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bad = []
    for pool in ("all", "mma"):
        for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 8192):
            for cfg in bench.candidates(t, pool):
                try:
                    F._check_config(cfg, use_asm=True)
                except ValueError as e:
                    bad.append((t, cfg, str(e)))
    assert not bad, bad[:3]
    # the CUDA prefill kernel's configs are tried at prefill sizes, in both pools
    for pool in ("all", "mma"):
        assert {c["BLOCK_M"] for c in bench.candidates(1024, pool) if c["MMA"] == 1} == {32, 64}
        assert all(c["MMA"] == 0 or c["BLOCK_M"] != 16 for c in bench.candidates(2048, pool))
