"""`vibeqwen inspect`: layout, precisions, sizes, problems and MTP from headers alone."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from safetensors.torch import load_file, save_file

from vibeqwen.checkpoint.report import inspect_checkpoint
from vibeqwen.cli import main
from vibeqwen.tokenizer import Tokenizer

# tiny config: 4 layers x (16 experts x 3 + 3 shared-expert projections) + lm_head NVFP4;
# FP8: 3 GDN layers x 3 projections + 4 attention projections
VENDOR_MIX = {"NVFP4": 4 * 51 + 1, "FP8": 13}


@pytest.mark.parametrize("name, layout, mtp", [
    ("modelopt", "modelopt", True),
    ("modelopt-fused", "modelopt", True),
    ("compressed-tensors", "compressed-tensors", False),
    ("bf16", "bf16", True),
])
def test_inspect_each_layout(format_dirs, monkeypatch, name, layout, mtp):
    from vibeqwen.checkpoint import loader

    # reads no weights
    monkeypatch.setattr(loader, "_read", lambda *a, **k: pytest.fail("inspect read weights"))
    rep = inspect_checkpoint(format_dirs[name])
    assert rep["layout"] == layout and rep["has_mtp"] == mtp
    assert rep["loadable"] and rep["problems"] == [] and rep["unexpected"] == []
    assert rep["vision_tensors"] == 2
    prec = {k: v["modules"] for k, v in rep["by_precision"].items()}
    assert sum(v["bytes"] for v in rep["by_precision"].values()) + rep["vision_bytes"] == rep["total_bytes"]
    if layout == "modelopt":
        assert {k: prec[k] for k in VENDOR_MIX} == VENDOR_MIX
        assert rep["experts_fused_layers"] == (0 if name == "modelopt" else 5)  # 4 layers + MTP
    elif layout == "compressed-tensors":
        assert prec == {"NVFP4": 4 * 51 + 4, "BF16": 48}
        lm = [r for r in rep["by_part"] if r["part"] == "lm_head"]
        assert lm == [{"part": "lm_head", "precision": "BF16", "modules": 1, "bytes": 248320 * 64 * 2}]
    else:
        assert set(prec) == {"BF16"}
        assert {k: rep["precisions_at_load"][k] for k in VENDOR_MIX} == VENDOR_MIX


def test_inspect_cli_text_and_json(format_dirs, capsys):
    assert main(["inspect", str(format_dirs["compressed-tensors"])]) == 0
    out = capsys.readouterr().out
    assert "layout       compressed-tensors" in out
    assert "MTP          ABSENT" in out and "verdict      loadable" in out
    assert main(["inspect", "--json", str(format_dirs["bf16"])]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["layout"] == "bf16" and rep["experts_fused_layers"] == 5


def test_inspect_reports_missing_and_unexpected_tensors(tiny_checkpoint, tmp_path, capsys):
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "broken")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    name = "model.language_model.layers.0.mlp.shared_expert.down_proj.weight_scale"
    shard = ckpt / index["weight_map"][name]
    tensors = load_file(shard)
    tensors["model.language_model.layers.0.mlp.stray"] = tensors.pop(name)
    save_file(tensors, shard, metadata={"format": "pt"})
    assert main(["inspect", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert f"tensor '{name}' is missing from every shard (expected F8_E4M3[64, 2]" in out
    assert "unexpected   1 tensor(s)" in out and "model.language_model.layers.0.mlp.stray" in out
    assert "verdict      NOT loadable" in out


def test_inspect_refuses_unknown_architecture(tiny_checkpoint, tmp_path, capsys):
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "other")
    hf = json.loads((ckpt / "config.json").read_text())
    hf["architectures"] = ["LlamaForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(hf))
    assert main(["inspect", str(ckpt)]) == 2
    assert "LlamaForCausalLM is not served" in capsys.readouterr().err
    assert main(["inspect", "--json", str(ckpt)]) == 2  # --json: still JSON, with the reason
    rep = json.loads(capsys.readouterr().out)
    assert rep["loadable"] is False and "LlamaForCausalLM is not served" in rep["error"]


@pytest.mark.parametrize("damage", ["truncate", "delete", "directory"])
def test_inspect_reports_a_truncated_or_missing_shard_once(tiny_checkpoint, tmp_path, capsys, damage):
    """A shard that cannot be read is a problem of the report (exit 1, JSON with --json), named once: not as
    every tensor the index places in it. A directory in a shard's place is called that, not missing."""
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "cut")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    shard = ckpt / shards[0]
    if damage == "truncate":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 1000)
    else:
        shard.unlink()
        if damage == "directory":
            shard.mkdir()
    assert main(["inspect", "--json", str(ckpt)]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert not rep["loadable"] and len(rep["problems"]) == 1, rep["problems"]
    assert str(shard) in rep["problems"][0]
    word = {"truncate": "truncated", "delete": "missing", "directory": "a directory, not a safetensors file"}
    assert word[damage] in rep["problems"][0]
    assert main(["inspect", str(ckpt)]) == 1
    assert "verdict      NOT loadable" in capsys.readouterr().out


def test_inspect_reports_missing_tokenizer_files(tiny_checkpoint, tmp_path, capsys):
    """`serve` needs tokenizer.json and tokenizer_config.json: inspect says so (exit 1)."""
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "notok")
    (ckpt / "tokenizer.json").unlink()
    assert main(["inspect", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert f"{ckpt / 'tokenizer.json'}: missing" in out and "verdict      NOT loadable" in out
    assert main(["inspect", "--json", str(ckpt)]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["problems"]) == 1 and "tokenizer.json: missing" in rep["problems"][0]


@pytest.mark.parametrize("tokenizer,needle", [
    ({"nope": 1}, "valid JSON, but not a tokenizer the `tokenizers` library can load"),
    ({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "[UNK]": 2}, "unk_token": "[UNK]"}},
     "lacks <|im_end|> or <|endoftext|>")])
