"""The one-launch decode router (`vibeqwen_kernels.moe.route_cuda`, `csrc/bf16_mma.cu`).

CPU: the argument checks (the weight layout: tests/kernels/test_bf16_mma.py).
GPU: the kernel on fresh random weights and activations, T = 1..64, against the separate steps it replaces: its
logits against the fp32 GEMM rounded to bf16 (equal up to one bf16 ulp: fp32 sums in another order), its routing against
`fused_router` on its own logits (ids equal, weights to 1e-6), its alignment position for position against
`moe_align` of its ids; routing split by token group against one routing CTA (bit for bit); NaN rows, repeated
launches and CUDA-graph replays (the self-resetting CTA counters), and
`fused_moe` with the kernel's alignment equal to `fused_moe` aligning itself.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from vibeqwen_kernels.moe import route_cuda as R

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_gpu = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU")


def test_prepack_and_argument_checks():
    w = R.prepack_router(torch.randn(32, 256).to(torch.bfloat16), torch.randn(1, 256).to(torch.bfloat16))
    assert w.num_experts == 32 and w.hidden == 256 and w.tiles == 3 and not w.counter.any()
    with pytest.raises(ValueError, match="shared gate"):
        R.prepack_router(torch.randn(32, 256), torch.randn(2, 256))
    with pytest.raises(ValueError, match="x must be bf16"):
        R.fused_route(torch.randn(2, 256), w, 4, 16)
    with pytest.raises(ValueError, match="x must be bf16"):
        R.fused_route(torch.randn(65, 256).to(torch.bfloat16), w, 4, 16)
    with pytest.raises(ValueError, match="block_m"):
        R.fused_route(torch.randn(2, 256).to(torch.bfloat16), w, 4, 24)
    with pytest.raises(ValueError, match="top_k"):
        R.fused_route(torch.randn(2, 256).to(torch.bfloat16), w, 33, 16)
    router, gate = torch.randn(32, 256).to(torch.bfloat16), torch.randn(1, 256).to(torch.bfloat16)
    padded = torch.cat([router, gate, torch.zeros(7, 256, dtype=torch.bfloat16)])  # the model's router GEMM rows
    reused = R.prepack_router(router, gate, packed=R.shuffle_bf16_mma(padded))
    # the padded GEMM weight's copy is the router's own, zero rows and all
    assert torch.equal(reused.packed, R.prepack_router(router, gate).packed)
    with pytest.raises(ValueError, match="packed must be"):
        R.prepack_router(router, gate, packed=R.shuffle_bf16_mma(torch.cat([padded, padded])))
    with pytest.raises(ValueError, match="at most 512"):
        R.prepack_router(torch.randn(513, 256).to(torch.bfloat16), torch.randn(1, 256).to(torch.bfloat16))
    w512 = R.prepack_router(torch.randn(32, 512).to(torch.bfloat16), torch.randn(1, 512).to(torch.bfloat16))
    x = torch.randn(2, 512).to(torch.bfloat16)  # argument checks come before the library lookup (no GPU here)
    with pytest.raises(ValueError, match="logits must be"):
        R.fused_route(x, w512, 4, 16, logits=torch.empty(2, 40))
    with pytest.raises(ValueError, match="debug must be"):
        R.fused_route(x, w512, 4, 16, debug=torch.zeros(16, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="not available"):
        R.fused_route(x, w512, 4, 16)
    w96 = R.prepack_router(torch.randn(8, 96).to(torch.bfloat16), torch.randn(1, 96).to(torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 512"):
        R.fused_route(torch.randn(2, 96).to(torch.bfloat16), w96, 4, 16)
    assert not R.route_supported(w, 1, 8, torch.device("cpu"))


def test_route_warps_rule(monkeypatch):
    monkeypatch.delenv("VIBEQWEN_ROUTE_WIDE", raising=False)
    monkeypatch.delenv("VIBEQWEN_ROUTE_SPLIT", raising=False)
    monkeypatch.delenv("VIBEQWEN_ROUTE_GROUPS", raising=False)
    # split routing (the default from 17 tokens) routes a token a warp in each group's CTA: 16 warps
    assert [R.route_warps(t) for t in (1, 16, 17, 32, 33, 64)] == [16] * 6
    monkeypatch.setenv("VIBEQWEN_ROUTE_SPLIT", "0")  # one CTA routes every token: 32 warps from 17 tokens
    assert [R.route_warps(t) for t in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 32, 32]
    monkeypatch.setenv("VIBEQWEN_ROUTE_WIDE", "0")
    assert R.route_warps(17) == R.route_warps(32) == R.route_warps(64) == 16
    monkeypatch.delenv("VIBEQWEN_ROUTE_WIDE")
    monkeypatch.delenv("VIBEQWEN_ROUTE_SPLIT")
    monkeypatch.setenv("VIBEQWEN_ROUTE_GROUPS", "0")  # one token group: nothing to split
    assert R.route_warps(17) == 32


def test_route_split_rule(monkeypatch):
    monkeypatch.delenv("VIBEQWEN_ROUTE_SPLIT", raising=False)
    # from three token groups (17 tokens): with two the hand-off between the CTAs cost more than it spread
    assert ([R.route_split(t, R.route_groups(t)) for t in (1, 8, 9, 16, 17, 32, 64)]
            == [False, False, False, False, True, True, True])
    assert not R.route_split(32, 1)  # VIBEQWEN_ROUTE_GROUPS=0's grid
    monkeypatch.setenv("VIBEQWEN_ROUTE_SPLIT", "0")
    assert not R.route_split(32, 4)
    # one counter for the whole grid, then one per token group (64 tokens: 8 groups)
    w = R.prepack_router(torch.randn(32, 512).to(torch.bfloat16), torch.randn(1, 512).to(torch.bfloat16))
    assert w.counter.shape == (1 + R.ROUTE_MAX_T // 8,) and not w.counter.any()


def test_route_batch_loads_switch(monkeypatch):
    monkeypatch.delenv("VIBEQWEN_ROUTE_BATCH_LOADS", raising=False)
    assert R.route_batch_loads()
    monkeypatch.setenv("VIBEQWEN_ROUTE_BATCH_LOADS", "0")
    assert not R.route_batch_loads()


def test_route_model_max_t(monkeypatch):
    monkeypatch.delenv("VIBEQWEN_ROUTE_MAX_T", raising=False)
    assert R.route_model_max_t() == R.ROUTE_MODEL_MAX_T
    monkeypatch.setenv("VIBEQWEN_ROUTE_MAX_T", "64")
    assert R.route_model_max_t() == 64
    for bad in ("65", "-1", "x"):
        monkeypatch.setenv("VIBEQWEN_ROUTE_MAX_T", bad)
        with pytest.raises(ValueError, match="VIBEQWEN_ROUTE_MAX_T must be an integer from 0 to 64"):
            R.route_model_max_t()


def test_route_groups_rule(monkeypatch):
    monkeypatch.delenv("VIBEQWEN_ROUTE_GROUPS", raising=False)
    assert [R.route_groups(t) for t in (1, 8, 9, 16, 17, 32, 33, 64)] == [1, 1, 2, 2, 3, 4, 5, 8]
    monkeypatch.setenv("VIBEQWEN_ROUTE_GROUPS", "0")
    assert R.route_groups(9) == R.route_groups(64) == 1
    # the debug buffer takes two stamps per CTA of the grid (tiles x groups: 3 x 2 here)
    w = R.prepack_router(torch.randn(32, 512).to(torch.bfloat16), torch.randn(1, 512).to(torch.bfloat16))
    monkeypatch.delenv("VIBEQWEN_ROUTE_GROUPS")
    short = torch.zeros(16 + 2 * 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=f"debug must be a contiguous int64 tensor of >= {16 + 2 * 3 * 2} "):
        R.fused_route(torch.randn(9, 512).to(torch.bfloat16), w, 4, 16, debug=short)


# ------------------------------------------------------------------------------------------------ GPU


def _setup(e: int, k: int, seed: int, dev="cuda"):
    gen = torch.Generator(device=dev).manual_seed(seed)
    router = (torch.randn(e, k, generator=gen, device=dev) * 0.05).to(torch.bfloat16)
    gate = (torch.randn(1, k, generator=gen, device=dev) * 0.05).to(torch.bfloat16)
    return router, gate, R.prepack_router(router, gate), gen


def _outputs_under(monkeypatch, name, values, x, w):
    """{value: fused_route's outputs and its logits (NaN-prefilled: an unwritten entry stays NaN)} with the
    environment switch `name` at each value (top_k 8, 16-pair blocks)."""
    outs = {}
    for v in values:
        monkeypatch.setenv(name, v)
        logits = torch.full((x.shape[0], 16 * w.tiles), float("nan"), device=x.device)
        outs[v] = (*R.fused_route(x, w, 8, 16, logits=logits), logits)
    return outs


def _same(a, b):
    """Equal bit for bit, NaN where NaN (a NaN token's routing weights)."""
    return torch.equal(a, b) or (a.dtype.is_floating_point and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)))


