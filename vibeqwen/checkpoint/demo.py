"""The built-in demo checkpoint: the tiny config in the vendor layout, built once into a cache folder."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
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


def _cache_source() -> str:
    """Which setting chose :func:`cache_root` (for error messages)."""
    if os.environ.get("VIBEQWEN_CACHE"):
        return "set by VIBEQWEN_CACHE"
    if os.environ.get("XDG_CACHE_HOME"):
        return "under XDG_CACHE_HOME; set VIBEQWEN_CACHE to use another folder"
    return "the default; set VIBEQWEN_CACHE to use another folder"


def demo_checkpoint() -> Path:
    """Path of the demo checkpoint, writing it on first use (a few seconds).

    Safe to call from several processes at once (servers and test runs sharing one cache): the build holds a lock
    file next to the checkpoint, so one process writes it and the others wait for it, then use it. A folder left
    incomplete (an earlier version's interrupted build: no index file) is removed and rebuilt.

    Raises:
        OSError: the cache folder cannot be created or the demo cannot be built there (the message names the path
            and the variable that chose the folder)."""
    from vibeqwen.checkpoint.writer import write_checkpoint

    path = cache_root() / f"demo-tiny-v{DEMO_VERSION}-seed{DEMO_SEED}"
    if _complete(path):
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create the vibeqwen cache folder {path.parent} ({_cache_source()}): "
                      f"{e.strerror or e}") from e
    try:
        with _exclusive(path.with_name(path.name + ".lock")):
            if _complete(path):  # another process built it while this one waited
                return path
            for stale in [path, *path.parent.glob(path.name + ".partial*")]:
                if stale.is_dir() and not stale.is_symlink():
                    log.warning("removing the incomplete demo checkpoint folder %s", stale)
                    shutil.rmtree(stale)
                elif stale.exists() or stale.is_symlink():
                    log.warning("removing %s, which is in the demo checkpoint folder's place", stale)
                    stale.unlink()
            log.info("building the demo checkpoint (tiny config) in %s", path)
            write_checkpoint(ModelConfig.named("tiny"), path, seed=DEMO_SEED, max_shard_bytes=16 << 20)
    except OSError as e:
        raise OSError(f"cannot build the demo checkpoint in {path} ({_cache_source()}): "
                      f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}") from e
    return path


def _complete(path: Path) -> bool:
    """Whether `path` holds a finished checkpoint (the writer renames a folder into place whole, index included)."""
    return (path / "model.safetensors.index.json").exists()


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Holds an exclusive advisory lock (flock) on `lock_path` while the block runs; blocks until it is free."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock (the writer's rename still keeps a reader from partial files)
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
