"""Every layout a user may hold loads into the one vendor layout the model reads, with the right numbers.

All layouts here encode the same seed-0 BF16 "master" weights (`writer.master_weight`). What is checked:

- layout detection and normalisation: names, dtypes and shapes are the vendor layout's (`Module.tensors`);
- weights: each dequantized module against its master weight, within the error its format implies;
- ModelOpt per-expert == ModelOpt fused/[1]-scalars/folded config == BF16 quantized at load, bit for bit
  (same math on the same BF16 weights);
- compressed-tensors vs ModelOpt: NEAR-exact, not exact (numbers in the test);
- logits: our model on each layout against the HF oracle on (a) the master weights quantized by that
  format's rule, computed here independently of the loader (parity tolerance 1e-3), and (b) the master
  weights themselves (loose, quantization-noise tolerance; negative controls show it still fails on a
  wrong conversion).
"""

from __future__ import annotations

import copy
import json
import logging
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from vibeqwen.checkpoint.layout import Module, Precision, checkpoint_modules, precision_from_quant_config
from vibeqwen.checkpoint.loader import CheckpointError, load_checkpoint
from vibeqwen.checkpoint.quant import (
    E2M1_VALUES,
    ct_nvfp4_quantize,
    fp8_dequantize,
    fp8_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
    unpack_e2m1,
)
from vibeqwen.checkpoint.writer import master_weight
from vibeqwen.config import ConfigError
from vibeqwen.model.layers import dequantize_module

LAYOUT = {"modelopt": "modelopt", "modelopt-fused": "modelopt", "compressed-tensors": "compressed-tensors",
          "bf16": "bf16", "bf16-none": "bf16"}
ALL = list(LAYOUT)
QUANTIZED = ["modelopt", "modelopt-fused", "compressed-tensors", "bf16"]
# Relative L2 error of logits vs the oracle on the unquantized master weights. Measured on the tiny model
# (64-token prompt): 0.35 for the vendor mix, 0.29 for compressed-tensors (GDN projections and lm_head stay
# BF16 there). A random 4-layer network amplifies the ~10% per-matrix NVFP4 weight error; the bound leaves
# ~30% headroom and still fails on a wrong conversion (gate/up swapped: 0.60, nibbles swapped: 0.83,
# global scale not inverted: 1.0).
QUANT_NOISE_REL = 0.45
PARITY = {"atol": 1e-3, "rtol": 1e-3}  # same as tests/model/test_parity.py: float32, op order only


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.fixture(scope="module")
def modules(tiny_config) -> dict[str, Module]:
    return {m.path: m for m in checkpoint_modules(tiny_config)}


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 248044, (64,), generator=g).tolist()


# ---- layout detection and normalisation -------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_layout_is_detected_and_normalised_to_vendor_names(loaded, modules, name):
    ckpt = loaded[name]
    assert ckpt.layout == LAYOUT[name]
    assert ckpt.has_mtp == (name != "compressed-tensors")
    expected: dict[str, tuple] = {}
    for path, prec in ckpt.precisions.items():
        expected.update(modules[path].with_precision(prec).tensors(input_scale=False))
    got = {k: v for k, v in ckpt.tensors.items() if not k.endswith(".input_scale")}
    assert set(got) == set(expected)
    for k, (shape, dtype) in expected.items():
        assert ckpt.tensors[k].dtype == dtype and tuple(ckpt.tensors[k].shape) == shape, k
    assert not any(k.startswith("model.visual") for k in ckpt.tensors)
    counts = {p: sum(1 for v in ckpt.precisions.values() if v == p) for p in Precision}
    if name == "compressed-tensors":
        # experts + shared experts + self-attention q/k/v/o; lm_head, routers and GDN stay BF16
        assert counts[Precision.NVFP4] == 4 * (16 * 3 + 3) + 4 and counts[Precision.FP8] == 0
        assert ckpt.precisions["lm_head"] == Precision.BF16
    elif name == "bf16-none":
        assert counts[Precision.NVFP4] == counts[Precision.FP8] == 0
    else:  # the vendor mix
        assert counts[Precision.NVFP4] == 4 * (16 * 3 + 3) + 1 and counts[Precision.FP8] == 3 * 3 + 4


