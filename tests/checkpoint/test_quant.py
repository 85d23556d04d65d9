"""Tests for vibeqwen.checkpoint.quant (NVFP4 / FP8 quantization, ModelOpt-compatible).

Every test runs on CPU, and also on CUDA when a GPU is visible. Exact-value tests use a global
amax of 2688 = 6 * 448 (so weight_scale_2 == 1.0 exactly on either device) and blocks whose
maximum is 6 * (an E4M3 value), so the scaled values equal the inputs bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from vibeqwen.checkpoint.quant import (
    E2M1_VALUES,
    fp8_dequantize,
    fp8_quantize,
    input_scale_for,
    nvfp4_dequantize,
    nvfp4_quantize,
    pack_e2m1,
    unpack_e2m1,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FLOATS = [torch.bfloat16, torch.float16, torch.float32]
GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _with_global_max(blocks: list[list[float]]) -> torch.Tensor:
    """Rows = the given 16-value blocks, plus a last row whose max 2688 pins weight_scale_2 to 1."""
    rows = [list(b) for b in blocks]
    rows.append([2688.0] + [0.0] * 15)
    return torch.tensor(rows, dtype=torch.float32)


def _codes_of(w: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    packed, bs, gs = nvfp4_quantize(w.to(device))
    return unpack_e2m1(packed).cpu(), bs.cpu(), gs.cpu()


def _ref_e2m1_code(x: float) -> int:
    """Independent reference: nearest E2M1 magnitude, ties to the even mantissa, saturate at 6."""
    mag = abs(x)
    best = min(range(8), key=lambda i: (abs(GRID[i] - mag), i % 2))  # even index wins a tie
    return best | (8 if x < 0 else 0)


# ------------------------------------------------------------------------------------------
# tables and packing


def test_e2m1_values_table():
    assert E2M1_VALUES.dtype == torch.float32
    assert E2M1_VALUES.shape == (16,)
    assert E2M1_VALUES[:8].tolist() == GRID
    assert E2M1_VALUES[8:].tolist() == [-v for v in GRID]
    assert math.copysign(1.0, E2M1_VALUES[8].item()) == 1.0  # code 8 decodes to +0 (ModelOpt)


def test_nibble_order_pack_unpack(device):
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 8, 7]], dtype=torch.uint8, device=device)
    packed = pack_e2m1(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 2)
    assert packed.cpu().tolist() == [[0x21, 0x43], [0x0F, 0x78]]
    assert torch.equal(unpack_e2m1(packed), codes)
    every = torch.arange(256, dtype=torch.uint8, device=device)
    assert torch.equal(pack_e2m1(unpack_e2m1(every)), every)


def test_nibble_order_through_quantize(device):
    # Row 0: 0.5, 1, 1.5, 2 then 6 (sets the block scale to 1.0); codes 1, 2, 3, 4, ..., 7.
    w = _with_global_max([[0.5, 1.0, 1.5, 2.0, 6.0] + [0.0] * 11])
    packed, bs, gs = nvfp4_quantize(w.to(device))
    assert gs.item() == 1.0 and bs[0, 0].float().item() == 1.0
    assert packed[0, :3].cpu().tolist() == [0x21, 0x43, 0x07]


# ------------------------------------------------------------------------------------------
# exact known values


def test_every_e2m1_value_and_sign(device):
    block = [6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, -0.0]
    codes, bs, gs = _codes_of(_with_global_max([block]), device)
    assert gs.item() == 1.0
    assert bs[0, 0].float().item() == 1.0
    assert codes[0].tolist() == [7, 0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13, 14, 15, 0]
    assert codes[1, 0].item() == 7  # 2688 / 448 == 6


def test_tie_points_round_half_to_even(device):
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    block = [6.0] + ties + [-t for t in ties] + [0.0]
    codes, bs, _ = _codes_of(_with_global_max([block]), device)
    assert bs[0, 0].float().item() == 1.0
    # 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5.0->4.0
    pos = [0, 2, 2, 4, 4, 6, 6]
    # sign bit is set for every negative input, also when it rounds to zero (-0.25 -> code 8)
    assert codes[0].tolist() == [7] + pos + [p | 8 for p in pos] + [0]


def test_just_off_the_tie_points(device):
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    above = torch.nextafter(ties, torch.tensor(10.0))
    below = torch.nextafter(ties, torch.tensor(0.0))
    block = [6.0] + above.tolist() + below.tolist() + [0.0]
    codes, _, _ = _codes_of(_with_global_max([block]), device)
    assert codes[0].tolist() == [7, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 0]


def test_saturation_above_six(device):
    # block max 6.2 -> scale 6.2/6 = 1.033.. rounds to E4M3 1.0 -> 6.2 saturates to 6 (code 7)
    codes, bs, _ = _codes_of(_with_global_max([[6.2, -6.2] + [0.0] * 14]), device)
    assert bs[0, 0].float().item() == 1.0
    assert codes[0, :2].tolist() == [7, 15]


@pytest.mark.parametrize(
    "x, expected",
    [
        (1.0, 1.0),
        (1.05, 1.0),
        (1.0625, 1.0),  # exact tie between 1.0 and 1.125: to even mantissa
        (1.07, 1.125),
        (1.1875, 1.25),  # exact tie between 1.125 and 1.25: to even
        (300.0, 288.0),
        (448.0, 448.0),
        (0.01, 5 * 2.0**-9),  # E4M3 subnormal
        (1e-4, 2.0**-9),  # would underflow to 0: ModelOpt clamps to the smallest subnormal
    ],
)
def test_block_scale_rounds_to_e4m3(device, x, expected):
    _, bs, gs = _codes_of(_with_global_max([[6.0 * x] + [0.0] * 15]), device)
    assert gs.item() == 1.0
    assert bs.dtype == torch.float8_e4m3fn
    assert bs[0, 0].float().item() == expected


def test_random_codes_match_independent_reference(device):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(8, 64, generator=g) * torch.logspace(-3, 2, 8).unsqueeze(1)
    packed, bs, gs = nvfp4_quantize(w.to(device))
    codes = unpack_e2m1(packed).cpu()
    step = (bs.cpu().float() * gs.cpu()).repeat_interleave(16, dim=-1)
    scaled = w / step  # float32, the same division the quantizer does
    ref = [[_ref_e2m1_code(v) for v in row] for row in scaled.tolist()]
    assert codes.tolist() == ref


def test_scale_formulas(device):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 128, generator=g).to(device)
    _, bs, gs = nvfp4_quantize(w)
    amax = w.abs().max().float()
    assert gs.dtype == torch.float32 and gs.dim() == 0
    assert gs.item() == pytest.approx(amax.item() / 2688.0, rel=1e-6)
    block_amax = w.reshape(32, 8, 16).abs().amax(-1).float()
    want = (block_amax / (6.0 * gs)).clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn)
    # at most a last-ulp float32 difference may move a value across an E4M3 rounding boundary
    assert (_bits(bs) != _bits(want)).float().mean().item() < 0.01
    assert bs.float().max().item() == 448.0  # the block holding the global max


# ------------------------------------------------------------------------------------------
# zeros


def test_zero_block_gets_scale_one(device):
    w = torch.zeros(2, 32)
    w[0, 16:] = torch.linspace(-3, 3, 16)
    packed, bs, gs = nvfp4_quantize(w.to(device))
    assert gs.item() == pytest.approx(3.0 / 2688.0, rel=1e-6)
    assert bs[0, 0].float().item() == 1.0 and bs[1].float().tolist() == [1.0, 1.0]
    codes = unpack_e2m1(packed)
    assert codes[0, :16].eq(0).all() and codes[1].eq(0).all()
    deq = nvfp4_dequantize(packed, bs, gs)
    assert deq[0, :16].eq(0).all() and deq[1].eq(0).all()


@pytest.mark.parametrize("dtype", FLOATS)
def test_all_zero_tensor(device, dtype):
    w = torch.zeros(4, 32, dtype=dtype, device=device)
    packed, bs, gs = nvfp4_quantize(w)
    assert gs.item() == 1.0  # ModelOpt would divide by zero here (documented deviation)
    assert bs.float().eq(1.0).all()
    assert packed.eq(0).all()
    deq = nvfp4_dequantize(packed, bs, gs)
    assert torch.isfinite(deq).all() and deq.eq(0).all()
    q, s = fp8_quantize(w)
    assert s.item() == 1.0 and q.float().eq(0).all()
    assert fp8_dequantize(q, s).eq(0).all()


def test_tiny_negative_gets_sign_bit_and_dequantizes_to_zero(device):
    w = _with_global_max([[6.0, -0.1, 0.1, -0.0] + [0.0] * 12])
    packed, bs, gs = nvfp4_quantize(w.to(device))
    assert unpack_e2m1(packed)[0, :4].tolist() == [7, 8, 0, 0]
    assert nvfp4_dequantize(packed, bs, gs)[0, 1:4].tolist() == [0.0, 0.0, 0.0]


# ------------------------------------------------------------------------------------------
# round trips


def _halfgap(scaled_abs: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid spacing around |x| (spacing .5 below 2, 1 below 4, 2 above)."""
    return torch.where(scaled_abs < 2, 0.25, torch.where(scaled_abs < 4, 0.5, 1.0))


