"""The GPU path's fused linear layers on the CPU: modules of mixed precisions fuse by runs of one precision,
and each module gets exactly its own output (rows > FP8_DECODE_MAX_M take the dense-copy branch, which runs
on the CPU, or inside `prompt_pass(w8a8=True)` the W8A8 branch, whose CPU dispatch runs its reference)."""

from types import SimpleNamespace

import pytest
import torch
from vibeqwen_kernels.fp8 import fp8_w8a8_linear_ref

from vibeqwen.checkpoint.layout import Precision
from vibeqwen.model.quant_linear import (
    FP8_DECODE_MAX_M,
    ConcatLinear,
    DenseLinear,
    FP8Linear,
    fused_linear,
    prompt_pass,
    split_outputs,
    w8a8_active,
)
from vibeqwen.model.weights import Weights

#: Output features of the GDN-style fused projection of `_gdn_style`: qkv | z in FP8, b | a in BF16.
GDN_SIZES = {"qkv": 48, "z": 32, "b": 4, "a": 4}


def _fp8_module(tensors, path, n, k, g):
    tensors[f"{path}.weight"] = (torch.randn(n, k, generator=g) * 4).to(torch.float8_e4m3fn)
    tensors[f"{path}.weight_scale"] = torch.rand(1, generator=g) + 0.5


def test_gdn_style_projection_fuses_by_precision_and_splits_exactly():
    w, paths, layer, out_sizes, x = _gdn_style(3, extra_rows=5)
    assert out_sizes == list(GDN_SIZES.values())
    assert isinstance(layer, ConcatLinear)
    assert [type(x) for x in layer.groups] == [FP8Linear, DenseLinear]  # qkv | z, then b | a
    assert layer.group_sizes == [[48, 32], [4, 4]]
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


def _gdn_style(seed: int, extra_rows: int = 7):
    """A GDN-style fused projection (qkv | z FP8, b | a BF16, K = 64) on the CPU and FP8_DECODE_MAX_M +
    extra_rows rows of bf16 input: (weights, paths, layer, out_sizes, x)."""
    g = torch.Generator().manual_seed(seed)
    k, tensors, precs = 64, {}, {}
    for name, n in GDN_SIZES.items():
        path = f"L.{name}"
        if name in ("qkv", "z"):
            _fp8_module(tensors, path, n, k, g)
            precs[path] = Precision.FP8
        else:
            tensors[f"{path}.weight"] = torch.randn(n, k, generator=g).to(torch.bfloat16)
            precs[path] = Precision.BF16
    w = Weights(tensors, precs, torch.bfloat16, "cpu")
    paths = [f"L.{n}" for n in GDN_SIZES]
    layer, out_sizes = fused_linear(w, paths)
    return w, paths, layer, out_sizes, torch.randn(FP8_DECODE_MAX_M + extra_rows, k, generator=g).to(torch.bfloat16)


def test_concat_layer_shares_one_dense_weight():
    """FP8 | BF16 groups: the many-row W8A16 GEMM runs on one dense weight, and the groups' own bf16 weights
    are views of it (no second copy)."""
    _, _, layer, _, _ = _gdn_style(5)
    assert layer.dense is not None and layer.dense.shape == (88, 64)
    fp8, dense = layer.groups
    assert fp8.dense.data_ptr() == layer.dense.data_ptr()
    assert dense.weight.data_ptr() == layer.dense[80:].data_ptr()


def _stub_decode_kernel(monkeypatch) -> list[int]:
    """Replace the W8A16 decode kernel (it needs CUDA) by zeros; returns the list of row counts it is called with."""
    import vibeqwen_kernels.fp8 as fp8_mod

    calls = []

    def decode_kernel(x, packed):
        calls.append(x.shape[0])
        return torch.zeros(x.shape[0], packed.n, dtype=x.dtype)

    monkeypatch.setattr(fp8_mod, "fp8_linear", decode_kernel)
    return calls


def test_prompt_pass_w8a8_branch(monkeypatch):
    """Inside prompt_pass(w8a8=True), many rows of an FP8 layer give the W8A8 result (each FP8 group from its
    own per-row scales), BF16 groups stay exact; few rows, or outside the block, stay W8A16."""
    calls = _stub_decode_kernel(monkeypatch)
    w, paths, layer, sizes, x = _gdn_style(6)
    assert not w8a8_active()
    with prompt_pass(True):
        assert w8a8_active()
        outs = split_outputs(layer, x, sizes)
        few = split_outputs(layer, x[:FP8_DECODE_MAX_M], sizes)
    assert not w8a8_active()
    fp8 = layer.groups[0]
    ref = fp8_w8a8_linear_ref(x, fp8.packed).to(torch.bfloat16)
    torch.testing.assert_close(torch.cat(outs[:2], -1), ref, rtol=0, atol=0)
    for path, out in zip(paths[2:], outs[2:]):
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w.dense(path)), rtol=0, atol=0)
    # W8A8 is not W8A16: the activations' E4M3 rounding shows
    exact = torch.nn.functional.linear(x, w.dense(paths[0]))
    assert (outs[0] - exact).abs().max() > 0
    # few rows: the W8A16 decode kernel (stubbed: it needs CUDA), not W8A8
    assert calls == [FP8_DECODE_MAX_M]
    torch.testing.assert_close(torch.cat(few[:2], -1), torch.zeros(FP8_DECODE_MAX_M, 80, dtype=torch.bfloat16))
    with prompt_pass(False):
        for path, out in zip(paths, split_outputs(layer, x, sizes)):
            torch.testing.assert_close(out, torch.nn.functional.linear(x, w.dense(path)), rtol=0, atol=0)