@pytest.mark.parametrize("name", ALL)
def test_loaded_weights_match_master_within_format_error(loaded, modules, name):
    ckpt = loaded[name]
    rel = {Precision.NVFP4: [], Precision.FP8: []}
    for path, prec in ckpt.precisions.items():
        m = modules[path]
        w = master_weight(m, seed=0).float()
        if prec == Precision.BF16:
            leaf = f"{path}.{m.leaf}" if m.leaf else path
            assert torch.equal(ckpt.tensors[leaf].float(), w), path
            continue
        deq = dequantize_module(ckpt.tensors, path, prec, torch.float32)
        err = (deq - w).abs()
        if prec == Precision.NVFP4:
            # per 16-block, error <= the coarsest E2M1 step over the block max (1/6, plus saturation)
            n, k = w.shape
            blk_err = err.reshape(n, k // 16, 16).amax(-1)
            blk_max = w.abs().reshape(n, k // 16, 16).amax(-1)
            assert (blk_err <= blk_max / 5.6 + 1e-12).all(), path
        else:
            # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 (+ 2^-8 for the bf16 quotient), absolute
            # error <= half the subnormal step near zero
            scale = ckpt.tensors[f"{path}.weight_scale"].float()
            assert (err <= torch.maximum(w.abs() * (2**-4 + 2**-8), 2**-10 * scale) * (1 + 1e-6)).all(), path
        rel[prec].append(((deq - w).norm() / w.norm()).item())
    # Frobenius error of NVFP4 on Gaussian weights is ~0.09-0.10 (measured); FP8 ~0.027
    assert all(0.05 < r < 0.12 for r in rel[Precision.NVFP4])
    assert all(r < 0.04 for r in rel[Precision.FP8])


def test_modelopt_variants_and_load_time_quantization_are_bit_identical(loaded):
    ref = loaded["modelopt"]
    for name in ("modelopt-fused", "bf16"):
        other = loaded[name]
        assert other.precisions == ref.precisions
        names = {k for k in ref.tensors if not k.endswith(".input_scale")}
        assert names <= set(other.tensors)
        for k in names:
            a, b = ref.tensors[k], other.tensors[k]
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b)), (name, k)
    # the fused layout shares one weight_scale_2 between gate and up per expert, as the per-expert one does
    p = "model.language_model.layers.0.mlp.experts.5."
    assert torch.equal(ref.tensors[p + "gate_proj.weight_scale_2"], ref.tensors[p + "up_proj.weight_scale_2"])


def test_compressed_tensors_matches_modelopt_near_exactly(loaded):
    """Same weights, NVFP4 in both: near-exact, not bit-exact. Measured on this checkpoint: 0.53% of E2M1
    codes and 0.07% of block scales differ (compressed-tensors rounds the scaled value to bf16 before E2M1,
    and computes block scales as gs * amax_b / 6 rather than amax_b / (6 * amax / 2688)); elsewhere the
    dequantized values agree to 2^-21 relative (global scale stored as 2688/amax and inverted at load)."""
    mo, ct = loaded["modelopt"], loaded["compressed-tensors"]
    common = [p for p, prec in ct.precisions.items() if prec == Precision.NVFP4 and mo.precisions[p] == prec]
    assert len(common) == 4 * (16 * 3 + 3)
    codes = scales = close = n_codes = n_scales = 0
    for p in common:
        a, b = unpack_e2m1(mo.tensors[p + ".weight"]), unpack_e2m1(ct.tensors[p + ".weight"])
        codes += (a != b).sum().item()
        n_codes += a.numel()
        scales += (mo.tensors[p + ".weight_scale"].float() != ct.tensors[p + ".weight_scale"].float()).sum().item()
        n_scales += a.shape[0] * a.shape[1] // 16
        da = dequantize_module(mo.tensors, p, Precision.NVFP4, torch.float32)
        db = dequantize_module(ct.tensors, p, Precision.NVFP4, torch.float32)
        close += torch.isclose(da, db, rtol=2**-21, atol=0).sum().item()
        torch.testing.assert_close(ct.tensors[p + ".weight_scale_2"], mo.tensors[p + ".weight_scale_2"],
                                   rtol=2**-22, atol=0)
    assert 0 < codes / n_codes < 0.02
    assert scales / n_scales < 0.005
    assert close / n_codes > 0.98


