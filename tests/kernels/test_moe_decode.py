"""The one-launch decode MoE (`vibeqwen_kernels.moe.decode_cuda`, `csrc/moe_decode.cu`).

CPU: the argument checks, and that nothing runs without the GPU.
GPU: on fresh random full-size weights (256 routed NVFP4 experts + the shared one, H 2048, I 512) and activations,
T = 1..8, the kernel against the launches it replaces (`fused_route`, then `fused_moe` with that alignment): the
routing (weights and ids) equal bit for bit, the output equal up to bf16 roundings of fp32 sums taken in another
order (relative L2 difference under 1e-3, most values equal; a wrong tile, expert or weight gives differences of
order one), deterministic across launches; the grid barrier's counter back at 0 after every launch; CUDA-graph
replays captured with early launch (the decode graphs' mode) over new inputs; strided input rows and a NaN row
(in-range ids, the other tokens finite); a single token's fast expert list against the general one (top_k 7 and 8,
NaN router rows); 16 warps a CTA against 8 (the same routing, outputs up to bf16 roundings), through the same
checks; the shared expert's gate|up during the routing against before the first barrier (the same bits). CPU: top_k
below 7 is refused (the kernel's down phase needs 7 distinct experts).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from vibeqwen_kernels.moe import decode_cuda as D
from vibeqwen_kernels.moe import route_cuda as R

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_gpu = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU")


class _FakeExperts:  # what moe_decode reads of MoEWeights, for the CPU checks
    def __init__(self, e, h=2048, i=512, mma=True):
        from vibeqwen_kernels.moe.mma_cuda import MMAWeights

        self.num_experts, self.hidden, self.intermediate = e, h, i
        self.device = torch.device("cpu")
        self.w13_mma = MMAWeights(torch.empty(0), torch.empty(0), 2 * i, h, True) if mma else None
        self.w2_mma = MMAWeights(torch.empty(0), torch.empty(0), h, i) if mma else None


def test_fast_list_switch(monkeypatch):
    monkeypatch.delenv("VIBEQWEN_MOE_DECODE_FAST_LIST", raising=False)
    assert D.fast_list()
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_FAST_LIST", "0")
    assert not D.fast_list()


def test_early_scales_switch(monkeypatch):
    monkeypatch.delenv("VIBEQWEN_MOE_DECODE_EARLY_SCALES", raising=False)
    assert D.early_scales()
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_EARLY_SCALES", "0")
    assert not D.early_scales()


def test_ring_slots_switch(monkeypatch):
    monkeypatch.delenv("VIBEQWEN_MOE_DECODE_RING", raising=False)
    assert D.ring_slots(1) == D.ring_slots(8) == 16
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_RING", "8")
    assert D.ring_slots(1) == D.ring_slots(8) == 8
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_RING", "32")
    assert (D.ring_slots(4), D.ring_slots(5)) == (32, 16)  # 32 slots only where the h columns leave room
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_RING", "12")
    with pytest.raises(ValueError, match="VIBEQWEN_MOE_DECODE_RING must be 8, 16 or 32"):
        D.ring_slots(1)


def test_shared_late_switch(monkeypatch):
    monkeypatch.delenv("VIBEQWEN_MOE_DECODE_SHARED_LATE", raising=False)
    assert D.shared_late()
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_SHARED_LATE", "0")
    assert not D.shared_late()


def test_tagged_logits_switch(monkeypatch):
    monkeypatch.delenv("VIBEQWEN_MOE_DECODE_TAGGED", raising=False)
    assert D.tagged_logits()
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_TAGGED", "0")
    assert not D.tagged_logits()


def test_logit_copies_switch(monkeypatch):
    monkeypatch.delenv("VIBEQWEN_MOE_DECODE_LOGIT_COPIES", raising=False)
    assert D.logit_copies() == 1
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_LOGIT_COPIES", "8")
    assert D.logit_copies() == 8
    for bad in ("0", "9", "two", ""):
        monkeypatch.setenv("VIBEQWEN_MOE_DECODE_LOGIT_COPIES", bad)
        with pytest.raises(ValueError, match="LOGIT_COPIES must be an integer from 1 to 8"):
            D.logit_copies()


def test_decode_warps_switch(monkeypatch):
    monkeypatch.delenv("VIBEQWEN_MOE_DECODE_WARPS", raising=False)
    assert D.decode_warps() == 16
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_WARPS", "8")
    assert D.decode_warps() == 8
    for bad in ("12", "sixteen", ""):
        monkeypatch.setenv("VIBEQWEN_MOE_DECODE_WARPS", bad)
        with pytest.raises(ValueError, match="VIBEQWEN_MOE_DECODE_WARPS must be 8 or 16"):
            D.decode_warps()


def test_argument_checks_on_the_cpu():
    route = R.prepack_router(torch.randn(256, 2048).to(torch.bfloat16), torch.randn(1, 2048).to(torch.bfloat16))
    ws = D.make_workspace(route.tiles, 8, 512, torch.device("cpu"))
    assert int(ws.sync.abs().sum()) == 0 and tuple(ws.h.shape) == (72, 512) and tuple(ws.logits.shape) == (8, 8, 272)
    assert ws.logits.dtype == torch.int64 and int(ws.logits.abs().sum()) == 0  # tagged words, no launch's tag yet
    assert ws.h.dtype == torch.bfloat16
    experts = _FakeExperts(257)
    x = torch.randn(2, 2048).to(torch.bfloat16)
    with pytest.raises(ValueError, match="x must be bf16"):
        D.moe_decode(torch.randn(9, 2048).to(torch.bfloat16), route, experts, 8, ws)
    with pytest.raises(ValueError, match="x must be bf16"):
        D.moe_decode(torch.randn(2, 2048), route, experts, 8, ws)
    with pytest.raises(ValueError, match="top_k"):
        D.moe_decode(x, route, experts, 9, ws)
    with pytest.raises(ValueError, match="need 7 <= top_k"):  # the down phase needs >= 7 distinct experts
        D.moe_decode(x, route, experts, 4, D.make_workspace(route.tiles, 4, 512, torch.device("cpu")))
    with pytest.raises(ValueError, match="experts"):
        D.moe_decode(x, route, _FakeExperts(257, mma=False), 8, ws)
    with pytest.raises(ValueError, match="experts"):
        D.moe_decode(x, route, _FakeExperts(129), 8, ws)
    with pytest.raises(ValueError, match="workspace"):
        D.moe_decode(x, route, experts, 7, ws)
    with pytest.raises(ValueError, match="workspace"):  # fp32 logits: the layout before the tags
        D.moe_decode(x, route, experts, 8, D.DecodeWorkspace(ws.logits.float(), ws.h, ws.sync))
    with pytest.raises(ValueError, match="workspace"):  # int64 h: the tagged words of an earlier version
        D.moe_decode(x, route, experts, 8, D.DecodeWorkspace(ws.logits, torch.zeros(72, 256, dtype=torch.int64),
                                                             ws.sync))
    with pytest.raises(ValueError, match="out must be"):
        D.moe_decode(x, route, experts, 8, ws, out=torch.empty(3, 2048, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="topk must be"):
        D.moe_decode(x, route, experts, 8, ws, topk=(torch.empty(2, 9), torch.empty(2, 9)))
    with pytest.raises(RuntimeError, match="cannot run"):
        D.moe_decode(x, route, experts, 8, ws)
    small = R.prepack_router(torch.randn(256, 1024).to(torch.bfloat16), torch.randn(1, 1024).to(torch.bfloat16))
    with pytest.raises(ValueError, match="router must be"):
        D.moe_decode(x, small, experts, 8, ws)
    assert not D.decode_supported(route, experts, 1, 8, torch.device("cpu"))
    assert not D.decode_supported(route, experts, 9, 8, torch.device("cpu"))


# ------------------------------------------------------------------------------------------------ GPU


@pytest.fixture(scope="module")
def model_moe():
    """Random NVFP4 experts at the model's shapes (E + 1 = 257, H 2048, I 512) and a router for them."""
    from vibeqwen.checkpoint.quant import nvfp4_quantize
    from vibeqwen_kernels.moe import fused as F

    dev = torch.device("cuda")
    if D.decode_library(dev) is None or R.bf16_mma_library(dev) is None:
        pytest.skip("moe_decode.cu / bf16_mma.cu do not build here")
    gen = torch.Generator(device=dev).manual_seed(1234)
    trip = []
    for n, k in ((512, 2048), (512, 2048), (2048, 512)):
        p, sc, g = nvfp4_quantize(torch.randn(257, n, k, device=dev, generator=gen) / k**0.5)
        trip.append([(p[i], sc[i], g[i]) for i in range(257)])
    experts = F.prepack_moe_nvfp4(*trip, device=dev)
    router = (torch.randn(256, 2048, generator=gen, device=dev) * 0.05).to(torch.bfloat16)
    gate = (torch.randn(1, 2048, generator=gen, device=dev) * 0.05).to(torch.bfloat16)
    route = R.prepack_router(router, gate)
    ws = D.make_workspace(route.tiles, 8, 512, dev)
    return route, experts, ws, gen


