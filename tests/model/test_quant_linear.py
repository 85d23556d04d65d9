"""The GPU path's fused linear layers on the CPU: modules of mixed precisions fuse by runs of one precision,
and each module gets exactly its own output (rows > FP8_DECODE_MAX_M take the dense-copy branch, which runs
on the CPU)."""

import torch

from vibeqwen.checkpoint.layout import Precision
from vibeqwen.model.quant_linear import (
    FP8_DECODE_MAX_M,
    ConcatLinear,
    DenseLinear,
    FP8Linear,
    fused_linear,
    split_outputs,
)
from vibeqwen.model.weights import Weights


def _fp8_module(tensors, path, n, k, g):
    tensors[f"{path}.weight"] = (torch.randn(n, k, generator=g) * 4).to(torch.float8_e4m3fn)
    tensors[f"{path}.weight_scale"] = torch.rand(1, generator=g) + 0.5


def test_gdn_style_projection_fuses_by_precision_and_splits_exactly():
    g = torch.Generator().manual_seed(3)
    k = 64
    tensors, precs = {}, {}
    sizes = {"qkv": 48, "z": 32, "b": 4, "a": 4}
    for name, n in sizes.items():
        path = f"L.{name}"
        if name in ("qkv", "z"):
            _fp8_module(tensors, path, n, k, g)
            precs[path] = Precision.FP8
        else:
            tensors[f"{path}.weight"] = torch.randn(n, k, generator=g).to(torch.bfloat16)
            precs[path] = Precision.BF16
    w = Weights(tensors, precs, torch.bfloat16, "cpu")
    paths = [f"L.{n}" for n in sizes]
    layer, out_sizes = fused_linear(w, paths)
    assert out_sizes == list(sizes.values())
    assert isinstance(layer, ConcatLinear)
    assert [type(x) for x in layer.groups] == [FP8Linear, DenseLinear]  # qkv | z, then b | a
    assert layer.group_sizes == [[48, 32], [4, 4]]
    x = torch.randn(FP8_DECODE_MAX_M + 5, k, generator=g).to(torch.bfloat16)
    outs = split_outputs(layer, x, out_sizes)
    for path, out in zip(paths, outs):
        ref = torch.nn.functional.linear(x, w.dense(path))
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(layer(x), torch.cat(outs, dim=-1), rtol=0, atol=0)


def test_single_precision_layers_split_by_sizes():
    g = torch.Generator().manual_seed(4)
    tensors = {f"A.{n}.weight": torch.randn(8, 16, generator=g).to(torch.bfloat16) for n in ("q", "k")}
    w = Weights(tensors, {}, torch.bfloat16, "cpu")
    layer, sizes = fused_linear(w, ["A.q", "A.k"])
    assert isinstance(layer, DenseLinear) and sizes == [8, 8]
    x = torch.randn(3, 16, generator=g).to(torch.bfloat16)
    q, kk = split_outputs(layer, x, sizes)
    torch.testing.assert_close(q, torch.nn.functional.linear(x, tensors["A.q.weight"]), rtol=0, atol=0)
    torch.testing.assert_close(kk, torch.nn.functional.linear(x, tensors["A.k.weight"]), rtol=0, atol=0)