# ---- logits against the HF oracle ---------------------------------------------------------------


def _logits(ckpt, prompt):
    from seqrun import Sequences

    from vibeqwen.model.qwen import Qwen3_5MoeForCausalLM
    from vibeqwen.model.weights import Weights

    model = Qwen3_5MoeForCausalLM.from_weights(ckpt.config, Weights(ckpt.tensors, ckpt.precisions, torch.float32))
    return Sequences(model, num_seqs=1).run({0: prompt})


def _oracle_logits(cfg, dense: dict[str, torch.Tensor], modules, prompt):
    """HF oracle on dense float32 weights given by module path."""
    from oracle import hf_model

    tensors = {}
    for path, w in dense.items():
        m = modules[path]
        tensors[f"{path}.{m.leaf}" if m.leaf else path] = w
    fake = SimpleNamespace(config=cfg, tensors=tensors, precisions={p: Precision.BF16 for p in dense})
    with torch.no_grad():
        return hf_model(fake)(torch.tensor([prompt])).logits[0].float()


def _pairs(paths: list[str]) -> list[list[str]]:
    """Quantizer groups the exporters fuse: (gate, up) of each expert and of the shared expert; q/k/v."""
    groups, seen = [], set()
    for p in paths:
        if p in seen:
            continue
        if p.endswith("gate_proj"):
            g = [p, p[: -len("gate_proj")] + "up_proj"]
        elif p.endswith("self_attn.q_proj"):
            g = [p, p[: -len("q_proj")] + "k_proj", p[: -len("q_proj")] + "v_proj"]
        else:
            g = [p]
        seen.update(g)
        groups.append(g)
    return groups


def _fake_quantized(precisions: dict[str, Precision], modules, rule: str) -> dict[str, torch.Tensor]:
    """The master weights quantized and dequantized by an exporter's rule, without the loader.

    modelopt: NVFP4 gate/up share one amax (ModelOpt fuses them), FP8 per tensor, each on its own.
    compressed-tensors: NVFP4 gate/up and q/k/v share one global scale; dequantized with CT's own formula
    e2m1 * (block_scale / global_scale).
    """
    master = {p: master_weight(modules[p], seed=0) for p in precisions if not p.startswith("mtp.")}
    out = {}
    for group in _pairs(list(master)):
        prec = precisions[group[0]]
        amax = torch.stack([master[p].abs().amax().float() for p in group]).amax()
        for p in group:
            w = master[p]
            if prec == Precision.BF16:
                out[p] = w.float()
            elif prec == Precision.FP8:
                out[p] = fp8_dequantize(*fp8_quantize(w))
            elif rule == "modelopt":
                out[p] = nvfp4_dequantize(*nvfp4_quantize(w, amax=amax))
            else:
                packed, block_scale, gs = ct_nvfp4_quantize(w, amax=amax)
                vals = E2M1_VALUES[unpack_e2m1(packed).long()].reshape(*w.shape[:-1], -1, 16)
                out[p] = (vals * (block_scale.float() / gs).unsqueeze(-1)).reshape(w.shape)
    return out


@pytest.fixture(scope="module")
def master_logits(loaded, modules, prompt):
    ckpt = loaded["bf16-none"]
    dense = {p: master_weight(modules[p], seed=0).float() for p in ckpt.precisions if not p.startswith("mtp.")}
    return _oracle_logits(ckpt.config, dense, modules, prompt)


