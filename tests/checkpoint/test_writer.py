"""The synthetic checkpoint writer's folder handling and the demo checkpoint's cache: a checkpoint appears whole or
not at all, and processes that build the demo at once share one complete folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vibeqwen.checkpoint import demo, writer
from vibeqwen.config import ModelConfig


def _assert_complete(path: Path) -> None:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        assert (path / shard).stat().st_size > 0, shard
    for name in ("config.json", "generation_config.json", "hf_quant_config.json", "tokenizer.json"):
        assert (path / name).exists(), name
    assert not list(path.parent.glob(path.name + ".partial*"))


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    def fail(_cfg, tmp, *args):
        (tmp / "shard-00000.safetensors").write_bytes(b"x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(writer, "_write_files", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        writer.write_checkpoint(ModelConfig.named("tiny"), tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_filled_by_another_writer_is_not_overwritten(tmp_path, monkeypatch):
    out = tmp_path / "ckpt"
    real = writer._write_files

    def race(cfg, tmp, *args):
        result = real(cfg, tmp, *args)
        out.mkdir()
        (out / "theirs.txt").write_text("another writer's file")
        return result

    monkeypatch.setattr(writer, "_write_files", race)
    with pytest.raises(FileExistsError, match="another process"):
        writer.write_checkpoint(ModelConfig.named("tiny"), out)
    assert [p.name for p in out.iterdir()] == ["theirs.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_written_checkpoint_is_complete_and_shared_readable(tmp_path):
    out = writer.write_checkpoint(ModelConfig.named("tiny"), tmp_path / "a" / "ckpt")
    _assert_complete(out)
    assert out.stat().st_mode & 0o755 == 0o755
    with pytest.raises(FileExistsError, match="not empty"):
        writer.write_checkpoint(ModelConfig.named("tiny"), out)


@pytest.mark.slow
def test_demo_built_by_two_processes_at_once(tmp_path):
    """The new-user report: two servers started together both build the demo; each cleared the other's partial
    folder, one failed with a missing config.json and the cache stayed broken for every later start."""
    env = dict(os.environ, VIBEQWEN_CACHE=str(tmp_path))
    code = "from vibeqwen.checkpoint.demo import demo_checkpoint; print(demo_checkpoint())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1
    _assert_complete(Path(paths.pop()))


def test_demo_rebuilds_an_incomplete_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("VIBEQWEN_CACHE", str(tmp_path))
    path = tmp_path / f"demo-tiny-v{demo.DEMO_VERSION}-seed{demo.DEMO_SEED}"
    path.mkdir()
    (path / "shard-00000.safetensors").write_bytes(b"half a shard")
    (tmp_path / (path.name + ".partial")).mkdir()
    assert demo.demo_checkpoint() == path
    _assert_complete(path)
    assert demo.demo_checkpoint() == path  # the second call reads the cache


def test_demo_replaces_a_file_in_its_folders_place_and_names_an_unusable_lock(tmp_path, monkeypatch):
    """A file where the demo folder goes is removed and the demo built; a folder where its lock file goes is an
    OSError naming the path and VIBEQWEN_CACHE (was a bare errno)."""
    monkeypatch.setenv("VIBEQWEN_CACHE", str(tmp_path))
    path = tmp_path / f"demo-tiny-v{demo.DEMO_VERSION}-seed{demo.DEMO_SEED}"
    path.write_text("not a checkpoint")
    assert demo.demo_checkpoint() == path
    _assert_complete(path)
    other = tmp_path / "other"
    monkeypatch.setenv("VIBEQWEN_CACHE", str(other))
    (other / (path.name + ".lock")).mkdir(parents=True)
    with pytest.raises(OSError, match=r"cannot build the demo checkpoint in .* \(set by VIBEQWEN_CACHE\): Is a "
                                      r"directory: .*\.lock"):
        demo.demo_checkpoint()


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux's /proc (no new folders can be made there)")
def test_an_uncreatable_folder_is_named_as_asked():
    """The error names the folder asked for, not the temporary `.partial-...` one written first."""
    with pytest.raises(OSError) as err:
        writer.write_checkpoint(ModelConfig.named("tiny"), "/proc/vibeqwen-nope", seed=0)
    assert "cannot create /proc/vibeqwen-nope:" in str(err.value) and ".partial" not in str(err.value)