@pytest.mark.parametrize("dtype", FLOATS)
def test_nvfp4_round_trip_error_bound(device, dtype):
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(96, 256, generator=g) * torch.rand(96, 1, generator=g)).to(dtype)
    w[5] *= 50  # a few heavy rows so block scales span a wide range
    packed, bs, gs = nvfp4_quantize(w.to(device))
    assert packed.shape == (96, 128) and packed.dtype == torch.uint8
    assert bs.shape == (96, 16) and bs.dtype == torch.float8_e4m3fn
    assert gs.shape == () and gs.dtype == torch.float32
    deq = nvfp4_dequantize(packed, bs, gs, dtype=torch.float32).cpu()
    w32 = w.float()
    step = (bs.cpu().float() * gs.cpu()).repeat_interleave(16, dim=-1)
    err = (deq - w32).abs()
    # every element is within half an E2M1 step (in its block's units) of its input; values
    # scaled slightly above 6 (block scale rounded down) saturate by at most 6/(1-1/16) - 6 < 1
    bound = _halfgap((w32 / step).abs()) * step * (1 + 1e-6)
    assert (err <= bound).all()
    # per block, the relative error is bounded by the coarsest step over the block max (1/6)
    blk_err = err.reshape(96, 16, 16).amax(-1)
    blk_max = w32.abs().reshape(96, 16, 16).amax(-1)
    nz = blk_max > 0
    assert (blk_err[nz] / blk_max[nz]).max().item() <= 1.0 / 5.647 + 1e-6
    assert nvfp4_dequantize(packed, bs, gs, dtype=dtype).dtype == dtype