def _check_one(x, router, gate, w, top_k, block_m):
    from vibeqwen_kernels.moe import fused as F

    t = x.shape[0]
    tw, ti, sorted_ids, block_expert, num_padded = R.fused_route(x, w, top_k, block_m)
    logits = torch.empty((t, 16 * w.tiles), device=x.device, dtype=torch.float32)
    tw2, ti2, s2, _b2, n2 = R.fused_route(x, w, top_k, block_m, logits=logits)
    torch.cuda.synchronize()
    # deterministic, and the counter reset between launches
    assert torch.equal(tw, tw2) and torch.equal(ti, ti2) and torch.equal(sorted_ids, s2) and torch.equal(n2, num_padded)
    assert not w.counter.any()
    e = router.shape[0]
    ref = (x.float() @ torch.cat([router, gate]).float().t()).to(torch.bfloat16).float()  # fp32 GEMM, bf16 once
    got = logits[:, : e + 1]
    mag = torch.maximum(got.abs(), ref.abs())  # one bf16 ulp of the larger, plus the fp32 sums' order difference
    scale = (x.float().abs() @ torch.cat([router, gate]).float().abs().t()) * 2.0 ** -16
    assert ((got - ref).abs() <= mag * 2.0 ** -7 + scale).all()
    assert (got == ref).float().mean() > 0.9
    assert torch.equal(logits[:, e + 1 :], torch.zeros_like(logits[:, e + 1 :]))
    rw, ri = F.fused_router(got.contiguous(), top_k)
    assert torch.equal(ti, ri)
    torch.testing.assert_close(tw, rw, rtol=1e-5, atol=1e-6)  # __expf, times 1 / sum
    s_ref, b_ref, n_ref = F.moe_align(ti, e + 1, block_m)
    assert torch.equal(sorted_ids, s_ref) and torch.equal(block_expert, b_ref) and torch.equal(num_padded, n_ref)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [1, 2, 3, 7, 8, 9, 16, 17, 31, 32, 33, 48, 63, 64])