def _chain(x, route, experts, top_k=8):
    """The launches the kernel replaces (SparseMoE's path for 1-8 tokens before it: fused_route, then fused_moe)."""
    from vibeqwen_kernels.moe import fused as F

    t = x.shape[0]
    cfg = F.pick_moe_config(t, top_k + 1, experts.num_experts, hidden=2048, intermediate=512)
    tw, ti, s, b, _ = R.fused_route(x, route, top_k, cfg["BLOCK_M"])
    return tw, ti, F.fused_moe(x, tw, ti, experts, cfg, align=(s, b, cfg["BLOCK_M"]))


def _graph_of(pairs, route, experts, top_k, ws):
    """A CUDA graph of one moe_decode launch per (x, y) of `pairs` (x into y), back to back (as the layers of a step:
    the barrier resets between launches), captured with early launch (the decode graphs' mode)."""
    from vibeqwen_kernels.pdl import early_launch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with early_launch(), torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for x, y in pairs:
            D.moe_decode(x, route, experts, top_k, ws, out=y)
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def _graph_of_three(x, route, experts, top_k, ws, y):
    """A graph of three launches of x into y (:func:`_graph_of`)."""
    return _graph_of([(x, y)] * 3, route, experts, top_k, ws)


def _launch(x, route, experts, top_k, ws):
    """One moe_decode launch with the routing received: (output, routing weights, ids)."""
    t, kp = x.shape[0], top_k + 1
    tw, ti = torch.empty(t, kp, device="cuda"), torch.empty(t, kp, device="cuda", dtype=torch.int32)
    return D.moe_decode(x, route, experts, top_k, ws, topk=(tw, ti)), tw, ti