@pytest.mark.parametrize("rule", ["modelopt", "compressed-tensors"])
def test_logits_match_oracle_on_weights_quantized_by_the_format_rule(loaded, modules, prompt, rule):
    names = ["modelopt", "modelopt-fused", "bf16"] if rule == "modelopt" else ["compressed-tensors"]
    ref = _oracle_logits(loaded[names[0]].config, _fake_quantized(loaded[names[0]].precisions, modules, rule),
                         modules, prompt)
    for name in names:
        torch.testing.assert_close(_logits(loaded[name], prompt), ref, **PARITY, msg=name)


# modelopt-fused is bit-identical to modelopt (test_modelopt_variants_and_load_time_quantization_are_bit_identical)
@pytest.mark.parametrize("name", ["modelopt", "compressed-tensors", "bf16", "bf16-none"])
def test_logits_match_oracle_on_master_weights_within_quantization_noise(loaded, prompt, master_logits, name):
    out = _logits(loaded[name], prompt)
    if name == "bf16-none":
        torch.testing.assert_close(out, master_logits, **PARITY)
        return
    rel = ((out - master_logits).norm() / master_logits.norm()).item()
    assert 0.05 < rel < QUANT_NOISE_REL, rel


def test_quantization_noise_bound_fails_on_a_wrong_conversion(loaded, prompt, master_logits):
    ct = loaded["compressed-tensors"]
    not_inverted = copy.copy(ct)
    not_inverted.tensors = {k: (1.0 / v if k.endswith("weight_scale_2") else v) for k, v in ct.tensors.items()}
    mo = loaded["modelopt"]
    swapped = copy.copy(mo)
    swapped.tensors = dict(mo.tensors)
    for k in mo.tensors:
        if ".mlp.experts." in k and ".gate_proj." in k:
            u = k.replace(".gate_proj.", ".up_proj.")
            swapped.tensors[k], swapped.tensors[u] = mo.tensors[u], mo.tensors[k]
    for bad in (not_inverted, swapped):
        out = _logits(bad, prompt)
        assert ((out - master_logits).norm() / master_logits.norm()).item() > QUANT_NOISE_REL


# ---- compressed-tensors conventions, checked against its definitions -----------------------------


def test_compressed_tensors_nibble_order_and_reciprocal_global_scale():
    # one row: 0.5, 1, 1.5, 2, then 6 (sets the block amax), zeros; amax 6 -> gs = 2688 / 6 = 448
    w = torch.tensor([[0.5, 1.0, 1.5, 2.0, 6.0] + [0.0] * 11])
    packed, block_scale, gs = ct_nvfp4_quantize(w)
    assert gs.item() == 448.0
    assert block_scale.float().item() == 448.0  # gs * amax_b / 6
    # compressed-tensors pack_fp4_to_uint8: byte = code[2i] | code[2i+1] << 4
    assert packed[0, :3].tolist() == [0x21, 0x43, 0x07]
    # its dequantization divides by the global scale
    deq = E2M1_VALUES[unpack_e2m1(packed).long()] * (block_scale.float() / gs)
    assert torch.equal(deq, w)


def test_compressed_tensors_rounds_through_bf16_before_e2m1():
    # 0.7499 (float32) is below the 0.75 decision point, but rounds to 0.75 in bf16 and then to 1.0;
    # ModelOpt rounds the float32 value: 0.5
    w = torch.tensor([[0.7499, 6.0] + [0.0] * 14])
    ct_codes = unpack_e2m1(ct_nvfp4_quantize(w)[0])[0, :2].tolist()
    mo_codes = unpack_e2m1(nvfp4_quantize(w)[0])[0, :2].tolist()
    assert ct_codes == [2, 7] and mo_codes == [1, 7]


