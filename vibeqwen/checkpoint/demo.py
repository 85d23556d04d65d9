"""The built-in demo checkpoint: the tiny config in the vendor layout, built once into a cache folder."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from vibeqwen.config import ModelConfig

log = logging.getLogger(__name__)

DEMO_SEED = 0
# bump when the writer's output changes, so stale demo caches are rebuilt
DEMO_VERSION = 2


def cache_root() -> Path:
    """`$VIBEQWEN_CACHE`, else `$XDG_CACHE_HOME/vibeqwen`, else `~/.cache/vibeqwen`."""
    if os.environ.get("VIBEQWEN_CACHE"):
        return Path(os.environ["VIBEQWEN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vibeqwen"


def demo_checkpoint() -> Path:
    """Path of the demo checkpoint, writing it on first use (a few seconds)."""
    from vibeqwen.checkpoint.writer import write_checkpoint

    path = cache_root() / f"demo-tiny-v{DEMO_VERSION}-seed{DEMO_SEED}"
    if (path / "model.safetensors.index.json").exists():
        return path
    log.info("building the demo checkpoint (tiny config) in %s", path)
    write_checkpoint(ModelConfig.named("tiny"), path, seed=DEMO_SEED, max_shard_bytes=16 << 20)
    return path
