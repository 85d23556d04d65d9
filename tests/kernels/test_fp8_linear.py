"""FP8 E4M3 W8A16 linear (`vibeqwen_kernels.fp8`) against `fp8_linear_ref` on fresh random inputs.

Tolerance. E4M3 codes widen exactly to bf16/fp16/fp32 and the kernels accumulate in fp32, so against
the fp32 reference only the fp32 summation order, the scale applied after the sum (one fp32 rounding)
and the final rounding of y (bf16: <= 2^-9 relative per element) differ. GPU (bf16):
    ||y - ref|| / ||ref|| <= 4e-3   and   |y - ref| <= 8e-3 * |ref| + 1e-3 * rms(ref)   elementwise.
Interpreter: fp32 activations (only summation order differs: <= 1e-5 relative) and fp16 (final
rounding to fp16, 2^-11 relative: <= 1e-3). Outputs are poisoned with NaN first, so an unwritten
element fails.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from vibeqwen_kernels.fp8 import FP8Weight, fp8_linear, fp8_linear_ref, pick_config, prepack_fp8
from vibeqwen_kernels.fp8 import linear as fp8_lin

from vibeqwen.checkpoint.quant import fp8_dequantize, fp8_quantize

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_gpu = pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA GPU"
)
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

REL_FRO = 4e-3
RTOL = 8e-3
ATOL_RMS = 1e-3

# (N, K) the model uses (fused in_proj, attention projections, small heads), plus odd edges.
SHAPES = [(8192, 2048), (4096, 2048), (32, 2048), (2048, 4096), (512, 2048), (12352, 2048), (9216, 2048),
          (200, 80), (33, 272)]  # fmt: skip
MS = [1, 3, 4, 5, 8, 16, 33, 64, 65, 300]


def _check(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    y = y.float()
    rel = ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert rel <= REL_FRO, f"relative error {rel:.2e} > {REL_FRO}"
    rms = ref.pow(2).mean().sqrt().item()
    torch.testing.assert_close(y, ref, rtol=RTOL, atol=ATOL_RMS * rms + 1e-30)


def _weight(n: int, k: int, device, scale: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_quantize(torch.randn(n, k, device=device, dtype=torch.bfloat16) * scale)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", MS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
def test_matches_reference(n, k, m):
    dev = torch.device("cuda")
    q, s = _weight(n, k, dev)
    w = prepack_fp8(q, s)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
    y = fp8_linear(x, w, out=out)
    assert y is out
    ref = fp8_linear_ref(x, q, s)
    torch.testing.assert_close(ref, x.float() @ fp8_dequantize(q, s).t())
    _check(y, ref)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", [1, 2, 8, 40, 200], ids=lambda m: f"M{m}")
def test_per_row_scales_strided_x_fp16(m):
    """Three matrices with different per-tensor scales concatenated along N ([N] scale), strided x,
    fp16 activations, and a deterministic split-K (two runs bit-identical)."""
    dev = torch.device("cuda")
    k = 2048
    parts = [
        fp8_quantize(torch.randn(nn, k, device=dev) * sc) for nn, sc in ((96, 1e-3), (64, 5.0), (8, 0.1))
    ]
    q = torch.cat([p[0] for p in parts])
    s = torch.cat([p[1].reshape(1).expand(p[0].shape[0]) for p in parts])
    w = prepack_fp8(q, s)
    assert w.scale.shape == (168,)
    for dt in (torch.bfloat16, torch.float16):
        x = torch.randn(m, k + 64, device=dev, dtype=dt)[:, 32 : 32 + k]
        y = fp8_linear(x, w)
        assert y.dtype == dt and y.shape == (m, 168)
        ref = fp8_linear_ref(x, w)
        for (qq, _), lo in zip(parts, (0, 96, 160)):  # each block against its own scale
            _check(y[:, lo : lo + qq.shape[0]], ref[:, lo : lo + qq.shape[0]])
        assert torch.equal(fp8_linear(x, w), y), "split-K result not deterministic"


@pytest.mark.gpu
@requires_gpu
def test_cuda_graph_capture():
    dev = torch.device("cuda")
    q, s = _weight(4096, 2048, dev)
    w = prepack_fp8(q, s)
    xs = {m: torch.randn(m, 2048, device=dev, dtype=torch.bfloat16) for m in (1, 8, 64, 256)}
    for x in xs.values():
        fp8_linear(x, w)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ys = {m: fp8_linear(x, w) for m, x in xs.items()}
    for x in xs.values():
        x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    for m, x in xs.items():
        _check(ys[m], fp8_linear_ref(x, w))


@requires_triton
def test_interpreter_fp32_fp16():
    """Both kernels and the split-K reduce under Triton's CPU interpreter (native fp8 loads and casts
    work there for every finite E4M3 code), fp32 and fp16 activations, strided x, uneven K splits."""
    script = textwrap.dedent(
        """
        import torch
        from vibeqwen.checkpoint.quant import fp8_quantize
        from vibeqwen_kernels.fp8 import linear as L
        from vibeqwen_kernels.fp8 import fp8_linear, fp8_linear_ref, prepack_fp8
        torch.manual_seed(0)
        worst = {torch.float32: 0.0, torch.float16: 0.0}
        def run(m, n, k, dt, cfg=None, per_row=False):
            q, s = fp8_quantize(torch.randn(n, k))
            if per_row:
                s = torch.rand(n) + 0.5
            w = prepack_fp8(q, s)
            x = torch.randn(m, k + 8).to(dt)[:, 4:4 + k]
            out = torch.full((m, n), float("nan"), dtype=dt)
            if cfg is None:
                assert fp8_linear(x, w, out=out) is out
            else:
                L._launch(x, w, out, cfg)
            assert torch.isfinite(out).all()
            ref = fp8_linear_ref(x, w)
            worst[dt] = max(worst[dt], ((out.float() - ref).norm() / ref.norm()).item())
        G = dict(KIND="gemv", GROUP_M=1, num_warps=1, num_stages=1)
        T = dict(KIND="mm", num_warps=1, num_stages=1)
        for dt in (torch.float32, torch.float16):
            run(1, 40, 96, dt); run(3, 40, 96, dt, per_row=True); run(7, 40, 100, dt)
            run(70, 40, 96, dt, per_row=True)
            run(2, 33, 80, dt, dict(G, BLOCK_M=2, BLOCK_N=16, BLOCK_K=32, SPLIT_K=2))
            run(3, 33, 80, dt, dict(G, BLOCK_M=4, BLOCK_N=16, BLOCK_K=32, SPLIT_K=2))
            run(1, 33, 80, dt, dict(G, BLOCK_M=1, BLOCK_N=16, BLOCK_K=32, SPLIT_K=3), per_row=True)
            run(1, 40, 128, dt, dict(G, BLOCK_M=1, BLOCK_N=16, BLOCK_K=32, SPLIT_K=4))
            run(20, 50, 96, dt, dict(T, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=4, GROUP_M=1))
            run(9, 50, 128, dt, dict(T, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=2, GROUP_M=1))
            run(40, 50, 64, dt, dict(T, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, GROUP_M=2))
            run(40, 50, 80, dt, dict(T, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, GROUP_M=2, W_AS_A=0))
            run(20, 50, 96, dt, dict(T, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=4, GROUP_M=1, W_AS_A=0))
        print(worst[torch.float32], worst[torch.float16])
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert res.returncode == 0, res.stderr[-3000:]
    e32, e16 = map(float, res.stdout.strip().splitlines()[-1].split())
    assert e32 <= 1e-5 and e16 <= 1e-3, (e32, e16)