def _replays_match_eager(route, experts, top_k, ws, gen, switch, what):
    """A one-token graph of three launches captured with the switches set now, then `switch()` (which changes them)
    and two replays over new inputs, each equal bit for bit to an eager launch under the changed switches."""
    x = torch.randn(1, 2048, generator=gen, device="cuda").to(torch.bfloat16)
    y = torch.empty(1, 2048, device="cuda", dtype=torch.bfloat16)
    graph = _graph_of_three(x, route, experts, top_k, ws, y)
    switch()
    for i in range(2):
        x.copy_(torch.randn(1, 2048, generator=gen, device="cuda").to(torch.bfloat16))
        graph.replay()
        eager = D.moe_decode(x, route, experts, top_k, ws)
        torch.cuda.synchronize()
        _assert_same(y, eager, f"replay {i} ({what}) against an eager launch without")


def _assert_same(got, want, what):
    if not torch.equal(got, want):
        diff = (got.float() - want.float()).abs()
        pytest.fail(f"{what}: {int((got != want).sum())} of {got.numel()} values differ, max |diff| "
                    f"{diff.max().item():.3g} (scale {want.float().abs().max().item():.3g})")


def _assert_close(got, want, what):
    """Equal up to bf16 roundings of fp32 sums taken in another order: more than 90% of values equal, and a relative
    L2 difference below bf16's unit roundoff (2^-8). The two paths round h to bf16 after gate|up sums in another
    order (the one launch adds four K quarters), and each h element that rounds the other way moves the token's
    outputs by W_down times that rounding step; 2^-8 is a rough scale of that, not a bound. (Measured 2.8e-4 to
    1.5e-3 on random draws; 1e-3 failed one draw on an H100, thirty-eighth session.)"""
    assert bool(torch.isfinite(got.float()).all()), what
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    equal = (got == want).float().mean().item()
    assert rel < 2.0 ** -8 and equal > 0.9, f"{what}: relative L2 difference {rel:.3g}, {100 * equal:.1f}% equal"


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("warps", ["8", "16"])
@pytest.mark.parametrize("t", [1, 2, 3, 4, 5, 8])
def test_gpu_equals_the_launches_it_replaces(model_moe, monkeypatch, t, warps):
    route, experts, ws, gen = model_moe
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_WARPS", warps)
    assert D.decode_supported(route, experts, t, 8, torch.device("cuda"))
    for _ in range(2):  # fresh inputs, the same workspace (and barrier counter)
        x = torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16)
        tw, ti = torch.empty(t, 9, device="cuda"), torch.empty(t, 9, device="cuda", dtype=torch.int32)
        got = D.moe_decode(x, route, experts, 8, ws, topk=(tw, ti))
        again = D.moe_decode(x, route, experts, 8, ws)
        want_w, want_i, want = _chain(x, route, experts)
        torch.cuda.synchronize()
        assert int(ws.sync[0]) == 0
        _assert_same(ti, want_i, "ids")
        _assert_same(tw, want_w, "routing weights")
        _assert_same(again, got, "a second launch")
        _assert_close(got, want, "output")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("warps", ["8", "16"])
