"""Shared fixtures: a tiny synthetic checkpoint in the vendor layout, built once per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The project's kernels/ folder installs as `vibeqwen_kernels`, but `python -m pytest` run from the repository
# root puts the root first on sys.path, where kernels/ would shadow the unrelated PyPI package `kernels` that
# transformers (>= 5.25 depends on it) imports when building the oracle model. Move the root to the end of the
# path: the project is imported from its install where there is one, and from the root where there is none (a GPU
# host running the tests from a copy of the tree with PYTHONPATH=$PWD, bench/run_h200.sh), while an installed
# `kernels` package always comes first.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT] + [str(_ROOT)]

# The tiny model's ops are microseconds long: one thread per process beats two fighting over 2 cores, and
# server subprocesses started by tests inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from vibeqwen.config import ModelConfig


def pytest_configure(config):
    # pytest-xdist's --dist loadfile hands out the files with the most tests first unless told otherwise: hand them
    # out in the collection order below instead (`--no-loadscope-reorder`)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The files that hold a `slow` test run first, in their order (the others after them, in theirs): `-n auto
    --dist loadfile` hands whole files to the workers in this order (pytest_configure), and a slow file handed out
    last keeps one worker busy alone at the end of the run (two minutes or more of the CI's time)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return ModelConfig.named("tiny")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_config):
    """A tiny-config checkpoint written with seed 0 into several shards."""
    from vibeqwen.checkpoint.writer import write_checkpoint

    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    return write_checkpoint(tiny_config, path, seed=0, max_shard_bytes=16 << 20)


@pytest.fixture(scope="session")
def tiny_model_fp32(tiny_checkpoint):
    """(config, model, checkpoint) on the float32 reference path."""
    from vibeqwen.checkpoint.loader import load_checkpoint
    from vibeqwen.model.qwen import Qwen3_5MoeForCausalLM
    from vibeqwen.model.weights import Weights

    ckpt = load_checkpoint(tiny_checkpoint)
    model = Qwen3_5MoeForCausalLM.from_weights(ckpt.config, Weights(ckpt.tensors, ckpt.precisions, torch.float32))
    return ckpt.config, model, ckpt