@pytest.mark.parametrize("dtype", FLOATS)
def test_fp8_round_trip_error_bound(device, dtype):
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(64, 96, generator=g) * 3).to(dtype)
    q, s = fp8_quantize(w.to(device))
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.dim() == 0
    amax = w.float().abs().max().item()
    assert s.item() == pytest.approx(amax / 448.0, rel=1e-6)
    deq = fp8_dequantize(q, s).cpu()
    err = (deq - w.float()).abs()
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 (plus 2^-8 for a bf16/fp16 quotient),
    # absolute error <= half the subnormal step 2^-9 near zero
    bound = torch.maximum(w.float().abs() * (2.0**-4 + 2.0**-8), torch.tensor(2.0**-10 * s.item()))
    assert (err <= bound * (1 + 1e-6)).all()
    assert q.float().abs().max().item() == 448.0


def test_fp8_known_values(device):
    w = torch.tensor([448.0, 1.0, -0.5, 1.0625, 1.07, -300.0, 0.001, 0.0], device=device)
    q, s = fp8_quantize(w)
    assert s.item() == 1.0
    assert q.float().cpu().tolist() == [448.0, 1.0, -0.5, 1.0, 1.125, -288.0, 2.0**-9, 0.0]


def test_fp8_matches_modelopt_expression(device):
    # ModelOpt: scale = amax / 448 (0-d float32 tensor); q = (w / scale).to(float8_e4m3fn), with
    # the division done in w's dtype because scale is 0-d.
    g = torch.Generator().manual_seed(9)
    for dtype in FLOATS:
        w = (torch.randn(128, 64, generator=g) ** 3).to(dtype).to(device)
        q, s = fp8_quantize(w)
        amax = torch.maximum(w.max().abs(), w.min().abs()).float()
        scale = amax / 448.0
        assert torch.equal(s, scale)
        assert torch.equal(_bits(q), _bits((w / scale).to(torch.float8_e4m3fn)))


