"""The L2 prefetch hint (`vibeqwen_kernels.l2_prefetch`): its switch, its argument checks, and on a GPU that the
kernel runs over whole and partial pieces, eagerly and in a CUDA graph, without touching the bytes it asks for.
(Whether it makes a GEMM faster is measured by bench/kernels/bench_l2_prefetch.py, not asserted here.)"""

from __future__ import annotations

import pytest
import torch
from vibeqwen_kernels import l2_prefetch as L2


@pytest.mark.parametrize("value,want", [("0", {}), ("", {}), ("moe", {"moe": 1.0}), ("out:0.5", {"out": 0.5}),
                                        ("moe:1", {"moe": 1.0}), ("in+moe:0.25", {"in": 1.0, "moe": 0.25}),
                                        ("out+in:0.5", {"out": 1.0, "in": 0.5})])
def test_prefetch_plan_parses(monkeypatch, value, want):
    monkeypatch.setenv("VIBEQWEN_L2_PREFETCH", value)
    assert L2.prefetch_plan() == want


def test_prefetch_plan_default_off(monkeypatch):
    monkeypatch.delenv("VIBEQWEN_L2_PREFETCH", raising=False)
    assert L2.prefetch_plan() == {}


@pytest.mark.parametrize("value", ["1", "attn", "moe:0", "moe:1.5", "moe:x", "moe:-1", ":0.5", "moe+out", "in+in",
                                   "in+", "+moe", "in+moe:2"])
def test_prefetch_plan_rejects(monkeypatch, value):
    monkeypatch.setenv("VIBEQWEN_L2_PREFETCH", value)
    with pytest.raises(ValueError, match="VIBEQWEN_L2_PREFETCH"):
        L2.prefetch_plan()


def test_l2_prefetch_checks_arguments():
    t = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="CUDA"):
        L2.l2_prefetch([t], [1024])
    with pytest.raises(ValueError, match="fraction"):
        L2.l2_prefetch([t], [1024], 0.0)
    with pytest.raises(ValueError, match="row sizes"):
        L2.l2_prefetch([t], [1024, 2048])


def test_prefetch_targets_of_the_fp8_groups():
    from vibeqwen.model.quant_linear import ConcatLinear, DenseLinear, FP8Linear, prefetch_targets

    class MMA:  # what prefetch_targets reads of an FP8MMAWeight
        def __init__(self, k):
            self.codes, self.k = torch.zeros(16 * k, dtype=torch.uint8), k

    fp8 = FP8Linear.__new__(FP8Linear)
    fp8.mma = MMA(256)
    plain = FP8Linear.__new__(FP8Linear)
    plain.mma = None  # no MMA copy: nothing to prefetch
    dense = DenseLinear.__new__(DenseLinear)
    dense.mma = MMA(512)  # bf16: not an FP8 group
    cat = ConcatLinear.__new__(ConcatLinear)
    cat.groups = [fp8, dense, plain]
    assert prefetch_targets(fp8) == [(fp8.mma.codes, 16 * 256)]
    assert prefetch_targets(cat) == [(fp8.mma.codes, 16 * 256)]
    assert prefetch_targets(plain) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows,row_bytes,fraction", [(64, 32768, 1.0), (64, 32768, 0.5), (7, 3200, 1.0),
                                                     (5, 40960, 0.3), (1, 16, 1.0)])
def test_l2_prefetch_runs_and_writes_nothing(rows, row_bytes, fraction):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cp.async.bulk.prefetch needs sm_90")
    g = torch.Generator(device="cuda").manual_seed(rows)
    t = torch.randint(0, 256, (rows * row_bytes,), dtype=torch.uint8, device="cuda", generator=g)
    other = torch.randint(0, 256, (2, row_bytes), dtype=torch.uint8, device="cuda", generator=g)
    want, want_other = t.clone(), other.clone()
    L2.l2_prefetch([t, other], [row_bytes, row_bytes], fraction)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        L2.l2_prefetch([t], [row_bytes], fraction)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(t, want) and torch.equal(other, want_other)
