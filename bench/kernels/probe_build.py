"""Builds a probe's CUDA source (bench/kernels/*.cu) into a shared library for ctypes (the GPU probes' drivers)."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


def nvcc_probe(source: str, include_csrc: bool = False) -> ctypes.CDLL:
    """nvcc ``bench/kernels/<source>`` for sm_90a into ``$VIBEQWEN_CACHE/probe/<stem>.so`` and load it (its functions'
    argtypes are the caller's to declare). include_csrc: csrc/ on the include path.

    Raises:
        subprocess.CalledProcessError: the build failed (nvcc's messages are on stderr).
        OSError: the library does not load.
    """
    from vibeqwen_kernels import cuda_build

    out = cuda_build.cache_dir().parent / "probe" / (Path(source).stem + ".so")
    out.parent.mkdir(parents=True, exist_ok=True)
    nvcc = cuda_build._nvcc() or "nvcc"
    include = ["-I", str(HERE.parent.parent / "csrc")] if include_csrc else []
    subprocess.run([nvcc, "-O3", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC", *include, "-o", str(out),
                    str(HERE / source)], check=True)
    return ctypes.CDLL(str(out))
