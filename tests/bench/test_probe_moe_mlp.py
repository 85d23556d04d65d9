"""bench/kernels/probe_moe_mlp.py on the CPU: the interleaved weight copy its order 2 probes stream."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def probe(bench_script):
    return bench_script("kernels/probe_moe_mlp.py", "probe_moe_mlp")


def test_interleaved_chunks_are_ring_slots(probe):
    """Chunk i of the copy is the 640 bytes moe_mma.cu's ring_copy puts in a ring slot: lane l's 16 code bytes at
    16 l, then the chunk's 8 bf16 scale vectors."""
    from vibeqwen_kernels.moe import mma_cuda as M

    g = torch.Generator().manual_seed(7)
    e, n, k = 3, 32, 128
    packed = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (e, n, k // 16), generator=g, dtype=torch.uint8)
    mw = M.shuffle_mma_weights(packed, scales, False, interleave_halves=True)
    il = probe.interleaved(mw)
    chunks = e * (n // 16) * (k // 64)
    assert il.shape == (chunks, 640) and il.dtype == torch.uint8
    codes = mw.codes.reshape(chunks, 32, 16)
    sc = mw.scales.reshape(chunks, 64)
    for i in (0, 1, chunks // 2, chunks - 1):
        for lane in (0, 5, 31):
            assert torch.equal(il[i, 16 * lane:16 * lane + 16], codes[i, lane])
        assert torch.equal(il[i, 512:].view(torch.bfloat16), sc[i])
    # chunk i + 1 follows chunk i: a ring step of 4 chunks is one 2560-byte run
    assert il.is_contiguous() and il.stride(0) == 640