def test_reference_matches_fp8_dequantize():
    q, s = fp8_quantize(torch.randn(24, 40))
    x = torch.randn(5, 40)
    torch.testing.assert_close(fp8_linear_ref(x, q, s), x @ fp8_dequantize(q, s).t())
    w = prepack_fp8(q, s)
    assert isinstance(w, FP8Weight) and w.scale.shape == (1,) and w.nbytes == 24 * 40 + 4
    torch.testing.assert_close(fp8_linear_ref(x, w), x @ w.dequantize().t())


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 4, 5, 16, 64, 65, 8192])
def test_pick_config(n, k, m):
    cfg = pick_config(m, n, k)
    if cfg["KIND"] == "mm":
        assert min(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) >= 16
    else:
        assert m <= cfg["BLOCK_M"] <= 4
    assert cfg["SPLIT_K"] >= 1 and (cfg["SPLIT_K"] - 1) * cfg["BLOCK_K"] < k  # no empty split


def test_rejects_bad_inputs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, s = fp8_quantize(torch.randn(8, 32))
    w = prepack_fp8(q, s)
    with pytest.raises(ValueError):
        fp8_linear(torch.randn(2, 32), w)  # CPU outside the interpreter
    with pytest.raises(ValueError):
        fp8_linear(torch.randn(2, 16), w)
    with pytest.raises(ValueError):
        fp8_linear(torch.randn(2, 32).int(), w)
    with pytest.raises(TypeError):
        fp8_linear(torch.randn(2, 32), q)
    with pytest.raises(ValueError):
        prepack_fp8(q.float(), s)
    with pytest.raises(ValueError):
        prepack_fp8(q, torch.ones(3))
    with pytest.raises(ValueError):
        prepack_fp8(q, float("nan"))
    with pytest.raises(TypeError):
        prepack_fp8(q, "1.0")
    assert fp8_lin.GEMV_MAX_M <= fp8_lin.DECODE_MAX_M