def test_prompt_pass_restores_on_error():
    with pytest.raises(RuntimeError), prompt_pass(True):
        raise RuntimeError("boom")
    assert not w8a8_active()


@pytest.mark.parametrize("mode,query_lens,keep,expect", [
    (True, [1, 1, 1], [False] * 3, False),  # decode
    (True, [300], [False], True),  # a prompt chunk
    (True, [1, 300], [False, False], True),  # mixed: the decode rows run with it
    (True, [5, 5], [True, True], False),  # speculative verification
    (True, [5, 1], None, True),
    (False, [300], [False], False),  # fp8_prefill "w8a16"
])
def test_runner_w8a8_rule(mode, query_lens, keep, expect):
    from vibeqwen.engine.runner import ModelRunner

    assert ModelRunner._w8a8(SimpleNamespace(fp8_prefill_w8a8=mode), query_lens, keep) is expect


def test_prequantized_rows():
    """FP8 layers given the rows already quantized (a norm kernel's QuantizedRows) inside a W8A8 prompt pass:
    the same result as quantizing there; outside one, a clear error."""
    from vibeqwen_kernels.fp8 import quantize_rows_fp8_ref
    from vibeqwen_kernels.fp8.w8a8 import QuantizedRows

    _, _, layer, sizes, x = _gdn_style(7)
    xq = QuantizedRows(*quantize_rows_fp8_ref(x))
    fp8 = layer.groups[0]
    with prompt_pass(True):
        for a, b in zip(split_outputs(layer, x, sizes, xq), split_outputs(layer, x, sizes)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(fp8(xq), fp8(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside a W8A8 prompt pass"):
        fp8(xq)


def test_w8a8_needs_bf16_on_cuda(monkeypatch):
    """On CUDA only bf16 activations take the W8A8 branch (the FP8 GEMM's output dtype); the flag is read per
    layer, so a float32 engine keeps its dense W8A16 copy in prompt passes and its norms do not quantize."""
    from vibeqwen.model import quant_linear as ql

    _, _, layer, sizes, x = _gdn_style(8)
    fp8 = layer.groups[0]
    assert fp8.w8a8_ok and layer.w8a8_ok  # bf16 (and on the CPU any dtype)
    monkeypatch.setattr(fp8, "w8a8_ok", False)
    with prompt_pass(True):
        assert not ql.w8a8_rows(layer, x.shape[0])
        out = split_outputs(layer, x, sizes)
    torch.testing.assert_close(torch.cat(out[:2], -1), torch.nn.functional.linear(x, fp8.dense), rtol=0, atol=0)


def test_decode_w8a8_switch(monkeypatch):
    """VIBEQWEN_FP8_DECODE_W8A8=N: decode-sized calls of N..FP8_DECODE_MAX_M rows run W8A8 (in any pass, the norms
    asked to quantize for them: w8a8_rows; no fused post-norm), fewer rows the W8A16 decode kernel; 0 or unset: never;
    a bad value is a clear error naming the variable."""
    from vibeqwen.model import quant_linear as ql

    calls = _stub_decode_kernel(monkeypatch)
    _, _, layer, sizes, x = _gdn_style(9)
    fp8 = layer.groups[0]
    monkeypatch.delenv("VIBEQWEN_FP8_DECODE_W8A8", raising=False)
    assert ql.decode_w8a8_min_rows() == 0 and not ql.w8a8_rows(layer, 32)
    monkeypatch.setenv("VIBEQWEN_FP8_DECODE_W8A8", "16")
    assert [ql.w8a8_rows(layer, m) for m in (1, 15, 16, FP8_DECODE_MAX_M, FP8_DECODE_MAX_M + 1)] == [
        False, False, True, True, False]  # past FP8_DECODE_MAX_M only a W8A8 prompt pass does
    rows = x[:32]
    out = split_outputs(layer, rows, sizes)
    torch.testing.assert_close(torch.cat(out[:2], -1), fp8_w8a8_linear_ref(rows, fp8.packed).to(torch.bfloat16),
                               rtol=0, atol=0)
    assert calls == []
    # the fused reduce + norm of the W8A16 kernel is not taken for W8A8 rows (the kernel stubbed: it needs CUDA)
    import vibeqwen_kernels.fp8.mma as mma_mod

    monkeypatch.setattr(mma_mod, "fp8_linear_mma_add_rms_norm", lambda *a: "fused")
    monkeypatch.setattr(fp8, "mma", object())
    norm_args = (torch.zeros(32, 80, dtype=torch.bfloat16), torch.ones(80), 1e-6)
    assert fp8.add_rms_norm(rows, *norm_args) is None
    assert fp8.add_rms_norm(x[:8], torch.zeros(8, 80, dtype=torch.bfloat16), *norm_args[1:]) == "fused"
    monkeypatch.setattr(fp8, "mma", None)
    split_outputs(layer, x[:8], sizes)  # below N: the W8A16 decode kernel
    assert calls == [8]
    monkeypatch.setenv("VIBEQWEN_FP8_DECODE_W8A8", "0")
    split_outputs(layer, rows, sizes)
    assert calls == [8, 32]
    for bad in ("-1", "x", str(FP8_DECODE_MAX_M + 1)):
        monkeypatch.setenv("VIBEQWEN_FP8_DECODE_W8A8", bad)
        with pytest.raises(ValueError, match="VIBEQWEN_FP8_DECODE_W8A8"):
            ql.w8a8_rows(layer, 8)
