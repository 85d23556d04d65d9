"""NVFP4 W4A16 linear: the Triton kernels against `nvfp4_linear_ref`, on fresh random inputs.

Tolerance. The kernels widen the weight to bf16 exactly (E2M1 x E4M3 fits bf16's 8 significant bits)
and accumulate in fp32, so against the fp32 reference only the fp32 summation order and the final
rounding of y to bf16 (<= 2^-9 relative per element) differ. We assert
    ||y - ref|| / ||ref|| <= 4e-3   and   |y - ref| <= 8e-3 * |ref| + 1e-3 * rms(ref)   elementwise.
Outputs are poisoned with NaN first, so an unwritten element fails.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from vibeqwen_kernels.nvfp4 import linear as nvfp4_lin
from vibeqwen_kernels.nvfp4 import nvfp4_linear, nvfp4_linear_ref, prepack_nvfp4

from vibeqwen.checkpoint.quant import nvfp4_quantize

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_gpu = pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA GPU"
)

REL_FRO = 4e-3
RTOL = 8e-3
ATOL_RMS = 1e-3

# (N, K): the model's expert shapes, N not a multiple of any block, K = 16 * odd.
SHAPES = [(512, 2048), (2048, 512), (200, 80), (1000, 528), (48, 16), (33, 272)]
MS = [1, 3, 16, 17, 64, 300]


def _weight(n: int, k: int, device, scale: float = 1.0):
    w = torch.randn(n, k, device=device) * scale
    packed, block_scale, global_scale = nvfp4_quantize(w)
    return packed, block_scale, global_scale


def _check(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    y = y.float()
    rel = ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert rel <= REL_FRO, f"relative error {rel:.2e} > {REL_FRO}"
    rms = ref.pow(2).mean().sqrt().item()
    torch.testing.assert_close(y, ref, rtol=RTOL, atol=ATOL_RMS * rms + 1e-30)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", MS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
def test_matches_reference(n, k, m):
    dev = torch.device("cuda")
    packed, bs, gs = _weight(n, k, dev)
    w = prepack_nvfp4(packed, bs, gs)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
    y = nvfp4_linear(x, w, out=out)
    assert y is out
    _check(y, nvfp4_linear_ref(x, packed, bs, gs))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", [1, 5, 130], ids=lambda m: f"M{m}")
def test_extreme_scales_zero_blocks_strided_x(m):
    """Tiny and huge global scales, all-zero blocks and rows, every code, strided x, fp32 out."""
    dev = torch.device("cuda")
    n, k = 96, 336
    for scale in (1e-4, 3e3):
        w = torch.randn(n, k, device=dev) * scale
        w[3] = 0  # a zero row
        w[:, 32:48] = 0  # a zero block column
        w[7, :16] = torch.linspace(-6, 6, 16, device=dev) * scale  # all magnitudes in one block
        packed, bs, gs = nvfp4_quantize(w)
        wt = prepack_nvfp4(packed, bs, gs)
        xbig = torch.randn(m, k + 64, device=dev, dtype=torch.bfloat16)
        x = xbig[:, 32 : 32 + k]  # row stride k + 64
        y = nvfp4_linear(x, wt, out_dtype=torch.float32)
        assert y.dtype == torch.float32
        _check(y, nvfp4_linear_ref(x, packed, bs, gs))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize(
    "n,k,m,split,bk",
    [
        (512, 2048, 1, 8, 256),
        (512, 2048, 16, 4, 128),
        (2048, 512, 5, 2, 256),
        (200, 528, 3, 3, 64),
        (64, 272, 1, 8, 64),
        (512, 2048, 40, 8, 256),
        (2048, 512, 64, 4, 128),
    ],
    ids=lambda v: str(v),
)
def test_split_k_decode(n, k, m, split, bk):
    """Split-K decode, including uneven and empty splits; twice, so the arrival counters must reset."""
    dev = torch.device("cuda")
    packed, bs, gs = _weight(n, k, dev)
    w = prepack_nvfp4(packed, bs, gs)
    bm = max(16, 1 << (m - 1).bit_length())
    cfg = {"BLOCK_M": bm, "BLOCK_N": 16, "BLOCK_K": bk, "num_warps": 4, "num_stages": 3, "SPLIT_K": split}
    for _ in range(2):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
        nvfp4_lin._launch(x, w, out, cfg, decode=True, use_asm=True)  # an explicit config, not the tuned one
        _check(out, nvfp4_linear_ref(x, packed, bs, gs))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize(
    "n,k,m,bn,bk,split,warps,repack,pf",
    [
        (512, 2048, 1, 32, 256, 8, 4, True, 0),
        (512, 2048, 1, 16, 256, 2, 2, True, 1),  # prefetch, several steps per split
        (512, 2048, 8, 64, 128, 16, 4, True, 1),
        (2048, 512, 1, 64, 128, 4, 4, True, 0),
        (2048, 512, 5, 32, 256, 2, 2, True, 1),
        (1000, 528, 3, 64, 64, 3, 4, True, 1),  # uneven K split, N not a multiple of BLOCK_N
        (1000, 528, 2, 32, 128, 1, 4, True, 0),
        (200, 80, 7, 16, 64, 1, 1, True, 0),
        (48, 16, 2, 16, 16, 1, 1, True, 1),
        (33, 272, 8, 128, 256, 1, 8, True, 0),
        (320, 1040, 4, 32, 128, 2, 4, False, 1),  # checkpoint nibble order
        (4096, 2048, 6, 64, 256, 1, 4, True, 1),
        (4096, 2048, 1, 32, 512, 1, 4, True, 0),
    ],
    ids=lambda v: str(v),
)
def test_gemv_fma_kernel(n, k, m, bn, bk, split, warps, repack, pf):
    """The CUDA-core small-M kernel (FMA=1), split-K included; twice, so the arrival counters must reset."""
    dev = torch.device("cuda")
    packed, bs, gs = _weight(n, k, dev)
    w = prepack_nvfp4(packed, bs, gs, repack=repack)
    cfg = {
        "BLOCK_M": m,
        "BLOCK_N": bn,
        "BLOCK_K": bk,
        "num_warps": warps,
        "num_stages": 1,
        "SPLIT_K": split,
        "FMA": 1,
        "PREFETCH": pf,
    }
    for _ in range(2):
        x = torch.randn(m, k + 32, device=dev, dtype=torch.bfloat16)[:, 16 : 16 + k]  # strided rows
        out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
        nvfp4_lin._launch(x, w, out, cfg, decode=True, use_asm=True)
        _check(out, nvfp4_linear_ref(x, packed, bs, gs))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", [1, 2, 8], ids=lambda m: f"M{m}")
def test_gemv_fma_extreme_scales(m):
    """GEMV kernel on tiny/huge global scales, zero rows and blocks, every code, fp32 out."""
    dev = torch.device("cuda")
    n, k = 96, 336
    for scale in (1e-4, 3e3):
        w = torch.randn(n, k, device=dev) * scale
        w[3] = 0
        w[:, 32:48] = 0
        w[7, :16] = torch.linspace(-6, 6, 16, device=dev) * scale
        packed, bs, gs = nvfp4_quantize(w)
        wt = prepack_nvfp4(packed, bs, gs)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        out = torch.full((m, n), float("nan"), device=dev, dtype=torch.float32)
        cfg = {
            "BLOCK_M": m,
            "BLOCK_N": 32,
            "BLOCK_K": 64,
            "num_warps": 2,
            "num_stages": 1,
            "SPLIT_K": 2,
            "FMA": 1,
        }
        nvfp4_lin._launch(x, wt, out, cfg, decode=True, use_asm=True)
        _check(out, nvfp4_linear_ref(x, packed, bs, gs))


def test_pick_config_gemv_routing(monkeypatch):
    """A "gemv" entry routes M <= 8 to the CUDA-core kernel when its tuned M is at least as near."""
    table = {
        "decode": {
            "512x2048": {
                "8": {
                    "BLOCK_M": 16,
                    "BLOCK_N": 64,
                    "BLOCK_K": 128,
                    "num_warps": 4,
                    "num_stages": 1,
                    "SPLIT_K": 16,
                }
            }
        },
        "gemv": {
            "512x2048": {"1": {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1, "SPLIT_K": 8}}
        },
    }
    monkeypatch.setattr(nvfp4_lin, "_tuned_table", lambda: table)
    c1 = nvfp4_lin.pick_config("decode", 1, 512, 2048)
    assert c1["FMA"] == 1 and c1["BLOCK_M"] == 1 and c1["SPLIT_K"] == 8
    assert nvfp4_lin.pick_config("decode", 2, 512, 2048)["FMA"] == 1
    assert not nvfp4_lin.pick_config("decode", 8, 512, 2048).get("FMA")
    assert not nvfp4_lin.pick_config("decode", 16, 512, 2048).get("FMA")
    assert not nvfp4_lin.pick_config("decode", 1, 2048, 512).get("FMA")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", [17, 64], ids=lambda m: f"M{m}")
def test_prefill_kernel_small_m(m):
    """The prefill kernel at the M that narrow weights route to the decode kernel (lm_head uses it there)."""
    dev = torch.device("cuda")
    packed, bs, gs = _weight(1000, 528, dev)
    w = prepack_nvfp4(packed, bs, gs)
    x = torch.randn(m, 528, device=dev, dtype=torch.bfloat16)
    out = torch.full((m, 1000), float("nan"), device=dev, dtype=torch.bfloat16)
    nvfp4_lin._launch(
        x, w, out, nvfp4_lin.default_config("prefill", m, 1000, 528), decode=False, use_asm=True
    )
    _check(out, nvfp4_linear_ref(x, packed, bs, gs))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", [4, 100], ids=lambda m: f"M{m}")
def test_checkpoint_nibble_order(m):
    """prepack_nvfp4(repack=False) keeps the checkpoint's byte order; the kernels read it too."""
    dev = torch.device("cuda")
    packed, bs, gs = _weight(320, 1040, dev)
    w = prepack_nvfp4(packed, bs, gs, repack=False)
    assert torch.equal(w.packed, packed)
    x = torch.randn(m, 1040, device=dev, dtype=torch.bfloat16)
    _check(nvfp4_linear(x, w), nvfp4_linear_ref(x, packed, bs, gs))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", [2, 40], ids=lambda m: f"M{m}")