def test_fp8_amax_override_saturates(device):
    w = torch.tensor([448.0, -448.0, 104.0], device=device)
    q, s = fp8_quantize(w, amax=224.0)
    assert s.item() == 0.5
    assert q.float().cpu().tolist() == [448.0, -448.0, 208.0]


@pytest.mark.parametrize("dtype", FLOATS)
def test_requantizing_dequantized_is_idempotent(device, dtype):
    g = torch.Generator().manual_seed(13)
    w = torch.randn(3, 48, 64, generator=g).to(dtype).to(device)
    packed, bs, gs = nvfp4_quantize(w)
    deq = nvfp4_dequantize(packed, bs, gs)
    packed2, bs2, gs2 = nvfp4_quantize(deq)
    codes = unpack_e2m1(packed)
    # code 8 ("-0", a small negative rounded to zero) decodes to 0 and comes back as code 0
    assert torch.equal(torch.where(codes == 8, torch.zeros_like(codes), codes), unpack_e2m1(packed2))
    assert torch.equal(_bits(bs), _bits(bs2))
    # amax' = 6 * 448 * weight_scale_2 up to float32 rounding: the global scale may move one ulp
    torch.testing.assert_close(gs2, gs, rtol=2.0**-22, atol=0)
    torch.testing.assert_close(nvfp4_dequantize(packed2, bs2, gs2), deq, rtol=2.0**-21, atol=0)

    q, s = fp8_quantize(w)
    q2, s2 = fp8_quantize(fp8_dequantize(q, s))
    assert torch.equal(_bits(q), _bits(q2))
    # amax' = 448 * scale in float32; on CUDA "/ 448" is a multiply by float32(1/448): one ulp
    torch.testing.assert_close(s2, s, rtol=2.0**-22, atol=0)


# ------------------------------------------------------------------------------------------
# global-scale forms, experts, shared amax


def test_dequantize_accepts_scalar_forms(device):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 32, generator=g).to(device)
    packed, bs, gs = nvfp4_quantize(w)
    ref = nvfp4_dequantize(packed, bs, gs)
    assert ref.shape == (16, 32) and ref.dtype == torch.float32
    assert torch.equal(nvfp4_dequantize(packed, bs, gs.reshape(1)), ref)
    assert torch.equal(nvfp4_dequantize(packed, bs, gs.item()), ref)
    assert torch.equal(nvfp4_dequantize(packed, bs, gs.cpu()), ref)
    q, s = fp8_quantize(w)
    ref8 = fp8_dequantize(q, s)
    assert torch.equal(fp8_dequantize(q, s.reshape(1)), ref8)
    assert torch.equal(fp8_dequantize(q, s.item()), ref8)


def test_experts_3d_one_global_scale_per_expert(device):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(4, 32, 64, generator=g).to(torch.bfloat16)
    w[1] *= 100
    w[2] *= 1e-3
    w[3] = 0
    packed, bs, gs = nvfp4_quantize(w.to(device))
    assert packed.shape == (4, 32, 32) and bs.shape == (4, 32, 4) and gs.shape == (4,)
    for e in range(4):
        p_e, bs_e, gs_e = nvfp4_quantize(w[e].to(device))
        assert torch.equal(packed[e], p_e)
        assert torch.equal(_bits(bs[e]), _bits(bs_e))
        assert torch.equal(gs[e], gs_e)
    deq = nvfp4_dequantize(packed, bs, gs)
    for e in range(4):
        assert torch.equal(deq[e], nvfp4_dequantize(packed[e], bs[e], gs[e]))


def test_shared_amax_for_fused_gate_up(device):
    g = torch.Generator().manual_seed(6)
    gate = torch.randn(32, 64, generator=g).to(device)
    up = (torch.randn(32, 64, generator=g) * 4).to(device)
    amax = torch.maximum(gate.abs().max(), up.abs().max())
    _, _, gs_gate = nvfp4_quantize(gate, amax=amax)
    _, _, gs_up = nvfp4_quantize(up, amax=float(amax))
    assert torch.equal(gs_gate, gs_up)
    assert torch.equal(gs_up, nvfp4_quantize(up)[2])  # up holds the max
    _, _, gs_alone = nvfp4_quantize(gate)
    assert gs_alone.item() < gs_gate.item()
    # an amax below the true max saturates instead of producing NaN
    p, bs, gs = nvfp4_quantize(up, amax=amax / 100)
    assert bs.float().max().item() == 448.0
    assert torch.isfinite(nvfp4_dequantize(p, bs, gs)).all()
    # per-expert override
    w3 = torch.stack([gate, up])
    _, _, gs3 = nvfp4_quantize(w3, amax=torch.tensor([1.0, 2.0]))
    assert gs3.cpu().tolist() == pytest.approx([1.0 / 2688, 2.0 / 2688], rel=1e-6)