def test_gpu_graph_replays_with_early_launch(model_moe, monkeypatch, warps):
    route, experts, ws, gen = model_moe
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_WARPS", warps)
    for t in (1, 6):
        x = torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16)
        y = torch.empty(t, 2048, device="cuda", dtype=torch.bfloat16)
        D.moe_decode(x, route, experts, 8, ws, out=y)  # warm up
        graph = _graph_of_three(x, route, experts, 8, ws, y)
        for i in range(3):
            x.copy_(torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16))
            graph.replay()
            want = _chain(x, route, experts)[2]
            eager = D.moe_decode(x, route, experts, 8, ws)
            torch.cuda.synchronize()
            _assert_same(y, eager, f"replay {i} at T={t} against an eager launch")
            _assert_close(y, want, f"replay {i} at T={t}")
        assert int(ws.sync[0]) == 0


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("top_k", [7, 8])
def test_gpu_sixteen_warps_against_eight(model_moe, monkeypatch, top_k):
    """16 warps a CTA (the default) against 8 (VIBEQWEN_MOE_DECODE_WARPS=8): the same routing bit for bit (the router's
    K ranges are summed in the same order), the output equal up to bf16 roundings (a down row is summed in up to three
    pieces instead of two), for top_k 7 (runs of 4 down chunks a warp, the shortest) and 8, 1-8 tokens; and both
    against the launches the kernel replaces where those run the tuned path (top_k 8: k' = 9, configs/) or one token.
    (At top_k 7 fused_moe takes its untuned heuristic config, whose Triton kernels round otherwise: at 7 tokens a
    16-warp output was 2.8e-3 away from it in relative L2 with 62% of values equal, an H100, forty-sixth session.)"""
    route, experts, ws, gen = model_moe
    if top_k != 8:
        ws = D.make_workspace(route.tiles, top_k, 512, torch.device("cuda"))
    for t in (1, 2, 7, 8):
        x = torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16)
        got = {}
        for warps in ("8", "16"):
            monkeypatch.setenv("VIBEQWEN_MOE_DECODE_WARPS", warps)
            assert D.decode_supported(route, experts, t, top_k, torch.device("cuda"))
            got[warps] = _launch(x, route, experts, top_k, ws)
        torch.cuda.synchronize()
        _assert_same(got["16"][2], got["8"][2], f"top_k {top_k}, T={t}: ids")
        _assert_same(got["16"][1], got["8"][1], f"top_k {top_k}, T={t}: routing weights")
        _assert_close(got["16"][0], got["8"][0], f"top_k {top_k}, T={t}: output against 8 warps'")
        if top_k == 8 or t == 1:
            want = _chain(x, route, experts, top_k)[2]
            for warps in ("8", "16"):
                _assert_close(got[warps][0], want, f"top_k {top_k}, T={t}, {warps} warps: output against the chain")
    assert int(ws.sync[0]) == 0


