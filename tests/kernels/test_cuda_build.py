"""kernels/cuda_build.py on the CPU: the sources nvcc gets (shared csrc/*.cuh headers inlined), the build key
following a header's edit, and the architecture string."""

from __future__ import annotations

import pytest
import vibeqwen_kernels.cuda_build as cb


@pytest.mark.parametrize("name", ["moe_mma", "fp8_mma", "bf16_mma"])
def test_sources_inline_the_shared_header(name):
    src = cb._read_source(name)
    header = cb._read_csrc("mma_common.cuh")
    assert cb._LOCAL_INCLUDE.search(src) is None  # no local include left for nvcc to resolve
    assert header in src and src.count(b"__device__ __forceinline__ void pdl_wait(int pdl)") == 1


def test_include_expansion(monkeypatch):
    """Each local header inlined once (a second include of it and a header's own include of itself vanish);
    angle-bracket includes stay; a missing header raises OSError; an edited header changes the text (the key)."""
    files = {
        "a.cu": b'#include <cuda_runtime.h>\n#include "h.cuh"\n  #include "h.cuh"\nint main_body;\n',
        "h.cuh": b'#pragma once\n#include "h.cuh"\nint helper;\n',
        "b.cu": b'#include "missing.cuh"\n',
    }

    def read(filename):
        if filename not in files:
            raise FileNotFoundError(filename)
        return files[filename]

    monkeypatch.setattr(cb, "_read_csrc", read)
    assert cb._read_source("a") == b"#include <cuda_runtime.h>\n#pragma once\n\nint helper;\n\n\nint main_body;\n"
    with pytest.raises(OSError):
        cb._read_source("b")
    before = cb._read_source("a")
    files["h.cuh"] = b"int helper2;\n"
    assert cb._read_source("a") != before


def test_device_arch(monkeypatch):
    import torch

    caps = {0: (9, 0), 1: (8, 9), 2: (10, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: caps[d.index])
    cb.device_capability.cache_clear()
    try:
        assert cb.device_arch(torch.device("cuda", 0)) == "sm_90a"  # Hopper: the arch-specific target
        assert cb.device_arch(torch.device("cuda", 1)) == "sm_89"
        assert cb.device_arch(torch.device("cuda", 2)) == "sm_100"
        assert cb.device_capability(torch.device("cuda", 1)) == (8, 9)
    finally:
        cb.device_capability.cache_clear()