def test_gpu_matches_the_separate_steps(t):
    if R.bf16_mma_library(torch.device("cuda")) is None:
        pytest.skip("bf16_mma.cu does not build here")
    router, gate, w, gen = _setup(256, 2048, 100 + t)
    for _ in range(2):  # fresh inputs, the same weight (and counter)
        x = torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16)
        _check_one(x, router, gate, w, 8, 16)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [17, 24, 32, 40, 64])
def test_gpu_wide_router_equals_narrow(t, monkeypatch):
    """17-64 tokens run on 32 warps (one or two tokens a routing warp); with VIBEQWEN_ROUTE_WIDE=0 on 16: the same
    bits."""
    if R.bf16_mma_library(torch.device("cuda")) is None:
        pytest.skip("bf16_mma.cu does not build here")
    monkeypatch.delenv("VIBEQWEN_ROUTE_WIDE", raising=False)
    monkeypatch.setenv("VIBEQWEN_ROUTE_SPLIT", "0")  # the warps of a CTA that routes every token
    assert R.route_warps(t) == R.ROUTE_WIDE_WARPS and R.route_warps(16) == 16
    router, gate, w, gen = _setup(256, 2048, 300 + t)
    for _ in range(3):
        x = torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16)
        outs = _outputs_under(monkeypatch, "VIBEQWEN_ROUTE_WIDE", ("1", "0"), x, w)
        assert all(torch.equal(a, b) for a, b in zip(outs["1"], outs["0"]))
        monkeypatch.setenv("VIBEQWEN_ROUTE_WIDE", "1")
        _check_one(x, router, gate, w, 8, 16)  # the wide kernel against the separate steps
    monkeypatch.setenv("VIBEQWEN_ROUTE_WIDE", "0")
    assert R.route_warps(t) == 16


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t,wide", [(9, "1"), (16, "1"), (17, "1"), (17, "0"), (31, "1"), (32, "1"), (32, "0"),
                                    (33, "1"), (64, "1"), (64, "0")])
