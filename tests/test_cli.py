"""CLI input checks: bad flags fail fast with one line, before any model is loaded."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def _vibeqwen(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m vibeqwen *args`; env: variables set on top of this process's environment."""
    return subprocess.run([sys.executable, "-m", "vibeqwen", *args], capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


@pytest.mark.parametrize("flag,value", [("--max-model-len", "-5"), ("--max-model-len", "0"), ("--max-num-seqs", "0"),
                                        ("--port", "99999"), ("--gpu-memory-utilization", "1.5")])
def test_bad_serve_flags_are_refused_by_name(flag, value):
    r = _vibeqwen("serve", "--weights", "demo", flag, value)
    assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr


def test_busy_port_fails_before_loading_the_model(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _vibeqwen("serve", "--weights", str(tmp_path / "does-not-exist"), "--port", str(port))
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr


def test_make_checkpoint_unknown_config_says_what_it_expects(tmp_path):
    r = _vibeqwen("make-checkpoint", "--config", "bogus", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "'full'" in r.stderr and "'tiny'" in r.stderr


@pytest.mark.parametrize("args,needle", [
    (("--device", "gpu"), "--device"),
    (("--log-level", "foo"), "--log-level"),
    (("--max-request-bytes", "-5"), "--max-request-bytes"),
    (("--cache-memory-gb", "-1"), "--cache-memory-gb"),
    (("--generation-config", "/nonexistent"), "--generation-config"),
    (("--speculation-policy", "sometimes"), "--speculation-policy"),
    (("--allowed-origins", "*"), "--allowed-origins"),
    (("--allowed-headers", '["a", 1]'), "--allowed-headers"),
])
def test_bad_serve_values_fail_before_loading(args, needle):
    r = _vibeqwen("serve", "--weights", "demo", "--port", "0", *args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only machine's message")
def test_cuda_device_without_a_gpu_is_a_clear_error():
    r = _vibeqwen("serve", "--weights", "demo", "--port", "0", "--device", "cuda")
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("policy,adaptive", [("auto", None), ("always", False), ("cost-aware", True)])
def test_speculation_policy_flag_sets_the_spec_config(policy, adaptive):
    from vibeqwen.cli import _parser, spec_config

    args = _parser().parse_args(["serve", "--weights", "demo", "--speculative", "ngram",
                                 "--num-speculative-tokens", "5", "--speculation-policy", policy])
    spec = spec_config(args)
    assert (spec.method, spec.num_speculative_tokens, spec.adaptive) == ("ngram", 5, adaptive)


@pytest.mark.parametrize("flags,warned", [
    (["--num-speculative-tokens", "5"], ["--num-speculative-tokens 5 has no effect without --speculative"]),
    (["--speculation-policy", "always"], ["--speculation-policy always has no effect without --speculative"]),
    (["--speculative", "ngram", "--num-speculative-tokens", "5", "--speculation-policy", "always"], []),
    (["--prefill-graphs", "--enforce-eager"], ["--prefill-graphs has no effect with --enforce-eager"]),
    ([], []),
])
def test_flags_that_other_flags_make_ineffective_are_warned_about(flags, warned, caplog):
    from vibeqwen.cli import _parser, engine_config, warn_ignored_flags

    args = _parser().parse_args(["serve", "--weights", "demo", *flags])
    with caplog.at_level("WARNING", logger="vibeqwen"):
        warn_ignored_flags(args, engine_config(args))
    assert [r.getMessage() for r in caplog.records] == warned


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CPU cache budget stops the CPU-only machine")
def test_serve_warns_about_an_ignored_flag():
    """`serve` itself logs warn_ignored_flags' warnings (a cache budget over the host's memory stops it after)."""
    r = _vibeqwen("serve", "--weights", "demo", "--port", "0", "--num-speculative-tokens", "5",
                  "--cache-memory-gb", "100000")
    assert r.returncode == 2 and "--num-speculative-tokens 5 has no effect without --speculative" in r.stderr


def test_num_speculative_tokens_defaults_to_the_spec_configs_k():
    from vibeqwen.cli import _parser, spec_config
    from vibeqwen.engine.spec import SpecConfig

    args = _parser().parse_args(["serve", "--weights", "demo", "--speculative", "mtp"])
    assert spec_config(args).num_speculative_tokens == SpecConfig().num_speculative_tokens == 3
    # ignored (warned about) without --speculative: it must not size anything
    args = _parser().parse_args(["serve", "--weights", "demo", "--num-speculative-tokens", "9"])
    assert spec_config(args).num_speculative_tokens == 3 and not spec_config(args).enabled


@pytest.mark.parametrize("flags,value", [([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)])
def test_async_scheduling_flag(flags, value):
    from vibeqwen.cli import _parser

    assert _parser().parse_args(["serve", "--weights", "demo", *flags]).async_scheduling is value


@pytest.mark.parametrize("flags,value", [([], True), (["--prefill-graphs"], True), (["--no-prefill-graphs"], False)])
def test_prefill_graphs_flag(flags, value):
    """--prefill-graphs / --no-prefill-graphs reach EngineConfig.prefill_graphs; on by default, in the config too."""
    from vibeqwen.cli import _parser, engine_config
    from vibeqwen.engine.llm_engine import EngineConfig

    config = engine_config(_parser().parse_args(["serve", "--weights", "demo", *flags]))
    assert config.prefill_graphs is value and EngineConfig().prefill_graphs is True


@pytest.mark.parametrize("flags,value", [([], "w8a8"), (["--fp8-prefill", "w8a16"], "w8a16")])
def test_fp8_prefill_flag(flags, value):
    """--fp8-prefill reaches EngineConfig.fp8_prefill; the CLI's default is the engine's."""
    from vibeqwen.cli import _parser, engine_config
    from vibeqwen.engine.llm_engine import FP8_PREFILL_DEFAULT, EngineConfig

    config = engine_config(_parser().parse_args(["serve", "--weights", "demo", *flags]))
    assert config.fp8_prefill == value
    assert EngineConfig().fp8_prefill == FP8_PREFILL_DEFAULT == _parser().parse_args(
        ["serve", "--weights", "demo"]).fp8_prefill


def test_fp8_prefill_bad_value():
    from vibeqwen.cli import _parser
    from vibeqwen.engine.llm_engine import EngineConfig

    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--weights", "demo", "--fp8-prefill", "fp4"])
    with pytest.raises(ValueError, match="fp8_prefill must be one of w8a8, w8a16"):
        EngineConfig(fp8_prefill="fp4")


@pytest.mark.parametrize("flags,value", [([], "float32"), (["--gdn-state-dtype", "bfloat16"], "bfloat16"),
                                         (["--gdn-state-dtype", "float32"], "float32")])
def test_gdn_state_dtype_flag(flags, value):
    """--gdn-state-dtype reaches EngineConfig.gdn_state_dtype; the CLI's default is the engine's (float32)."""
    from vibeqwen.cli import _parser, engine_config
    from vibeqwen.engine.llm_engine import GDN_STATE_DTYPE_DEFAULT, EngineConfig

    config = engine_config(_parser().parse_args(["serve", "--weights", "demo", *flags]))
    assert config.gdn_state_dtype == value
    assert EngineConfig().gdn_state_dtype == GDN_STATE_DTYPE_DEFAULT == "float32" == _parser().parse_args(
        ["serve", "--weights", "demo"]).gdn_state_dtype


def test_gdn_state_dtype_bad_value():
    from vibeqwen.cli import _parser
    from vibeqwen.engine.llm_engine import EngineConfig

    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--weights", "demo", "--gdn-state-dtype", "float16"])
    with pytest.raises(ValueError, match="gdn_state_dtype must be one of float32, bfloat16, got 'float16'"):
        EngineConfig(gdn_state_dtype="float16")
    r = _vibeqwen("serve", "--weights", "demo", "--port", "0", "--gdn-state-dtype", "fp8")
    assert r.returncode == 2 and "--gdn-state-dtype" in r.stderr and "Traceback" not in r.stderr


def test_help_lists_the_readme_environment_variables():
    """`vibeqwen serve --help` and the README's environment-variable table name the same variables."""
    import pathlib
    import re

    from vibeqwen.cli import ENV_HELP

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Environment variables"):]
    section = section[: section.index("\n## ", 1)]
    names = re.compile(r"\b(?:VIBEQWEN_[A-Z0-9_]+|CUDA_HOME)\b")
    table = {n for line in section.splitlines() if line.startswith("| `") for n in names.findall(line.split("|")[1])}
    assert len(table) >= 15
    assert table == set(names.findall(ENV_HELP)), (table ^ set(names.findall(ENV_HELP)))


def test_version_and_inspect_demo(capsys):
    from vibeqwen import __version__
    from vibeqwen.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"vibeqwen {__version__}"
    assert main(["inspect", "demo"]) == 0  # the built-in demo checkpoint, as `serve --weights demo`
    assert "layout" in capsys.readouterr().out


def test_inspect_into_a_closed_pipe_exits_quietly():
    """`vibeqwen inspect DIR --json | head -c 100` whose reader has left before the report is written (a report
    larger than the pipe holds, or a reader that quit): no BrokenPipeError traceback, the report's exit status."""
    proc = subprocess.Popen([sys.executable, "-m", "vibeqwen", "inspect", "demo", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # gone before the child (still importing) writes: its write fails with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("args,needle", [
    (("--shard-gb", "0"), "--shard-gb"),
    (("--shard-gb", "-1"), "--shard-gb"),
    (("--shard-gb", "nan"), "--shard-gb"),
    (("--shard-gb", "inf"), "--shard-gb"),
    (("--device", "foo"), "--device"),
])
def test_bad_make_checkpoint_values_are_refused_by_name(tmp_path, args, needle):
    r = _vibeqwen("make-checkpoint", "--out", str(tmp_path / "x"), *args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x").exists()


def test_make_checkpoint_into_an_existing_file_is_refused_by_name(tmp_path):
    """The new-user trial: `--out <a file>` printed a bare "[Errno 20] Not a directory"."""
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    r = _vibeqwen("make-checkpoint", "--out", str(f))
    assert r.returncode == 2 and f"--out {f} is an existing file" in r.stderr and "Traceback" not in r.stderr
    assert f.read_text() == "keep me"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only machine's message")
def test_make_checkpoint_on_a_missing_gpu_is_a_clear_error(tmp_path):
    r = _vibeqwen("make-checkpoint", "--out", str(tmp_path / "x"), "--device", "cuda")
    assert r.returncode == 2 and "no CUDA device" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused(key):
    r = _vibeqwen("serve", "--weights", "demo", "--port", "0", "--api-key", key)
    assert r.returncode == 2 and "--api-key must not be empty" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_served_model_name_is_refused(name):
    r = _vibeqwen("serve", "--weights", "demo", "--port", "0", f"--served-model-name={name}")
    assert r.returncode == 2 and "--served-model-name must not be empty" in r.stderr and "Traceback" not in r.stderr


def test_an_unusable_cache_folder_names_its_variable(tmp_path):
    """VIBEQWEN_CACHE under a regular file: the error names the folder and the variable, not a bare errno."""
    (tmp_path / "file").write_text("x")
    r = _vibeqwen("serve", "--weights", "demo", "--port", "0", env={"VIBEQWEN_CACHE": str(tmp_path / "file" / "c")})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"cannot create the vibeqwen cache folder {tmp_path / 'file' / 'c'} (set by VIBEQWEN_CACHE)" in r.stderr


@pytest.mark.parametrize("value", ["x", "999", "-1"])
def test_a_bad_decode_w8a8_switch_fails_before_loading(value):
    r = _vibeqwen("serve", "--weights", "demo", "--port", "0", env={"VIBEQWEN_FP8_DECODE_W8A8": value})
    assert r.returncode == 2 and "VIBEQWEN_FP8_DECODE_W8A8 must be" in r.stderr and "Traceback" not in r.stderr


def test_max_model_len_beyond_the_model_fails_before_loading(monkeypatch):
    """--max-model-len above config.json's max_position_embeddings fails before any weight is read."""
    from vibeqwen import cli
    from vibeqwen.checkpoint import loader

    monkeypatch.setattr(loader, "_read", lambda *a, **k: pytest.fail("weights were read"))
    monkeypatch.setattr(cli, "_check_port_free", lambda host, port: None)
    with pytest.raises(ValueError, match="--max-model-len 10000000 exceeds.*max_position_embeddings"):
        cli._serve(cli._parser().parse_args(["serve", "--weights", "demo", "--max-model-len", "10000000"]))


def test_a_mistyped_weights_path_is_named(tmp_path):
    r = _vibeqwen("serve", "--weights", str(tmp_path / "qwen-nvfp4-typo"), "--port", "0")
    assert r.returncode == 2 and f"{tmp_path / 'qwen-nvfp4-typo'}: no such directory" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_weights_file_is_not_a_directory(tmp_path):
    """--weights naming a file (a shard, say) says it is not a folder, rather than that it does not exist."""
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(b"\0" * 16)
    r = _vibeqwen("serve", "--weights", str(shard), "--port", "0")
    assert r.returncode == 2 and f"{shard}: not a directory" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_inspect_names_a_missing_folder_and_a_file(tmp_path, capsys):
    from vibeqwen.cli import main

    shard = tmp_path / "model.safetensors"
    shard.write_bytes(b"\0" * 16)
    for path, want in ((tmp_path / "typo", "no such directory"), (shard, "not a directory")):
        assert main(["inspect", str(path)]) == 2
        assert f"{path}: {want}" in capsys.readouterr().err


def test_a_huge_shard_size_means_one_shard(tmp_path):
    """--shard-gb larger than any checkpoint (even 1e308) writes a single shard, without an overflow."""
    from vibeqwen.cli import main

    assert main(["make-checkpoint", "--out", str(tmp_path / "x"), "--shard-gb", "1e308"]) == 0
    assert len(list((tmp_path / "x").glob("*.safetensors"))) == 1


@pytest.mark.parametrize("edit,needle", [
    (lambda hf: {}, "config.json: not a Qwen3.6 config"),
    (lambda hf: {"model_type": "qwen3_5_moe"}, "missing field 'text_config'"),
    (lambda hf: {**hf, "text_config": {**hf["text_config"], "hidden_size": "2048"}}, "field 'hidden_size' must be"),
])
def test_a_bad_config_is_named_before_the_missing_tokenizer(tmp_path, edit, needle):
    """A folder with a malformed config.json and no tokenizer files: the config is what the error names."""
    import json

    from vibeqwen.checkpoint.demo import demo_checkpoint

    hf = json.loads((demo_checkpoint() / "config.json").read_text())
    assert "text_config" in hf  # the demo keeps the vendor's multimodal layout, which the edits assume
    (tmp_path / "config.json").write_text(json.dumps(edit(hf)))
    r = _vibeqwen("serve", "--weights", str(tmp_path), "--port", "0")
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert "tokenizer" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("command", [["make-checkpoint", "--out", "x"], ["inspect", "x"],
                                     ["serve", "--weights", "demo", "--port", "0"]])
def test_ctrl_c_before_the_server_runs_is_one_line(command, monkeypatch, capsys):
    """A break-it trial: Ctrl-C while the weights load (or a checkpoint is written) printed a full traceback. It now
    ends the command with one line and the shell's status for SIGINT, 130."""
    from vibeqwen import cli

    def interrupted(args):
        raise KeyboardInterrupt

    for fn in ("_make_checkpoint", "_inspect", "_serve"):
        monkeypatch.setattr(cli, fn, interrupted)
    try:
        code = cli.main(command)
    except KeyboardInterrupt:  # (uncaught it would end the whole test session, not fail this test)
        pytest.fail("main() let the KeyboardInterrupt through")
    assert code == 130
    assert capsys.readouterr().err.strip() == f"vibeqwen: {command[0]} interrupted"


def test_served_name_is_the_folder_name_for_relative_paths(tmp_path, monkeypatch):
    """A break-it trial: `serve --weights .` served the model as '' (Path('.').name)."""
    from pathlib import Path

    from vibeqwen.cli import served_name

    ckpt = tmp_path / "qwen-nvfp4"
    (ckpt / "sub").mkdir(parents=True)
    monkeypatch.chdir(ckpt)
    assert served_name(Path(".")) == "qwen-nvfp4"
    assert served_name(Path("sub/..")) == "qwen-nvfp4"
    assert served_name(Path("./")) == "qwen-nvfp4"
    assert served_name(ckpt) == "qwen-nvfp4"


@pytest.mark.parametrize("content,needle", [("[1, 2]", "expected a JSON object, got list"), ("{oops", "Expecting")])
def test_a_named_generation_config_folder_must_parse(tmp_path, content, needle):
    """A break-it trial: `--generation-config DIR` with a folder but no file was an error, while a corrupt file there
    only logged a warning and served OpenAI's defaults. A folder the user named now has to hold a JSON object."""
    (tmp_path / "generation_config.json").write_text(content)
    r = _vibeqwen("serve", "--weights", "demo", "--port", "0", "--generation-config", str(tmp_path))
    assert r.returncode == 2 and "--generation-config" in r.stderr and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_checkpoints_generation_config_that_is_not_an_object_is_skipped_with_a_warning(tmp_path, caplog):
    """The checkpoint's own file (`auto`) stays a warning (no request is refused for it), also when it is a JSON list
    (ignored without a word before)."""
    from vibeqwen.server.serving import load_generation_defaults

    (tmp_path / "generation_config.json").write_text('[{"temperature": 0.3}]')
    with caplog.at_level("WARNING"):
        assert load_generation_defaults(tmp_path) == {}
    assert "expected a JSON object, got list" in caplog.text