def test_inspect_loads_the_tokenizer_as_serve_does(tiny_checkpoint, tmp_path, capsys, tokenizer, needle):
    """A new user's report: a tokenizer.json that is a JSON object but no usable tokenizer passed `inspect`
    ("verdict loadable") while `serve` refused it, for `{"nope": 1}` with a message about a missing `,`."""
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "badtok")
    (ckpt / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert main(["inspect", "--json", str(ckpt)]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert not rep["loadable"] and len(rep["problems"]) == 1, rep["problems"]
    assert needle in rep["problems"][0] and str(ckpt / "tokenizer.json") in rep["problems"][0], rep["problems"]
    with pytest.raises(ValueError, match=re.escape(needle)):
        Tokenizer.from_dir(ckpt)


def test_inspect_reads_the_tokenizer_config_as_serve_does(tiny_checkpoint, tmp_path, capsys):
    """The older AddedToken form of eos_token loads (it crashed `inspect` with a TypeError); another type, a deeply
    nested tokenizer.json: problems named, not tracebacks."""
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "eos")
    config_path = ckpt / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token"] = {"content": "<|im_end|>", "__type": "AddedToken"}
    config_path.write_text(json.dumps(config))
    assert main(["inspect", "--json", str(ckpt)]) == 0
    assert json.loads(capsys.readouterr().out)["problems"] == []
    tok = Tokenizer.from_dir(ckpt)
    assert tok.eos_token_ids[0] == Tokenizer.from_dir(tiny_checkpoint).eos_token_ids[0]
    assert tok.config["eos_token"] == "<|im_end|>"  # what a template's {{ eos_token }} renders
    config["eos_token"] = 5
    config_path.write_text(json.dumps(config))
    assert main(["inspect", "--json", str(ckpt)]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert len(problems) == 1 and f"malformed {config_path}: eos_token must be a token's text, got 5" in problems[0]
    config.pop("chat_template", None)
    config_path.write_text(json.dumps({**config, "eos_token": "<|im_end|>"}))
    (ckpt / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    assert main(["inspect", "--json", str(ckpt)]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert len(problems) == 1 and f"malformed {ckpt / 'chat_template.jinja'}: not UTF-8" in problems[0], problems
    (ckpt / "chat_template.jinja").unlink()
    config_path.write_text(json.dumps({**config, "eos_token": "<|im_end|>"}))
    (ckpt / "tokenizer.json").write_text("[" * 200_000)
    assert main(["inspect", "--json", str(ckpt)]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert len(problems) == 1 and "tokenizer.json" in problems[0], problems


@pytest.mark.parametrize("header", [b"[]", b'{"x": 3}'])
def test_inspect_reports_a_shard_whose_header_is_not_tensor_entries(tiny_checkpoint, tmp_path, capsys, header):
    """Valid JSON that is not safetensors' object of tensor entries: the shard's problem, not a traceback."""
    import struct

    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "odd")
    shard = ckpt / min(set(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"].values()))
    shard.write_bytes(struct.pack("<Q", len(header)) + header)
    assert main(["inspect", "--json", str(ckpt)]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["problems"]) == 1 and "not a safetensors file" in rep["problems"][0]
    assert rep["shards"] == len(set(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"].values()))


def _rewrite_header(shard, edit):
    """Rewrite a safetensors shard's header through `edit(header dict)`, keeping its data bytes."""
    import struct

    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


@pytest.mark.parametrize("damage,needle", [
    (lambda e: e.pop("data_offsets"), "malformed header entry"),
    (lambda e: e.__setitem__("data_offsets", "ab"), "malformed header entry"),
    (lambda e: e.__setitem__("data_offsets", e["data_offsets"][::-1]), "malformed header entry"),
    (lambda e: e.__setitem__("data_offsets", [e["data_offsets"][0], e["data_offsets"][0] + 10]), "span 10 bytes"),
    (lambda e: e.__setitem__("shape", [float(d) for d in e["shape"]]), "malformed header entry"),
])
def test_inspect_and_serve_refuse_a_malformed_tensor_entry(tiny_checkpoint, tmp_path, capsys, damage, needle):
    """A header entry whose offsets are missing, not integers, reversed or disagree with dtype x shape: a problem
    of its shard in `inspect` (exit 1, JSON), and a one-line error from the loader, not a traceback."""
    from vibeqwen.checkpoint.loader import CheckpointError, load_checkpoint

    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "entry")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    name = "model.language_model.embed_tokens.weight"
    _rewrite_header(ckpt / index["weight_map"][name], lambda h: damage(h[name]))
    assert main(["inspect", "--json", str(ckpt)]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["problems"]) == 1 and needle in rep["problems"][0] and name in rep["problems"][0], rep["problems"]
    with pytest.raises(CheckpointError, match=needle):
        load_checkpoint(ckpt)


def test_inspect_checks_the_config_and_tokenizer_files_are_json_objects(tiny_checkpoint, tmp_path, capsys):
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "files")
    (ckpt / "tokenizer.json").write_text("garbage")
    (ckpt / "tokenizer_config.json").write_text("[]")
    assert main(["inspect", "--json", str(ckpt)]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert len(problems) == 2 and "tokenizer.json: not valid JSON" in problems[0]
    assert "tokenizer_config.json: not a JSON object" in problems[1]
    (ckpt / "config.json").write_text("[]")
    assert main(["inspect", "--json", str(ckpt)]) == 2
    assert "config.json: expected a JSON object, got list" in json.loads(capsys.readouterr().out)["error"]


@pytest.mark.parametrize("target", ["/etc/passwd", "../../etc/passwd", ""])
def test_an_index_pointing_outside_the_checkpoint_is_refused(tiny_checkpoint, tmp_path, capsys, target):
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "escape")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.language_model.embed_tokens.weight"] = target
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["inspect", "--json", str(ckpt)]) == 2
    assert "relative paths inside the checkpoint" in json.loads(capsys.readouterr().out)["error"]
