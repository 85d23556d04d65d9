"""bench/kernels/bench_cluster_layer.py on the CPU: the driver end to end, its CUDA library replaced by the torch
reference (by raw pointer, as the library is called), so that its one run on a GPU does not fail on the driver; and
its checks catch a launch that goes wrong only under PDL."""

from __future__ import annotations

import contextlib
import json
import sys
import types

import pytest
import torch


@pytest.fixture
def bench(bench_script):
    return bench_script("kernels/bench_cluster_layer.py", "bench_cluster_layer")


class FakeLibrary:
    """cluster_layer.cu's C functions over the driver's tensors, computed by its torch reference. Pointers are found
    through `tensors` (data_ptr -> tensor, filled by the patched Tensor.data_ptr). In a fake capture (`recording` a
    list) launches are recorded for `FakeGraph.replay`. fault: "pdl_partial" zeroes cluster 0's partial in mixer
    launches with PDL (a race the checks must catch)."""

    def __init__(self, mod, tensors: dict, fault: str | None = None, clusters: int = 16):
        self.mod, self.tensors, self.fault, self.clusters = mod, tensors, fault, clusters
        self.recording = None
        self.launches = {"mixer": 0, "reduce": 0, "stream": 0}

    def _run(self, fn) -> int:
        if self.recording is not None:
            self.recording.append(fn)
        else:
            fn()
        return 0

    def vq_cl_smem(self):
        return 224544

    def vq_cl_max_clusters(self, cluster):
        return {8: self.clusters}.get(cluster, 128 // cluster)

    def vq_cl_layer_launch(self, w, wo, state, h, partial, wscale, oscale, g, beta, late, cluster, ctas, pdl,
                           stream):
        t = self.tensors
        self.launches["mixer"] += 1
        wo_t = t[wo]
        layer = types.SimpleNamespace(w=t[w], wo_logical=wo_t.permute(0, 2, 1, 3).reshape(2048, 4096))
        state_t, h_t, partial_t = t[state], t[h], t[partial]

        def fn():
            _, s, p = self.mod.reference_layer(layer, state_t.clone(), h_t)
            state_t.copy_(s)
            parts = 128 // cluster
            partial_t[:parts] = p.view(parts, 32 // parts, 2048).sum(1)
            if self.fault == "pdl_partial" and pdl:
                partial_t[0].zero_()
        return self._run(fn)

    def vq_cl_reduce_launch(self, partial, parts, h, h_out, pdl, stream):
        t = self.tensors
        self.launches["reduce"] += 1
        p, h_t, out = t[partial], t[h], t[h_out]
        return self._run(lambda: out.copy_((h_t.float() + p[:parts].sum(0)).to(torch.bfloat16)))

    def vq_cl_stream_launch(self, w, n16, h, h_out, sink, ctas, pdl, stream):
        t = self.tensors
        self.launches["stream"] += 1
        h_t, out = t[h], t[h_out]
        return self._run(lambda: out.copy_(h_t.clone()))


class FakeGraph:
    def __init__(self):
        self.ops = []

    def replay(self):
        for op in self.ops:
            op()


def run_driver(bench, monkeypatch, tmp_path, fault=None, clusters=16):
    """The driver's main() on the CPU with 2 layers; returns (the library, the JSON it wrote, its SystemExit or
    None)."""
    tensors: dict = {}
    real_ptr = torch.Tensor.data_ptr

    def data_ptr(self):
        p = real_ptr(self)
        tensors[p] = self
        return p

    lib = FakeLibrary(bench, tensors, fault, clusters)

    @contextlib.contextmanager
    def graph(g, *a, **k):
        lib.recording = g.ops
        try:
            yield
        finally:
            lib.recording = None

    def time_graph(calls, reps=10):
        for c in calls:
            c()
        return 1e-6

    monkeypatch.setattr(torch.Tensor, "data_ptr", data_ptr)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "STREAM_BYTES", 4096)
    monkeypatch.setattr(bench, "build", lambda: lib)
    monkeypatch.setattr(bench, "copy_bandwidth_tbs", lambda dev: 3.0)
    monkeypatch.setattr(bench, "time_graph", time_graph)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(multi_processor_count=4))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    out = tmp_path / "cluster.json"
    monkeypatch.setattr(sys, "argv", ["bench_cluster_layer.py", "--layers", "2", "--json", str(out)])
    err = None
    try:
        bench.main()
    except SystemExit as e:
        err = e
    return lib, json.loads(out.read_text()), err


def test_the_driver_runs_both_shapes_and_writes_its_figures(bench, monkeypatch, tmp_path, capsys):
    lib, result, err = run_driver(bench, monkeypatch, tmp_path)
    assert err is None
    checks = result["checks"]
    assert set(checks) == {"cluster 8", "cluster 4"}
    for c in checks.values():
        assert all(v is True or (isinstance(v, list) and v[-1] is True) for v in c.values()), c
    assert {k for k in result["us_a_layer"]} == {"S"} | {f"cluster {c}: {m}" for c in (8, 4)
                                                         for m in ("A+B", "A+B late", "A+B+S", "A+B+S late")}
    assert lib.launches["mixer"] > 0 and lib.launches["stream"] > 0
    text = capsys.readouterr().out
    assert "| 8 | A+B in the chain (A+B+S - S) |" in text and "WARNING" not in text


def test_a_launch_wrong_only_under_pdl_is_caught_and_not_timed(bench, monkeypatch, tmp_path, capsys):
    """The one-layer checks launch without PDL; the chain checks must see what PDL changes."""
    _, result, err = run_driver(bench, monkeypatch, tmp_path, fault="pdl_partial")
    assert err is not None and "failed its checks" in str(err)
    c8 = result["checks"]["cluster 8"]
    assert c8["chain PDL == chain without PDL"] is False
    assert not any(k.startswith("cluster 8:") for k in result["us_a_layer"])
    assert "checks failed: not timed" in capsys.readouterr().out


def test_clusters_that_cannot_all_be_resident_are_flagged_and_timed_one_wave(bench, monkeypatch, tmp_path, capsys):
    _, result, err = run_driver(bench, monkeypatch, tmp_path, clusters=15)
    assert err is None
    text = capsys.readouterr().out
    assert "WARNING: only 15 clusters of 8 fit at once" in text
    assert "| 8 (WARNING: only 15 clusters of 8" in text
    assert "| 8 | A+B+S one wave (120 of 128 CTAs: part of the layer) |" in text
    timed = result["us_a_layer"]
    assert "cluster 8: A+B+S late one wave" in timed and "cluster 4: A+B one wave" not in timed