# ---- MTP, vision tower, --quantize ------------------------------------------------------------------


def test_missing_mtp_is_warned_and_reported(format_dirs, caplog):
    with caplog.at_level(logging.WARNING):
        ckpt = load_checkpoint(format_dirs["compressed-tensors"])
    assert not ckpt.has_mtp and not any(k.startswith("mtp.") for k in ckpt.tensors)
    assert not any(p.startswith("mtp.") for p in ckpt.precisions)
    assert "MTP speculative decoding is unavailable" in caplog.text


def test_vision_tower_is_skipped_without_reading(format_dirs, monkeypatch):
    from vibeqwen.checkpoint import loader

    read: list[str] = []
    real = loader._read_shard
    monkeypatch.setattr(loader, "_read_shard", lambda shard, names, *a: (read.extend(names), real(shard, names, *a)))
    for path in format_dirs.values():
        headers = loader.read_headers(path)
        assert sum(n.startswith("model.visual.") for n in headers) == 2
        load_checkpoint(path)
    assert read and not any(n.startswith("model.visual.") for n in read)


def test_quantize_none_keeps_bf16_and_the_engine_passes_it_through(loaded, format_dirs):
    from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine

    ckpt = loaded["bf16-none"]
    assert set(ckpt.precisions.values()) == {Precision.BF16}
    assert all(t.dtype in (torch.bfloat16,) for t in ckpt.tensors.values())
    # `serve --quantize none` reaches the loader through EngineConfig.quantize
    engine = LLMEngine.from_checkpoint(format_dirs["bf16"], config=EngineConfig(max_num_seqs=2, quantize="none"))
    assert engine.model.lm_head.precision == Precision.BF16
    assert Precision.NVFP4 in load_checkpoint(format_dirs["bf16"]).precisions.values()
    with pytest.raises(ValueError, match="quantize must be one of"):
        load_checkpoint(format_dirs["bf16"], quantize="int4")


def test_serve_parses_quantize_and_make_checkpoint_parses_format():
    from vibeqwen.cli import _parser

    args = _parser().parse_args(["serve", "--weights", "x", "--quantize", "none"])
    assert args.quantize == "none"
    assert _parser().parse_args(["serve", "--weights", "x"]).quantize == "nvfp4"
    args = _parser().parse_args(["make-checkpoint", "--out", "y", "--format", "compressed-tensors"])
    assert args.format == "compressed-tensors"


# ---- validation errors ---------------------------------------------------------------------------


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _edit(ckpt, name, fn):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = ckpt / index["weight_map"][name]
    tensors = load_file(shard)
    fn(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


CT_EXPERT = "model.language_model.layers.2.mlp.experts.7.down_proj"


def test_ct_missing_tensor_names_tensor_and_layout(format_dirs, tmp_path):
    ckpt = _copy(format_dirs["compressed-tensors"], tmp_path / "ct")
    _edit(ckpt, CT_EXPERT + ".weight_packed", lambda t: t.pop(CT_EXPERT + ".weight_packed"))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt)
    msg = str(e.value)
    assert "compressed-tensors layout" in msg
    assert f"{CT_EXPERT}.weight_packed' is missing from every shard (expected U8[64, 16]" in msg


def test_ct_wrong_dtype_names_file_tensor_expected_and_actual(format_dirs, tmp_path):
    ckpt = _copy(format_dirs["compressed-tensors"], tmp_path / "ct")
    name = CT_EXPERT + ".weight_global_scale"
    shard = _edit(ckpt, name, lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt)
    msg = str(e.value)
    assert f"{shard.name}: tensor '{name}' is BF16[1], expected F32[]" in msg and "compressed-tensors layout" in msg


def test_bf16_fused_experts_wrong_shape_is_reported(format_dirs, tmp_path):
    ckpt = _copy(format_dirs["bf16"], tmp_path / "bf16")
    name = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    shard = _edit(ckpt, name, lambda t: t.__setitem__(name, t[name][:, :32].contiguous()))  # gate rows only
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt)
    msg = str(e.value)
    assert f"{shard.name}: tensor '{name}' is BF16[16, 32, 64], expected BF16[16, 64, 64]" in msg
    assert "bf16 layout" in msg


