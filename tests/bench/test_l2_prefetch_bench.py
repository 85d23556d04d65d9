"""bench/kernels/bench_l2_prefetch.py on the CPU: the pieces its prefetch asks for and its argument checks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("kernels/bench_l2_prefetch.py", "bench_l2_prefetch")


@pytest.mark.parametrize("nbytes,row_bytes,fraction,want", [
    (768 * 32768, 32768, 1.0, (4, 3072)),   # qkv|z tiles: 4 pieces of 8 KB each
    (768 * 32768, 32768, 0.5, (2, 1536)),   # the first half of each tile
    (5 * 40960, 40960, 0.3, (2, 10)),       # 12288 bytes a row round up to 2 pieces
    (7 * 3200, 3200, 1.0, (1, 7)),          # rows shorter than a piece: one (shorter) piece each
    (16, 16, 0.01, (1, 1)),
])
def test_prefetch_pieces(bench, nbytes, row_bytes, fraction, want):
    assert bench.prefetch_pieces(nbytes, row_bytes, fraction) == want


@pytest.mark.parametrize("nbytes,row_bytes,fraction,piece", [
    (4096, 1000, 1.0, 8192), (4096, 3072, 1.0, 8192), (4096, 0, 1.0, 8192), (4096, 1024, 0.0, 8192),
    (4096, 1024, 1.5, 8192), (4096, 1024, 1.0, 100)])
def test_prefetch_pieces_rejects(bench, nbytes, row_bytes, fraction, piece):
    with pytest.raises(ValueError, match="bulk_prefetch"):
        bench.prefetch_pieces(nbytes, row_bytes, fraction, piece)


def test_bulk_prefetch_needs_a_cuda_tensor(bench):
    with pytest.raises(ValueError, match="CUDA"):
        bench.bulk_prefetch(torch.zeros(4096, dtype=torch.uint8), 1024)
