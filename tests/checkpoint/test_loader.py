"""Loader validation: every failure names the file and the tensor, and nothing half-built survives."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from vibeqwen.checkpoint.layout import expected_tensors
from vibeqwen.checkpoint.loader import CheckpointError, load_checkpoint
from vibeqwen.config import ConfigError

EXPERT = "model.language_model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture
def ckpt_copy(tiny_checkpoint, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(tiny_checkpoint, dst)
    return dst


def _shard_of(ckpt, name):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    return ckpt / index["weight_map"][name]


def _rewrite(shard, edit):
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def test_loads_every_expected_tensor(tiny_checkpoint, tiny_config):
    ckpt = load_checkpoint(tiny_checkpoint)
    assert set(ckpt.tensors) == set(expected_tensors(tiny_config))
    assert ckpt.has_mtp
    index = json.loads((tiny_checkpoint / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2, "the tiny checkpoint should be sharded"
    assert ckpt.tensors[EXPERT].dtype == torch.uint8
    assert ckpt.tensors["lm_head.weight_scale"].dtype == torch.float8_e4m3fn
    assert ckpt.tensors["model.language_model.layers.3.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn


def test_missing_tensor_names_it(ckpt_copy):
    _rewrite(_shard_of(ckpt_copy, EXPERT), lambda t: t.pop(EXPERT))
    with pytest.raises(CheckpointError, match=r"experts\.3\.up_proj\.weight.*missing"):
        load_checkpoint(ckpt_copy)


def test_wrong_shape_names_file_tensor_and_shapes(ckpt_copy):
    shard = _shard_of(ckpt_copy, EXPERT)
    _rewrite(shard, lambda t: t.__setitem__(EXPERT, t[EXPERT][:, :-1].contiguous()))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt_copy)
    msg = str(e.value)
    assert shard.name in msg and EXPERT in msg and "U8[32, 31]" in msg and "expected U8[32, 32]" in msg


def test_wrong_dtype_is_reported(ckpt_copy):
    name = "model.language_model.layers.0.linear_attn.out_proj.weight"
    _rewrite(_shard_of(ckpt_copy, name), lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    with pytest.raises(CheckpointError, match=r"out_proj\.weight.*BF16.*expected F8_E4M3"):
        load_checkpoint(ckpt_copy)


def test_truncated_shard_is_reported_as_truncated(ckpt_copy):
    shard = _shard_of(ckpt_copy, EXPERT)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*truncated"):
        load_checkpoint(ckpt_copy)


@pytest.mark.parametrize("name,value", [("model.language_model.norm.weight", float("nan")),
                                        ("model.language_model.layers.0.linear_attn.A_log", float("inf"))])
def test_a_non_finite_value_is_refused(ckpt_copy, name, value, monkeypatch):
    """The new-user trial: a NaN in the final norm's weight loaded without a word and served token 0 with logprobs at
    the floor. A NaN or inf in a bf16 / fp32 tensor now stops the load, naming the shard and the tensor (also when the
    value sits past the first of the check's chunks)."""
    import vibeqwen.checkpoint.loader as L

    monkeypatch.setattr(L, "_FINITE_CHUNK", 32)  # norm.weight (64 values) spans two chunks
    shard = _shard_of(ckpt_copy, name)

    def poison(t):
        flat = t[name].reshape(-1).clone()
        flat[-1] = value
        t[name] = flat.reshape(t[name].shape)

    _rewrite(shard, poison)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor {name} holds NaN or infinite values"):
        load_checkpoint(ckpt_copy)


FP8_WEIGHT = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"
BLOCK_SCALE = "model.language_model.layers.1.mlp.experts.3.up_proj.weight_scale"
GLOBAL_SCALE = "model.language_model.layers.1.mlp.shared_expert.up_proj.weight_scale_2"


@pytest.mark.parametrize("name,byte,what", [
    (FP8_WEIGHT, 0x7F, "NaN or infinite values"),  # e4m3 NaN (+)
    (FP8_WEIGHT, 0xFF, "NaN or infinite values"),  # e4m3 NaN (-)
    (BLOCK_SCALE, 0x7F, "NaN, infinite or negative values"),
    (BLOCK_SCALE, 0xB8, "NaN, infinite or negative values"),  # -1.0 as a block scale
])
def test_fp8_nan_codes_and_negative_block_scales_are_refused(ckpt_copy, name, byte, what, monkeypatch):
    """A break-it trial: a NaN byte in an FP8 weight loaded without a word (the value check skipped fp8 tensors) and
    the engine served one token at the logprob floor. fp8 (e4m3) tensors are now checked by their bytes, and the
    quantization scales must not be negative either. The bad byte is the tensor's last: past the check's first chunk
    for the FP8 weight (8192 elements; a larger chunk than the bf16 test's keeps the vocabulary-sized tensors'
    checks fast)."""
    import vibeqwen.checkpoint.loader as L

    monkeypatch.setattr(L, "_FINITE_CHUNK", 4096)
    shard = _shard_of(ckpt_copy, name)

    def poison(t):
        flat = t[name].reshape(-1).view(torch.uint8).clone()
        flat[-1] = byte
        t[name] = flat.view(torch.float8_e4m3fn).reshape(t[name].shape)

    _rewrite(shard, poison)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor {name} holds {what}"):
        load_checkpoint(ckpt_copy)


@pytest.mark.parametrize("value", [-1.0, float("inf")])
def test_a_negative_or_infinite_global_scale_is_refused(ckpt_copy, value):
    """The same trial: weight_scale_2 = -1e30 on a shared expert served every token at a uniform distribution. A
    negative (or non-finite) global scale now stops the load, naming the tensor; -0.0 and 0 bytes stay accepted."""
    shard = _shard_of(ckpt_copy, GLOBAL_SCALE)
    _rewrite(shard, lambda t: t.__setitem__(GLOBAL_SCALE, torch.full_like(t[GLOBAL_SCALE], value)))
    with pytest.raises(CheckpointError, match=rf"tensor {GLOBAL_SCALE} holds NaN, infinite or negative values"):
        load_checkpoint(ckpt_copy)


def test_negative_fp8_weights_and_signed_zero_scales_load(ckpt_copy):
    """Negative FP8 weight codes are ordinary values, and a scale of -0.0 is 0 (a block scale's byte 0x80, a float
    global scale): all load."""
    shard = _shard_of(ckpt_copy, BLOCK_SCALE)

    def edit(t):
        flat = t[BLOCK_SCALE].reshape(-1).view(torch.uint8).clone()
        flat[0] = 0x80
        t[BLOCK_SCALE] = flat.view(torch.float8_e4m3fn).reshape(t[BLOCK_SCALE].shape)

    _rewrite(shard, edit)
    _rewrite(_shard_of(ckpt_copy, GLOBAL_SCALE),
             lambda t: t.__setitem__(GLOBAL_SCALE, torch.full_like(t[GLOBAL_SCALE], -0.0)))
    ckpt = load_checkpoint(ckpt_copy)
    assert bool((ckpt.tensors[FP8_WEIGHT].float() < 0).any())  # the writer's random weights have negative codes


def test_random_bytes_are_not_a_safetensors_file(ckpt_copy):
    """A shard of random bytes (its first 8 read as a huge header length) is said not to be safetensors at all."""
    shard = _shard_of(ckpt_copy, EXPERT)
    size = shard.stat().st_size
    shard.write_bytes(b"\xf4" * 8 + bytes(size - 8))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: not a safetensors file .*at most 100000000"):
        load_checkpoint(ckpt_copy)


def test_a_tensor_in_two_shards_is_refused(ckpt_copy):
    """A tensor stored in two shards (which copy is meant is ambiguous) stops the load, naming the tensor and both
    shards; `inspect` reports it as the later shard's problem."""
    from vibeqwen.checkpoint.report import inspect_checkpoint

    home = _shard_of(ckpt_copy, EXPERT)
    other = next(p for p in sorted(ckpt_copy.glob("*.safetensors")) if p != home)
    value = load_file(home)[EXPERT]
    _rewrite(other, lambda t: t.update({EXPERT: value}))
    later, earlier = max(home, other), min(home, other)
    with pytest.raises(CheckpointError, match=rf"{later.name}: tensor {EXPERT} is also in {earlier.name}"):
        load_checkpoint(ckpt_copy)
    rep = inspect_checkpoint(ckpt_copy)
    assert not rep["loadable"]


def test_an_empty_config_is_not_a_qwen_config(ckpt_copy):
    (ckpt_copy / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a Qwen3.6 config"):
        load_checkpoint(ckpt_copy)


def test_unknown_architecture_is_refused(ckpt_copy):
    (ckpt_copy / "config.json").write_text(json.dumps({"model_type": "llama", "text_config": {}}))
    with pytest.raises(ConfigError, match="llama.*not served.*Qwen3.6-35B-A3B"):
        load_checkpoint(ckpt_copy)


def test_missing_shard_is_named(ckpt_copy):
    shard = _shard_of(ckpt_copy, EXPERT)
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*missing"):
        load_checkpoint(ckpt_copy)


def test_bad_config_field_is_named(ckpt_copy, tiny_checkpoint):
    hf = json.loads((tiny_checkpoint / "config.json").read_text())
    hf["text_config"]["num_key_value_heads"] = 3
    (ckpt_copy / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match="num_attention_heads.*num_key_value_heads"):
        load_checkpoint(ckpt_copy)
    del hf["text_config"]["hidden_size"]
    (ckpt_copy / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match="missing field 'hidden_size'"):
        load_checkpoint(ckpt_copy)


def test_config_values_the_engine_cannot_honour_are_refused(ckpt_copy, tiny_checkpoint):
    """A config that would load and serve garbage, or serve as Qwen3.6 what it says is another model, stops the load
    with the field named: a NaN or non-positive rope_theta, an rms_norm_eps that is NaN, not positive or not small,
    and the fields the forward pass hard-codes (activation, attention bias, output gate, tied embeddings) at other
    values; a config without its text_config says so."""
    good = json.loads((tiny_checkpoint / "config.json").read_text())

    def refused(edit, match):
        hf = json.loads(json.dumps(good))
        edit(hf["text_config"])
        (ckpt_copy / "config.json").write_text(json.dumps(hf))
        with pytest.raises(ConfigError, match=match):
            load_checkpoint(ckpt_copy)

    for theta in (float("nan"), float("inf"), -1.0, 0):
        refused(lambda t: t["rope_parameters"].update(rope_theta=theta),
                r"'rope_parameters.rope_theta' must be a positive")
    refused(lambda t: t["rope_parameters"].pop("rope_theta"), r"missing field 'rope_parameters.rope_theta'")
    for eps in (float("nan"), -1.0, 0.0, 1e300):
        refused(lambda t: t.update(rms_norm_eps=eps), r"'rms_norm_eps' must be a small positive number")
    for name, value in (("hidden_act", "gelu"), ("attention_bias", True), ("attn_output_gate", False),
                        ("tie_word_embeddings", True), ("attention_bias", 0)):
        refused(lambda t: t.update({name: value}), rf"field '{name}' must be .*the only value the engine implements")
    hf = json.loads(json.dumps(good))
    del hf["text_config"]
    (ckpt_copy / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match="missing field 'text_config'"):
        load_checkpoint(ckpt_copy)
    (ckpt_copy / "config.json").write_text(json.dumps(good))
    load_checkpoint(ckpt_copy)  # the unedited config loads


def test_checkpoint_without_mtp_loads(ckpt_copy, caplog):
    index_file = ckpt_copy / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for shard in set(index["weight_map"].values()):
        _rewrite(ckpt_copy / shard, lambda t: [t.pop(k) for k in [k for k in t if k.startswith("mtp.")]])
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    index_file.write_text(json.dumps(index))
    ckpt = load_checkpoint(ckpt_copy)
    assert not ckpt.has_mtp and not any(k.startswith("mtp.") for k in ckpt.tensors)
    assert "MTP speculative decoding is unavailable" in caplog.text


def test_cli_serve_on_broken_checkpoint_exits_with_message(ckpt_copy):
    _rewrite(_shard_of(ckpt_copy, EXPERT), lambda t: t.pop(EXPERT))
    r = subprocess.run([sys.executable, "-m", "vibeqwen", "serve", "--weights", str(ckpt_copy), "--port", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "experts.3.up_proj.weight" in r.stderr and "missing" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_missing_tokenizer_fails_before_the_weights_load(ckpt_copy, monkeypatch):
    """LLMEngine.from_checkpoint loads the tokenizer first: a checkpoint without one fails without reading weights
    (on the full model a load is ~20 GB)."""
    from vibeqwen.checkpoint import loader
    from vibeqwen.engine.llm_engine import LLMEngine

    (ckpt_copy / "tokenizer_config.json").unlink()
    monkeypatch.setattr(loader, "_read", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        LLMEngine.from_checkpoint(ckpt_copy)


def test_an_abandoned_load_does_not_read_the_other_shards(ckpt_copy, monkeypatch):
    """A review's finding: Ctrl-C while the weights load printed its line only after every shard was read (the
    reader pool's exit waited for them: minutes for the full model). The first error (here a KeyboardInterrupt from
    a reader, as Ctrl-C in the caller's thread) now cancels the shards not started and stops the running ones at their
    next chunk."""
    import threading

    import vibeqwen.checkpoint.loader as L

    real = L._read_shard
    seen = []

    def reader(shard, names, headers, device, asm, bar, stop=None):
        seen.append(shard.name)
        if len(seen) == 1:
            raise KeyboardInterrupt
        return real(shard, names, headers, device, asm, bar, stop)

    monkeypatch.setattr(L, "_read_shard", reader)
    assert len(list(ckpt_copy.glob("*.safetensors"))) >= 2
    with pytest.raises(KeyboardInterrupt):
        load_checkpoint(ckpt_copy, num_threads=1)
    assert len(seen) == 1, seen
    # a reader told to stop returns before its first chunk and delivers nothing
    stop = threading.Event()
    stop.set()
    delivered = []

    class Asm:
        def deliver(self, name, t):
            delivered.append(name)

    from vibeqwen.checkpoint.loader import read_headers

    shard = _shard_of(ckpt_copy, EXPERT)
    headers = read_headers(ckpt_copy)
    names = [n for n, (s, _) in headers.items() if s == shard]
    real(shard, names, headers, torch.device("cpu"), Asm(), type("Bar", (), {"update": lambda self, n: None})(), stop)
    assert delivered == [n for n in names if headers[n][1]["data_offsets"][0] == headers[n][1]["data_offsets"][1]]