def test_input_scale_for():
    s = input_scale_for(448.0)
    assert s.dtype == torch.float32 and s.dim() == 0 and s.item() == 1.0
    assert input_scale_for(448.0, kind="fp8").item() == 1.0
    assert input_scale_for(2688.0, kind="nvfp4").item() == 1.0
    assert input_scale_for(10.0, kind="nvfp4").item() == pytest.approx(10.0 / 2688.0, rel=1e-7)
    assert input_scale_for(torch.tensor([3.0])).item() == pytest.approx(3.0 / 448.0, rel=1e-7)


# ------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.zeros(4, 20), "multiple of the NVFP4 block size"),
        (torch.zeros(32), "at least 2 dimensions"),
        (torch.zeros(4, 32, dtype=torch.float64), "bfloat16, float16 or float32"),
        (torch.zeros(4, 32, dtype=torch.int32), "bfloat16, float16 or float32"),
        (torch.zeros(0, 32), "empty"),
        (torch.tensor([[float("nan")] + [0.0] * 15]), "NaN or infinite"),
        (torch.tensor([[float("inf")] + [0.0] * 15]), "NaN or infinite"),
    ],
)
def test_nvfp4_quantize_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        nvfp4_quantize(bad)


def test_non_tensor_arguments_raise_type_error():
    with pytest.raises(TypeError, match="torch.Tensor"):
        nvfp4_quantize([[0.0] * 16])
    with pytest.raises(TypeError, match="torch.Tensor"):
        fp8_quantize([1.0])
    with pytest.raises(TypeError, match="torch.Tensor"):
        pack_e2m1([1, 2])
    with pytest.raises(TypeError, match="amax"):
        nvfp4_quantize(torch.randn(2, 16), amax="1.0")
    with pytest.raises(TypeError, match="amax"):
        input_scale_for("3.0")


def test_nvfp4_quantize_amax_errors():
    w = torch.randn(4, 32)
    with pytest.raises(ValueError, match="finite and > 0"):
        nvfp4_quantize(w, amax=0.0)
    with pytest.raises(ValueError, match="finite and > 0"):
        nvfp4_quantize(w, amax=float("nan"))
    with pytest.raises(ValueError, match="shape"):
        nvfp4_quantize(torch.randn(3, 4, 32), amax=torch.ones(2))


def test_dequantize_and_pack_errors():
    packed, bs, gs = nvfp4_quantize(torch.randn(4, 32))
    with pytest.raises(ValueError, match="uint8"):
        nvfp4_dequantize(packed.to(torch.int16), bs, gs)
    with pytest.raises(ValueError, match="does not match"):
        nvfp4_dequantize(packed, bs[:, :1], gs)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        nvfp4_dequantize(packed, bs.view(torch.uint8), gs)
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_dequantize(packed[:, :4], bs[:, :1], gs)
    with pytest.raises(ValueError, match="global_scale"):
        nvfp4_dequantize(packed, bs, torch.ones(3))
    with pytest.raises(ValueError, match=r"\[..., N, K/2\]"):
        nvfp4_dequantize(packed[0], bs[0], gs)
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        pack_e2m1(torch.tensor([1, 16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pack_e2m1(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="uint8"):
        unpack_e2m1(torch.zeros(4, dtype=torch.int8))


def test_fp8_and_input_scale_errors():
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        fp8_quantize(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="NaN or infinite"):
        fp8_quantize(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="empty"):
        fp8_quantize(torch.zeros(0))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_dequantize(torch.zeros(4), 1.0)
    with pytest.raises(ValueError, match="one element"):
        fp8_dequantize(torch.zeros(4).to(torch.float8_e4m3fn), torch.ones(2))
    with pytest.raises(ValueError, match="'fp8' or 'nvfp4'"):
        input_scale_for(1.0, kind="int8")
    with pytest.raises(ValueError, match="finite and > 0"):
        input_scale_for(0.0)
    with pytest.raises(ValueError, match="finite and > 0"):
        input_scale_for(float("inf"), kind="nvfp4")
