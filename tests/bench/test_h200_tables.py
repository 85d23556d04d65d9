"""bench/h200.py's profile tables on the CPU: the exclusive-time table of overlapping kernel spans."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def h200(bench_script):
    return bench_script("h200.py", "h200_bench")


def test_exclusive_times_charge_only_the_running_kernel(h200):
    # a chain with early launch: b's span starts inside a's, c's inside b's; then a gap; two repetitions
    ks = [("a", 0.0, 10.0), ("b", 4.0, 15.0), ("c", 14.0, 16.0), ("a", 20.0, 30.0), ("b", 25.0, 31.0),
          ("c", 30.5, 33.0)]
    rows = {r["kernel"]: r for r in h200.exclusive_kernel_table(ks, n=2)}
    assert rows["a"]["us_per_step"] == pytest.approx((10 + 10) / 2)
    assert rows["b"]["us_per_step"] == pytest.approx((5 + 1) / 2)
    assert rows["c"]["us_per_step"] == pytest.approx((1 + 2) / 2)
    assert all(r["calls_per_step"] == 1 for r in rows.values())
    busy = 16 + 13  # merged spans [0, 16] and [20, 33]
    assert sum(r["us_per_step"] for r in rows.values()) * 2 == pytest.approx(busy)
    # largest first, and the row cap
    assert [r["kernel"] for r in h200.exclusive_kernel_table(ks, n=2, rows=2)] == ["a", "b"]


def test_exclusive_times_of_a_kernel_inside_another(h200):
    """A span wholly inside an earlier one gets 0, and the earlier one keeps its whole span."""
    rows = {r["kernel"]: r for r in h200.exclusive_kernel_table([("x", 0, 10), ("y", 2, 5), ("z", 8, 12)], n=1)}
    assert rows["x"]["us_per_step"] == 10 and rows["y"]["us_per_step"] == 0 and rows["z"]["us_per_step"] == 2


def test_layer_timeline_picks_the_last_repetitions_layers(h200):
    """Two repetitions of a 3-layer chain (each layer: proj, then its MoE kernel): the window is the last
    repetition's layers 1..2 (first_layer=1, n_shown=2), times from its first kernel's start, exclusive times
    against the previous kernel's end (the kernel before the window included)."""
    ks = []
    t = 0.0
    for rep in range(2):
        for layer in range(3):
            ks.append((f"proj{layer}", t, t + 5.0))
            ks.append(("moe_decode_kernel<32>", t + 4.0, t + 10.0))  # starts inside proj's span (early launch)
            t += 10.0
    tl = h200.layer_timeline(ks, n_layers=3, first_layer=1, n_shown=2)
    assert [k["kernel"] for k in tl] == ["proj1", "moe_decode_kernel<32>", "proj2", "moe_decode_kernel<32>"]
    assert tl[0]["start_us"] == 0.0 and tl[-1]["end_us"] == pytest.approx(20.0)
    assert [k["exclusive_us"] for k in tl] == pytest.approx([5.0, 5.0, 5.0, 5.0])
    # too few layer ends: nothing
    assert h200.layer_timeline(ks[:4], n_layers=3) == []