def test_modelopt_fused_scale_shape_is_checked(format_dirs, tmp_path):
    ckpt = _copy(format_dirs["modelopt-fused"], tmp_path / "mof")
    name = "model.language_model.layers.3.mlp.experts.down_proj_weight_scale_2"
    _edit(ckpt, name, lambda t: t.__setitem__(name, t[name][:1].contiguous()))
    with pytest.raises(CheckpointError, match=rf"{name}' is F32\[1\], expected F32\[16\].*\n?"):
        load_checkpoint(ckpt)


def test_unknown_architecture_names_what_is_served(format_dirs, tmp_path):
    ckpt = _copy(format_dirs["bf16"], tmp_path / "bf16")
    hf = json.loads((ckpt / "config.json").read_text())
    hf["architectures"] = ["Qwen3NextForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match="Qwen3NextForCausalLM is not served.*Qwen3.6-35B-A3B"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported.*compressed-tensors"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "group_size": 128,
                                                                 "strategy": "group"}}}},
     "config group 'g'.*not supported.*nvfp4-pack-quantized"),
])
def test_unsupported_quantization_is_refused(format_dirs, tmp_path, qc, match):
    ckpt = _copy(format_dirs["bf16"], tmp_path / "bf16")
    hf = json.loads((ckpt / "config.json").read_text())
    hf["quantization_config"] = qc
    (ckpt / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(ckpt)


def test_bf16_weights_claimed_as_modelopt_are_reported(format_dirs, tmp_path):
    # a BF16 checkpoint with a ModelOpt config: every quantized tensor is mistyped or missing
    ckpt = _copy(format_dirs["bf16"], tmp_path / "bf16")
    (ckpt / "hf_quant_config.json").write_text((format_dirs["modelopt"] / "hf_quant_config.json").read_text())
    with pytest.raises(CheckpointError, match=r"modelopt layout.*problem\(s\).*\(and \d+ more\)"):
        load_checkpoint(ckpt)


# ---- ModelOpt config variants ----------------------------------------------------------------------


def test_modelopt_precision_resolution_variants():
    layer = "model.language_model.layers.3."
    mixed = {"quantization": {"quant_algo": "MIXED_PRECISION",
                              "exclude_modules": ["model.visual*", "*mlp.gate", "mtp*"],
                              "quantized_layers": {layer + "mlp.experts": {"quant_algo": "W4A16_NVFP4"},
                                                   layer + "self_attn.q_proj": {"quant_algo": "FP8"}}}}
    assert precision_from_quant_config(mixed, layer + "mlp.experts.7.up_proj") == Precision.NVFP4
    assert precision_from_quant_config(mixed, layer + "self_attn.q_proj") == Precision.FP8
    assert precision_from_quant_config(mixed, layer + "self_attn.k_proj") == Precision.BF16  # not listed
    assert precision_from_quant_config(mixed, layer + "mlp.gate") == Precision.BF16
    # folded into config.json: flat, `ignore` instead of `exclude_modules`
    folded = {"quant_method": "modelopt", **mixed["quantization"], "ignore": ["*experts.7*"]}
    folded.pop("exclude_modules")
    assert precision_from_quant_config(folded, layer + "mlp.experts.7.up_proj") == Precision.BF16
    assert precision_from_quant_config(folded, layer + "mlp.experts.6.up_proj") == Precision.NVFP4
    # one algorithm for every quantizable module that is not excluded
    uniform = {"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head", "*linear_attn*"]}}
    assert precision_from_quant_config(uniform, layer + "self_attn.o_proj") == Precision.NVFP4
    assert precision_from_quant_config(uniform, "lm_head") == Precision.BF16
    assert precision_from_quant_config(uniform, "model.language_model.norm", quantizable=False) == Precision.BF16
    with pytest.raises(ValueError, match="unsupported quant_algo 'INT4_AWQ'"):
        precision_from_quant_config({"quantization": {"quant_algo": "INT4_AWQ"}}, "lm_head")
    # an unknown top-level algorithm is refused even where quantized_layers covers the module asked about (or the
    # module is not quantizable): the whole config says something this engine does not load
    listed = {"quantization": {**mixed["quantization"], "quant_algo": "INT3"}}
    for path, quantizable in ((layer + "mlp.experts.7.up_proj", True), ("model.language_model.norm", False)):
        with pytest.raises(ValueError, match="quantization.quant_algo: unsupported quant_algo 'INT3'"):
            precision_from_quant_config(listed, path, quantizable=quantizable)