def test_portable_dequant_on_gpu(m, monkeypatch):
    """The integer-arithmetic dequantizer (the interpreter's) gives the same answers on the GPU."""
    monkeypatch.setenv("VIBEQWEN_NVFP4_PORTABLE", "1")
    dev = torch.device("cuda")
    packed, bs, gs = _weight(136, 208, dev)
    x = torch.randn(m, 208, device=dev, dtype=torch.float16)  # cast to bf16 by the wrapper
    y = nvfp4_linear(x, prepack_nvfp4(packed, bs, gs))
    _check(y, nvfp4_linear_ref(x.to(torch.bfloat16), packed, bs, gs))


def _triton_version() -> tuple[int, int]:
    import triton

    return tuple(int(v) for v in triton.__version__.split(".")[:2])


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_interpreter_fp32_fp16():
    """Triton's CPU interpreter runs the same kernels (portable dequantizer) on fp32 and fp16 inputs.

    Runs in a subprocess: TRITON_INTERPRET must be set before the kernels are first compiled.
    """
    if _triton_version() < (3, 9):
        # seen 2026-11-30: triton 3.6's interpreter fails in `range(runtime_bound)` under NumPy 2.5
        # ("only 0-dimensional arrays can be converted to Python scalars"); 3.9 runs it.
        pytest.skip("the interpreter test needs triton >= 3.9")
    script = textwrap.dedent(
        """
        import torch
        from vibeqwen.checkpoint.quant import nvfp4_quantize
        from vibeqwen_kernels.nvfp4 import linear, nvfp4_linear, nvfp4_linear_ref, prepack_nvfp4
        torch.manual_seed(0)
        worst = 0.0
        # split-K decode with an uneven and an empty split, twice (the counters must reset)
        p, s, g = nvfp4_quantize(torch.randn(40, 528))
        w = prepack_nvfp4(p, s, g)
        cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, num_warps=1, num_stages=1, SPLIT_K=4)
        for _ in range(2):
            x = torch.randn(3, 528)
            y = torch.full((3, 40), float("nan"))
            linear._launch(x, w, y, cfg, decode=True, use_asm=False)
            ref = nvfp4_linear_ref(x, p, s, g)
            worst = max(worst, ((y - ref).norm() / ref.norm()).item())
        # the CUDA-core GEMV kernel: split-K uneven, both nibble orders
        for m, n, k, split, rep, pf in [(3, 40, 528, 4, True, 1), (1, 40, 512, 2, True, 1),
                                        (2, 40, 512, 2, True, 0), (7, 40, 528, 3, False, 1)]:
            p, s, g = nvfp4_quantize(torch.randn(n, k))
            w = prepack_nvfp4(p, s, g, repack=rep)
            cfg = dict(BLOCK_M=m, BLOCK_N=16, BLOCK_K=64, num_warps=1, num_stages=1, SPLIT_K=split, FMA=1, PREFETCH=pf)
            for _ in range(2):
                x = torch.randn(m, k)
                y = torch.full((m, n), float("nan"))
                linear._launch(x, w, y, cfg, decode=True, use_asm=False)
                ref = nvfp4_linear_ref(x, p, s, g)
                worst = max(worst, ((y - ref).norm() / ref.norm()).item())
        for m, n, k, dt in [(1, 40, 80, torch.float32), (3, 24, 48, torch.float16),
                            (17, 33, 144, torch.float32), (20, 16, 16, torch.float16)]:
            w = torch.randn(n, k)
            p, s, g = nvfp4_quantize(w)
            x = torch.randn(m, k).to(dt)
            y = nvfp4_linear(x, prepack_nvfp4(p, s, g), out=torch.full((m, n), float("nan")))
            ref = nvfp4_linear_ref(x, p, s, g)
            assert torch.isfinite(y).all()
            worst = max(worst, ((y - ref).norm() / ref.norm()).item())
        print(worst)
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert res.returncode == 0, res.stderr[-3000:]
    # fp32 math throughout (fp16 inputs are exact in fp32): only summation order differs
    assert float(res.stdout.strip().splitlines()[-1]) < 1e-5


def test_repack_round_trip():
    packed = torch.randint(0, 256, (7, 136), dtype=torch.uint8)
    bs = torch.rand(7, 17).to(torch.float8_e4m3fn)
    w = prepack_nvfp4(packed, bs, 0.5)
    assert w.repacked and w.packed.shape == packed.shape
    assert torch.equal(nvfp4_lin.unpack_kernel_order(w.packed), packed)
    # byte 8g+j holds k = 16g+j (low nibble) and 16g+8+j (high nibble)
    assert (w.packed[0, 0] & 15) == (packed[0, 0] & 15) and (w.packed[0, 0] >> 4) == (packed[0, 4] & 15)


def test_rejects_bad_inputs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    packed, bs, gs = _weight(32, 64, "cpu")
    w = prepack_nvfp4(packed, bs, gs)
    with pytest.raises(ValueError, match="needs CUDA"):
        nvfp4_linear(torch.randn(2, 64), w)
    with pytest.raises(ValueError, match="K=48"):
        nvfp4_linear(torch.randn(2, 48), w)
    with pytest.raises(ValueError, match="2-D"):
        nvfp4_linear(torch.randn(2, 3, 64), w)
    with pytest.raises(ValueError, match="2-D"):
        nvfp4_linear(torch.ones(2, 64, dtype=torch.int32), w)
    with pytest.raises(TypeError):
        nvfp4_linear(torch.randn(2, 64), (packed, bs, gs))
    with pytest.raises(ValueError, match="uint8"):
        prepack_nvfp4(packed.to(torch.int16), bs, gs)
    with pytest.raises(ValueError, match="block_scale"):
        prepack_nvfp4(packed, bs.float(), gs)
    with pytest.raises(ValueError, match="block_scale"):
        prepack_nvfp4(packed, bs[:, :2], gs)
    with pytest.raises(ValueError, match="multiple of 16"):
        prepack_nvfp4(packed[:, :4], bs[:, :1], gs)
    with pytest.raises(ValueError, match="one number"):
        prepack_nvfp4(packed, bs, torch.ones(2))
    with pytest.raises(ValueError, match="2-D"):
        nvfp4_linear_ref(torch.randn(64), packed, bs, gs)
    with pytest.raises(ValueError, match="fewer than 4"):
        cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
        nvfp4_lin._launch(torch.randn(2, 64), w, torch.empty(2, 32), cfg, decode=True, use_asm=False)