@pytest.mark.gpu
@requires_gpu
def test_gpu_router_hold_changes_no_value(model_moe, monkeypatch):
    """The router tile's weights loaded whole before the PDL wait (ROUTER_HOLD, the default) or two k16 steps there and
    the rest after it: the same logits, so the same routing and output bit for bit, eagerly and in a graph replay
    captured with early launch (where the early loads happen)."""
    route, experts, ws, gen = model_moe
    for t in (1, 2, 5, 8):
        x = torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16)
        got = {}
        for hold in (True, False):
            monkeypatch.setattr(D, "ROUTER_HOLD", hold)
            got[hold] = _launch(x, route, experts, 8, ws)
        torch.cuda.synchronize()
        for a, b, what in zip(got[True], got[False], ("output", "routing weights", "ids")):
            _assert_same(a, b, f"T={t}: {what}")
    monkeypatch.setattr(D, "ROUTER_HOLD", True)
    _replays_match_eager(route, experts, 8, ws, gen, lambda: monkeypatch.setattr(D, "ROUTER_HOLD", False), "hold")
    assert int(ws.sync[0]) == 0


@pytest.mark.gpu
@requires_gpu
def test_gpu_ring_slots_change_no_value(model_moe, monkeypatch):
    """16 ring slots per warp (8 warps' default), 8, or 32 (VIBEQWEN_MOE_DECODE_RING; 32 up to 4 tokens): the same
    chunks multiplied in the same order, so the same routing and output bit for bit."""
    route, experts, ws, gen = model_moe
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_WARPS", "8")  # (16 warps take 8 slots whatever the ring)
    for t, rings in ((1, ("8", "32")), (3, ("8", "32")), (4, ("32",)), (6, ("8",))):
        x = torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16)
        got = {}
        for ring in (None, *rings):
            if ring is None:
                monkeypatch.delenv("VIBEQWEN_MOE_DECODE_RING", raising=False)
            else:
                monkeypatch.setenv("VIBEQWEN_MOE_DECODE_RING", ring)
            assert D.ring_slots(t) == int(ring or 16)
            got[ring] = _launch(x, route, experts, 8, ws)
        torch.cuda.synchronize()
        for ring in rings:
            for a, b, what in zip(got[None], got[ring], ("output", "routing weights", "ids")):
                _assert_same(a, b, f"T={t}, {ring} slots against 16: {what}")
    assert int(ws.sync[0]) == 0


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("top_k", [7, 8])
def test_gpu_fast_list_changes_no_value(model_moe, monkeypatch, top_k):
    """A one-token launch lists its experts from its own ids (the default) or through the general path
    (VIBEQWEN_MOE_DECODE_FAST_LIST=0): the same lists, so the same routing and output bit for bit, for top_k 7 and 8,
    with a router whose NaN rows rank as -inf among finite ones, eagerly and in a graph replay captured with early
    launch."""
    route, experts, ws, gen = model_moe
    if top_k != 8:
        ws = D.make_workspace(route.tiles, top_k, 512, torch.device("cuda"))
    router = (torch.randn(256, 2048, generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
    router[[3, 77, 200]] = float("nan")  # experts 3, 77, 200: NaN logits, never chosen
    poisoned = R.prepack_router(router, (torch.randn(1, 2048, generator=gen, device="cuda") * 0.05).to(torch.bfloat16))
    for r in (route, poisoned):
        assert D.decode_supported(r, experts, 1, top_k, torch.device("cuda"))
        for _ in range(2):
            x = torch.randn(1, 2048, generator=gen, device="cuda").to(torch.bfloat16)
            got = {}
            for fast in ("1", "0"):
                monkeypatch.setenv("VIBEQWEN_MOE_DECODE_FAST_LIST", fast)
                got[fast] = _launch(x, r, experts, top_k, ws)
            _want_w, want_i, want = _chain(x, r, experts, top_k)
            torch.cuda.synchronize()
            for a, b, what in zip(got["1"], got["0"], ("output", "routing weights", "ids")):
                _assert_same(a, b, f"top_k {top_k}: fast list against the general one: {what}")
            _assert_same(got["1"][2], want_i, f"top_k {top_k}: ids against fused_route")
            _assert_close(got["1"][0], want, f"top_k {top_k}: output against the launches it replaces")
            ids = got["1"][2][0, :top_k]
            assert ids.unique().numel() == top_k
            if r is poisoned:  # (the model's own router may choose any expert)
                assert not bool(torch.isin(ids, torch.tensor([3, 77, 200], device="cuda")).any())
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_FAST_LIST", "1")
    _replays_match_eager(poisoned, experts, top_k, ws, gen,
                         lambda: monkeypatch.setenv("VIBEQWEN_MOE_DECODE_FAST_LIST", "0"), f"top_k {top_k}, fast list")
    assert int(ws.sync[0]) == 0


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("top_k", [7, 8])
def test_gpu_shared_late_changes_no_value(model_moe, monkeypatch, top_k):
    """The shared expert's gate|up on quads 1-3 while warp 0 routes (VIBEQWEN_MOE_DECODE_SHARED_LATE=1; one token, 16
    warps) or on every quad before the first barrier: the same tiles and sums, so the same routing and output bit for
    bit, eagerly and in a graph replay captured with early launch; with 8 warps or more tokens the switch changes
    nothing either."""
    route, experts, ws, gen = model_moe
    if top_k != 8:
        ws = D.make_workspace(route.tiles, top_k, 512, torch.device("cuda"))
    for warps, t in (("16", 1), ("16", 1), ("16", 3), ("8", 1)):
        monkeypatch.setenv("VIBEQWEN_MOE_DECODE_WARPS", warps)
        x = torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16)
        got = {}
        for late in ("1", "0"):
            monkeypatch.setenv("VIBEQWEN_MOE_DECODE_SHARED_LATE", late)
            got[late] = _launch(x, route, experts, top_k, ws)
        torch.cuda.synchronize()
        for a, b, what in zip(got["1"], got["0"], ("output", "routing weights", "ids")):
            _assert_same(a, b, f"top_k {top_k}, {warps} warps, T={t}: shared late against early: {what}")
        if top_k == 8 or t == 1:
            _assert_close(got["1"][0], _chain(x, route, experts, top_k)[2], f"top_k {top_k}, T={t}: against the chain")
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_WARPS", "16")
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_SHARED_LATE", "1")
    late_off = lambda: monkeypatch.setenv("VIBEQWEN_MOE_DECODE_SHARED_LATE", "0")  # noqa: E731
    _replays_match_eager(route, experts, top_k, ws, gen, late_off, f"top_k {top_k}, shared late")
    assert int(ws.sync[0]) == 0


def _generation(ws) -> int:
    """The workspace's grid-barrier generation (the tag a launch starting now takes is this plus one)."""
    return int(ws.sync[1]) & 0xFFFFFFFF


def _launch_moving(x, route, experts, ws):
    """:func:`_launch` (top_k 8) between two syncs: (its results, the generation before it, how far it moved)."""
    torch.cuda.synchronize()
    gen0 = _generation(ws)
    got = _launch(x, route, experts, 8, ws)
    torch.cuda.synchronize()
    return got, gen0, _generation(ws) - gen0


def _assert_tagged(words, tag: int, what: str) -> None:
    """Every 64-bit word carries `tag` in its high half."""
    tags = (words >> 32) & 0xFFFFFFFF
    assert bool((tags == tag).all()), f"{what}: {int((tags != tag).sum())} words without the tag"


def _assert_variants_same(got: dict, base, what: str) -> None:
    """Every variant's launch results in ``got`` (output, routing weights, ids) equal bit for bit to ``got[base]``'s."""
    for key, results in got.items():
        if key != base:
            for a, b, part in zip(results, got[base], ("output", "routing weights", "ids")):
                _assert_same(a, b, f"{what} {key} against {base}: {part}")


def _assert_replays(graph, ys, want, what: str) -> None:
    """Three replays of a graph of launches into ys, each launch equal bit for bit to its eager output in want."""
    for i in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for k in range(len(ys)):
            _assert_same(ys[k], want[k], f"{what}: replay {i}, launch {k} against an eager launch")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("copies", ["1", "8"])
@pytest.mark.parametrize("late", ["0", "1"])
@pytest.mark.parametrize("t", [1, 3, 8])
def test_gpu_tagged_logits_change_no_value(model_moe, monkeypatch, t, late, copies):
    """The routing waiting for each logit's tag (VIBEQWEN_MOE_DECODE_TAGGED=1, no first grid barrier) or behind the
    barrier, reading one copy of the logits or one of several (VIBEQWEN_MOE_DECODE_LOGIT_COPIES): the same routing
    and output bit for bit (16 and 8 warps), eagerly and in a graph of three launches on three different inputs
    captured with early launch. A tag that did not change from one launch to the next would let a launch route on the
    previous launch's logits (another input's), a copy left unwritten on stale ones: the replays would differ from
    the eager launches. After each eager launch every word of every copy it wrote carries the launch's tag (the
    generation before it, plus one), and the generation moved by the launch's barriers (1 tagged, 2 without)."""
    route, experts, ws, gen = model_moe
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_SHARED_LATE", late)
    xs = [torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3)]
    cols = 16 * route.tiles
    want = []
    for warps in ("16", "8"):
        monkeypatch.setenv("VIBEQWEN_MOE_DECODE_WARPS", warps)
        for x in xs:
            got = {}
            for tagged, n in (("1", copies), ("0", copies), ("0", "1")):
                monkeypatch.setenv("VIBEQWEN_MOE_DECODE_TAGGED", tagged)
                monkeypatch.setenv("VIBEQWEN_MOE_DECODE_LOGIT_COPIES", n)
                got[tagged, n], gen0, moved = _launch_moving(x, route, experts, ws)
                assert moved == (1 if tagged == "1" else 2), f"T={t}, tagged {tagged}: the generation moved by {moved}"
                _assert_tagged(ws.logits[:int(n), :t, :cols], gen0 + 1, f"T={t}, tagged {tagged}, {n} copies")
            _assert_variants_same(got, ("0", "1"), f"T={t}, {warps} warps: (tagged, copies)")
            if warps == "16":
                want.append(got["0", "1"][0])
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_WARPS", "16")
    _assert_close(want[0], _chain(xs[0], route, experts, 8)[2], f"T={t}: output against the launches it replaces")
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_TAGGED", "1")
    monkeypatch.setenv("VIBEQWEN_MOE_DECODE_LOGIT_COPIES", copies)
    ys = [torch.empty(t, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    _assert_replays(_graph_of(list(zip(xs, ys)), route, experts, 8, ws), ys, want, f"T={t} (tagged)")
    assert int(ws.sync[0]) == 0


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [1, 3, 8])
def test_gpu_early_scales_change_no_value(model_moe, monkeypatch, t):
    """The gate|up tiles' global scales requested before the multiply (the default) or after the partials are added
    (VIBEQWEN_MOE_DECODE_EARLY_SCALES=0): the same output and routing bit for bit."""
    route, experts, ws, gen = model_moe
    for _ in range(2):
        x = torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16)
        got = {}
        for early in ("1", "0"):
            monkeypatch.setenv("VIBEQWEN_MOE_DECODE_EARLY_SCALES", early)
            got[early] = _launch(x, route, experts, 8, ws)
        torch.cuda.synchronize()
        for a, b, what in zip(got["1"], got["0"], ("output", "routing weights", "ids")):
            _assert_same(a, b, f"T={t}: early scales against late: {what}")
        _assert_close(got["1"][0], _chain(x, route, experts, 8)[2], f"T={t}: output against the launches it replaces")
    assert int(ws.sync[0]) == 0


@pytest.mark.gpu
@requires_gpu
def test_gpu_strided_rows_and_a_nan_row(model_moe):
    route, experts, ws, gen = model_moe
    big = torch.randn(6, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    x = big[:, 1000:3048]  # row stride 4096, offset 2000 bytes: the kernel's copy of the rows
    _assert_same(D.moe_decode(x, route, experts, 8, ws), D.moe_decode(x.contiguous(), route, experts, 8, ws),
                 "strided rows")
    _assert_close(D.moe_decode(x, route, experts, 8, ws), _chain(x.contiguous(), route, experts)[2], "strided rows")
    xn = torch.randn(4, 2048, generator=gen, device="cuda").to(torch.bfloat16)
    xn[1, 7] = float("nan")
    tw, ti = torch.empty(4, 9, device="cuda"), torch.empty(4, 9, device="cuda", dtype=torch.int32)
    out = D.moe_decode(xn, route, experts, 8, ws, topk=(tw, ti))
    torch.cuda.synchronize()
    assert ((ti >= 0) & (ti <= 256)).all() and int(ws.sync[0]) == 0
    assert bool(torch.isfinite(out[[0, 2, 3]].float()).all())