def test_gpu_token_groups_equal_one_group(t, wide, monkeypatch):
    """One n8 token tile per CTA (ceil(t / 8) token groups, the default) against every token in each CTA
    (VIBEQWEN_ROUTE_GROUPS=0): the same logits, routing and alignment bit for bit; and each token's logits are those
    of the token routed alone (the router's sums do not depend on the batch)."""
    if R.bf16_mma_library(torch.device("cuda")) is None:
        pytest.skip("bf16_mma.cu does not build here")
    monkeypatch.setenv("VIBEQWEN_ROUTE_WIDE", wide)
    router, gate, w, gen = _setup(256, 2048, 500 + t)
    for _ in range(2):
        x = torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16)
        outs = _outputs_under(monkeypatch, "VIBEQWEN_ROUTE_GROUPS", ("0", "1"), x, w)
        assert all(torch.equal(a, b) for a, b in zip(outs["1"], outs["0"]))
        for i in (0, t // 2, t - 1):
            alone = torch.full((1, 16 * w.tiles), float("nan"), device="cuda")
            R.fused_route(x[i:i + 1], w, 8, 16, logits=alone)
            assert torch.equal(alone[0], outs["1"][-1][i])
        _check_one(x, router, gate, w, 8, 16)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [17, 24, 31, 32, 33, 48, 64])
def test_gpu_split_routing_equals_one_routing_cta(t, monkeypatch):
    """Routing split by token group (the last CTA of each group routes its tokens, the last of those aligns; the
    default from 17 tokens) against one CTA routing every token (VIBEQWEN_ROUTE_SPLIT=0, 32 warps from 17 tokens):
    the same logits, weights, ids and alignment bit for bit, over repeated launches (the counters reset) and a NaN
    token."""
    if R.bf16_mma_library(torch.device("cuda")) is None:
        pytest.skip("bf16_mma.cu does not build here")
    monkeypatch.delenv("VIBEQWEN_ROUTE_WIDE", raising=False)
    monkeypatch.delenv("VIBEQWEN_ROUTE_GROUPS", raising=False)
    monkeypatch.delenv("VIBEQWEN_ROUTE_SPLIT", raising=False)
    assert R.route_split(t, R.route_groups(t))  # the default here: the two runs below take different paths

    router, gate, w, gen = _setup(256, 2048, 700 + t)
    for rep in range(3):
        x = torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16)
        if rep == 2:
            x[t // 2, 7] = float("nan")
        first = _outputs_under(monkeypatch, "VIBEQWEN_ROUTE_SPLIT", ("1",), x, w)["1"]
        outs = _outputs_under(monkeypatch, "VIBEQWEN_ROUTE_SPLIT", ("0", "1"), x, w)  # split after one CTA's
        torch.cuda.synchronize()
        assert all(_same(a, b) for a, b in zip(outs["1"], outs["0"]))
        assert all(_same(a, b) for a, b in zip(first, outs["1"]))
        assert not w.counter.any()
        if rep < 2:
            monkeypatch.setenv("VIBEQWEN_ROUTE_SPLIT", "1")
            _check_one(x, router, gate, w, 8, 16)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t,split", [(1, "1"), (2, "1"), (8, "1"), (9, "1"), (16, "1"), (17, "1"), (17, "0"),
                                     (32, "1"), (32, "0"), (33, "1"), (64, "1"), (64, "0")])