def test_pick_config_reads_the_tuned_table(tmp_path, monkeypatch):
    """Entries of this (N, K) by nearest M (log2), a gemv entry's BLOCK_M raised to cover M, invalid entries
    skipped, other shapes and M > 64 left to the heuristic."""
    import json

    from vibeqwen_kernels.fp8 import linear as L

    gemv = dict(KIND="gemv", BLOCK_M=1, BLOCK_N=64, BLOCK_K=512, SPLIT_K=1, GROUP_M=1, num_warps=8, num_stages=3)
    mm = dict(KIND="mm", BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, SPLIT_K=2, GROUP_M=1, W_AS_A=1, num_warps=4,
              num_stages=4)
    bad = dict(mm, BLOCK_N=48)
    table = {"configs": {"256x512": {"1": gemv, "32": mm, "16": bad}, "128x512": {"1": gemv}}}
    path = tmp_path / "fp8.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("VIBEQWEN_FP8_CONFIGS", str(path))
    L._tuned_table.cache_clear()
    try:
        assert L.pick_config(1, 256, 512) == gemv
        assert L.pick_config(3, 256, 512) == dict(gemv, BLOCK_M=4)
        assert L.pick_config(32, 256, 512) == mm
        assert L.pick_config(17, 256, 512) == mm  # nearest is the invalid 16: skipped for the next one
        assert L.pick_config(8, 256, 512) == mm  # nearest valid entry
        assert L.pick_config(8, 128, 512) == L._heuristic_config(8, 128, 512)  # a gemv entry cannot take 8 rows
        assert L.pick_config(32, 512, 512) == L._heuristic_config(32, 512, 512)
        assert L.pick_config(65, 256, 512) == L._heuristic_config(65, 256, 512)
    finally:
        L._tuned_table.cache_clear()


def test_tuner_candidates_are_configs_pick_config_accepts():
    """Every configuration bench_fp8.py --tune may write is one pick_config would use for its M."""
    import importlib.util
    from pathlib import Path

    from vibeqwen_kernels.fp8 import linear as L

    path = Path(__file__).parents[2] / "bench" / "kernels" / "bench_fp8.py"
    spec = importlib.util.spec_from_file_location("bench_fp8", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for m in bench.TUNE_MS:
        cands = bench.tune_candidates(m)
        assert cands and all(L._valid(c, m) for c in cands), m
        assert any(c["KIND"] == "gemv" for c in cands) == (m <= L.GEMV_MAX_M)