def test_residual_scale_scales_only_residual_outputs_and_rejects_bad_values(tmp_path):
    from vibeqwen.checkpoint.writer import write_checkpoint
    from vibeqwen.config import ModelConfig

    cfg = ModelConfig.named("tiny")
    mods = {m.path: m for m in checkpoint_modules(cfg)}
    down = next(p for p in mods if p.endswith("down_proj"))
    q = next(p for p in mods if p.endswith("q_proj"))
    assert torch.equal(master_weight(mods[down], 0, residual_scale=0.5).float(),
                       (master_weight(mods[down], 0).float() * 0.5).bfloat16().float())
    assert torch.equal(master_weight(mods[q], 0, residual_scale=0.5), master_weight(mods[q], 0))
    for bad in (0, -1.0, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="residual_scale"):
            write_checkpoint(cfg, tmp_path / "bad", residual_scale=bad)
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


@pytest.mark.parametrize("quant, match", [
    ([1], r"hf_quant_config.json: expected a JSON object, got list"),
    ("str", r"hf_quant_config.json: expected a JSON object, got str"),
    ({"producer": {}}, r"hf_quant_config.json: field 'quantization' must be an object"),
    ({"quantization": "x"}, r"hf_quant_config.json: field 'quantization' must be an object"),
    ({"quantization": {}}, r"hf_quant_config.json: quantizes no module"),
    ({"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {}}},
     r"hf_quant_config.json: quantizes no module"),
    ({"quantization": {"quant_algo": "FOO"}}, r"hf_quant_config.json: quant_algo: unsupported quant_algo 'FOO'"),
    ({"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": [1]}},
     r"hf_quant_config.json: field 'quantized_layers' must be an object"),
    ({"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {"lm_head": "NVFP4"}}},
     r"hf_quant_config.json: quantized_layers\['lm_head'\] must be an object"),
    ({"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {"lm_head": {"quant_algo": "INT4"}}}},
     r"hf_quant_config.json: quantized_layers\['lm_head'\]: unsupported quant_algo 'INT4'"),
    ({"quantization": {"quant_algo": "NVFP4", "exclude_modules": "lm_head"}},
     r"hf_quant_config.json: field 'exclude_modules' must be a list"),
])
def test_a_malformed_quant_config_is_named(format_dirs, tmp_path, quant, match):
    """hf_quant_config.json of the wrong shape: one error naming the file and field (no AttributeError, no
    hundreds of tensors reported at the wrong dtype), before any shard is read."""
    ckpt = _copy(format_dirs["modelopt"], tmp_path / "mo")
    (ckpt / "hf_quant_config.json").write_text(json.dumps(quant))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(ckpt)


def test_a_folded_quant_config_that_quantizes_nothing_is_named(format_dirs, tmp_path):
    ckpt = _copy(format_dirs["modelopt-fused"], tmp_path / "mof")
    hf = json.loads((ckpt / "config.json").read_text())
    assert hf["quantization_config"]["quant_method"] == "modelopt"
    hf["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}
    (ckpt / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"config.json quantization_config: quantizes no module"):
        load_checkpoint(ckpt)