def test_gpu_batched_loads_change_no_value(t, split, monkeypatch):
    """Every logit load of a routing lane issued before any is used (VIBEQWEN_ROUTE_BATCH_LOADS=1, its own kernel
    instantiations) against the default kernels: the same logits, weights, ids and alignment bit for bit, with a NaN
    token too, on each kernel shape (16 and 32 warps, one routing CTA or one a token group)."""
    if R.bf16_mma_library(torch.device("cuda")) is None:
        pytest.skip("bf16_mma.cu does not build here")
    monkeypatch.delenv("VIBEQWEN_ROUTE_WIDE", raising=False)
    monkeypatch.delenv("VIBEQWEN_ROUTE_GROUPS", raising=False)
    monkeypatch.setenv("VIBEQWEN_ROUTE_SPLIT", split)

    router, gate, w, gen = _setup(256, 2048, 900 + t)
    for rep in range(3):
        x = torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16)
        if rep == 2:
            x[t // 2, 3] = float("nan")
        outs = _outputs_under(monkeypatch, "VIBEQWEN_ROUTE_BATCH_LOADS", ("1", "0"), x, w)
        torch.cuda.synchronize()
        assert all(_same(a, b) for a, b in zip(outs["1"], outs["0"])), f"T={t}, split {split}, draw {rep}"
        assert not w.counter.any()
        if rep < 2:
            monkeypatch.setenv("VIBEQWEN_ROUTE_BATCH_LOADS", "1")
            _check_one(x, router, gate, w, 8, 16)  # the batched kernels against the separate steps


@pytest.mark.gpu
@requires_gpu
def test_gpu_launcher_rejects_a_grid_that_does_not_fit(monkeypatch):
    """groups must be 1 or ceil(T / 8): another value is a launch error, not a wrong routing."""
    if R.bf16_mma_library(torch.device("cuda")) is None:
        pytest.skip("bf16_mma.cu does not build here")
    _router, _gate, w, gen = _setup(256, 2048, 7)
    x = torch.randn(8, 2048, generator=gen, device="cuda").to(torch.bfloat16)
    monkeypatch.setattr(R, "route_groups", lambda t: 2)
    with pytest.raises(RuntimeError, match="launch failed with CUDA error"):
        R.fused_route(x, w, 8, 16)
    monkeypatch.undo()
    R.fused_route(x, w, 8, 16)  # and the next launch runs (nothing was launched)
    torch.cuda.synchronize()
    assert not w.counter.any()


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("e,k,top_k,block_m,t", [(256, 2048, 8, 32, 40), (64, 512, 4, 16, 20), (512, 1024, 16, 16, 64),
                                                 (8, 512, 8, 16, 5), (256, 2048, 1, 64, 64)])
def test_gpu_other_shapes(e, k, top_k, block_m, t):
    if R.bf16_mma_library(torch.device("cuda")) is None:
        pytest.skip("bf16_mma.cu does not build here")
    router, gate, w, gen = _setup(e, k, e + k + t)
    x = torch.randn(t, k, generator=gen, device="cuda").to(torch.bfloat16)
    _check_one(x, router, gate, w, top_k, block_m)


@pytest.mark.gpu
@requires_gpu
def test_gpu_strided_rows_nan_rows_and_graph_replay():
    from vibeqwen_kernels.moe import fused as F

    if R.bf16_mma_library(torch.device("cuda")) is None:
        pytest.skip("bf16_mma.cu does not build here")
    router, gate, w, gen = _setup(256, 2048, 7)
    big = torch.randn(12, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    x = big[:, 1000:3048]  # row stride 4096, offset 2000 bytes
    _check_one(x, router, gate, w, 8, 16)
    xn = torch.randn(4, 2048, generator=gen, device="cuda").to(torch.bfloat16)
    xn[2, 5] = float("nan")
    tw, ti, s, b, _n = R.fused_route(xn, w, 8, 16)
    torch.cuda.synchronize()
    assert ((ti >= 0) & (ti <= 256)).all() and not w.counter.any()
    assert torch.isfinite(tw[[0, 1, 3]]).all()
    s_ref, b_ref, _n_ref = F.moe_align(ti, 257, 16)
    assert torch.equal(s, s_ref) and torch.equal(b, b_ref)
    # CUDA graph: replays over new inputs give what eager launches give
    xs = torch.randn(32, 2048, generator=gen, device="cuda").to(torch.bfloat16)
    outs = R.fused_route(xs, w, 8, 16)  # warm up (builds, allocates)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        outs = R.fused_route(xs, w, 8, 16)
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(3):
        xs.copy_(torch.randn(32, 2048, generator=gen, device="cuda").to(torch.bfloat16))
        graph.replay()
        want = R.fused_route(xs, w, 8, 16)
        torch.cuda.synchronize()
        for a, bb in zip(outs, want):
            assert torch.equal(a, bb), i
    assert not w.counter.any()


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [1, 8, 32, 64])
def test_gpu_fused_moe_with_the_kernels_alignment(t):
    from vibeqwen_kernels.moe import fused as F

    if R.bf16_mma_library(torch.device("cuda")) is None:
        pytest.skip("bf16_mma.cu does not build here")
    from vibeqwen.checkpoint.quant import nvfp4_quantize

    trip = []  # random NVFP4 experts at the model's shapes (E + 1 = 257, H = 2048, I = 512)
    for n, k in ((512, 2048), (512, 2048), (2048, 512)):
        p, sc, g = nvfp4_quantize(torch.randn(257, n, k, device="cuda") / k**0.5)
        trip.append([(p[i], sc[i], g[i]) for i in range(257)])
    experts = F.prepack_moe_nvfp4(*trip, device=torch.device("cuda"))
    _router, _gate, w, gen = _setup(256, 2048, 300 + t)
    x = torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16)
    cfg = F.pick_moe_config(t, 9, 257)
    tw, ti, s, b, _ = R.fused_route(x, w, 8, cfg["BLOCK_M"])
    got = F.fused_moe(x, tw, ti, experts, cfg, align=(s, b, cfg["BLOCK_M"]))
    want = F.fused_moe(x, tw, ti, experts, cfg)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="bounds"):  # an alignment made for other shapes is refused
        F.fused_moe(x, tw, ti, experts, cfg, align=(s[:-16], b[:-1], cfg["BLOCK_M"]))
