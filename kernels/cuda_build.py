"""Build the CUDA C++ sources in `csrc/` (package `vibeqwen_csrc`) on first use and load them with ctypes.

Each source becomes a shared library compiled by `nvcc` for the current GPU's architecture and cached in
``csrc/`` of the vibeqwen cache root (``$VIBEQWEN_CACHE``, default ``~/.cache/vibeqwen``) under a name that hashes the source, the
architecture and the nvcc version, so an edited source or another GPU rebuilds. The libraries export plain
C functions that take raw device pointers and a CUDA stream (no PyTorch headers: a build takes seconds).

Callers treat a failed build as "no CUDA kernel here" (:func:`load_library` returns None and logs why once)
and fall back to their Triton kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
from functools import cache
from importlib import resources
from pathlib import Path

log = logging.getLogger(__name__)


def _nvcc() -> str | None:
    """Path of nvcc: $CUDA_HOME/bin/nvcc, then PATH, then /usr/local/cuda/bin/nvcc."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if root and os.path.exists(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None


def cache_dir() -> Path:
    """Where built libraries go: `csrc/` under the vibeqwen cache root, `$VIBEQWEN_CACHE`, else
    `$XDG_CACHE_HOME/vibeqwen`, else `~/.cache/vibeqwen` (the demo checkpoint's and tokenizer's rule)."""
    root = os.environ.get("VIBEQWEN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "vibeqwen")
    return Path(root) / "csrc"


def _read_csrc(filename: str) -> bytes:
    """csrc/<filename> as installed (package `vibeqwen_csrc`), else from the source tree next to this file (an
    editable install made before the package existed). Raises OSError when neither has it."""
    try:
        return (resources.files("vibeqwen_csrc") / filename).read_bytes()
    except (FileNotFoundError, ModuleNotFoundError, OSError):
        return (Path(__file__).resolve().parent.parent / "csrc" / filename).read_bytes()


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#include[ \t]+"([A-Za-z0-9_.]+\.cuh)"[ \t]*$', re.MULTILINE)


def _read_source(name: str) -> bytes:
    """csrc/<name>.cu with every ``#include "x.cuh"`` line replaced by csrc/x.cuh (recursively, each header once):
    the text nvcc compiles and the build cache's key hashes, so an edited header rebuilds every source using it.
    Raises OSError for a missing source or header."""
    seen: set[bytes] = set()

    def expand(text: bytes) -> bytes:
        def one(m: re.Match) -> bytes:
            if m.group(1) in seen:
                return b""
            seen.add(m.group(1))
            return expand(_read_csrc(m.group(1).decode()))

        return _LOCAL_INCLUDE.sub(one, text)

    return expand(_read_csrc(f"{name}.cu"))


@cache
def device_capability(device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA ``device`` (torch.device), asked once per device (launch paths
    call it on every launch)."""
    import torch

    return torch.cuda.get_device_capability(device)


def device_arch(device) -> str:
    """nvcc's ``-arch`` for a CUDA ``device`` (torch.device): ``sm_90a`` on Hopper (wgmma and the other
    arch-specific instructions need it), else ``sm_XY``."""
    major, minor = device_capability(device)
    return f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


#: nvcc flags besides -arch (part of the cache key)
_FLAGS = ("-O3", "-shared", "-Xcompiler", "-fPIC")


@cache
def load_library(name: str, arch: str) -> ctypes.CDLL | None:
    """The library built from ``csrc/<name>.cu`` for ``arch`` (e.g. ``"sm_90"``), or None when the source,
    nvcc or the build is missing or fails (the reason is logged once; never raises). Set
    VIBEQWEN_NO_CUDA_EXT=1 to skip all CUDA sources."""
    if os.environ.get("VIBEQWEN_NO_CUDA_EXT", "0") not in ("", "0"):
        return None
    try:
        src = _read_source(name)
    except OSError as exc:
        log.warning("CUDA source %s.cu not found (%s): using the Triton kernels", name, exc)
        return None
    nvcc = _nvcc()
    if nvcc is None:
        log.warning("nvcc not found (set CUDA_HOME): %s.cu not built, using the Triton kernels", name)
        return None
    try:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False).stdout
        key = hashlib.sha256(src + arch.encode() + version.encode() + " ".join(_FLAGS).encode()).hexdigest()[:16]
        out = cache_dir() / f"{name}-{arch}-{key}.so"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            # per-process source and output: concurrent builders never read a half-written file
            tmp_src = out.with_suffix(f".{os.getpid()}.cu")
            tmp_out = out.with_suffix(f".{os.getpid()}.tmp")
            tmp_src.write_bytes(src)
            cmd = [nvcc, *_FLAGS, f"-arch={arch}", "-o", str(tmp_out), str(tmp_src)]
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
            finally:
                tmp_src.unlink(missing_ok=True)
            if res.returncode != 0:
                log.warning("building %s.cu failed (using the Triton kernels): %s\n%s", name, " ".join(cmd),
                            (res.stderr or res.stdout)[-2000:])
                return None
            os.replace(tmp_out, out)  # atomic: concurrent builders agree
            log.info("built %s", out)
        return ctypes.CDLL(str(out))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("building or loading %s.cu failed (%s): using the Triton kernels", name, exc)
        return None


def hopper_library(name: str, device, signatures: dict) -> ctypes.CDLL | None:
    """The library built from ``csrc/<name>.cu`` for a CUDA ``device`` (torch.device) of sm_90 or later, each function
    in ``signatures`` (name -> ctypes argtypes list) typed with those arguments and an int return (the launchers'
    0 or CUDA error code), once per library. None on CPU, before sm_90, or when :func:`load_library` gives none."""
    if device.type != "cuda" or device_capability(device)[0] < 9:
        return None
    lib = load_library(name, device_arch(device))
    if lib is not None and not getattr(lib, "_vq_typed", False):
        for fn, argtypes in signatures.items():
            f = getattr(lib, fn)
            f.restype = ctypes.c_int
            f.argtypes = argtypes
        lib._vq_typed = True
    return lib
