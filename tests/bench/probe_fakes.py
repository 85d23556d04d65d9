"""Shared pieces of the GPU probes' CPU tests (test_cluster_layer_bench.py, test_split_mixer_bench.py): a probe's
driver runs its main() on the CPU with its ctypes library replaced by a torch fake, called by raw pointer as the real
library is."""

from __future__ import annotations

import contextlib
import json
import sys
import types

import torch


class RecordingLibrary:
    """Base of a fake probe library. `tensors` maps data_ptr -> tensor (filled by the patched Tensor.data_ptr of
    :func:`run_driver`); in a fake graph capture (`recording` a list) launches are recorded for `FakeGraph.replay`
    instead of run."""

    def __init__(self, tensors: dict):
        self.tensors = tensors
        self.recording = None

    def _run(self, fn) -> int:
        if self.recording is not None:
            self.recording.append(fn)
        else:
            fn()
        return 0


class FakeGraph:
    """torch.cuda.CUDAGraph's stand-in: replays the launches recorded during its capture."""

    def __init__(self):
        self.ops = []

    def replay(self):
        for op in self.ops:
            op()


def run_driver(bench, monkeypatch, make_lib, argv, json_path, modules=()):
    """bench.main() on the CPU with `argv` (+ --json json_path) and the library make_lib(tensors) (a
    RecordingLibrary); DEVICE "cpu" and a 4 KB stand-in stream on bench and on each of `modules`, every timing 1 us.
    Returns (the library, the JSON the driver wrote, its SystemExit or None)."""
    tensors: dict = {}
    real_ptr = torch.Tensor.data_ptr

    def data_ptr(self):
        p = real_ptr(self)
        tensors[p] = self
        return p

    lib = make_lib(tensors)

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
    for mod in (bench, *modules):
        monkeypatch.setattr(mod, "DEVICE", "cpu")
        monkeypatch.setattr(mod, "STREAM_BYTES", 4096)
    monkeypatch.setattr(bench, "build", lambda: lib)
    monkeypatch.setattr(bench, "copy_bandwidth_tbs", lambda dev: 3.0)
    monkeypatch.setattr(bench, "time_graph", time_graph)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(multi_processor_count=4))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(sys, "argv", [bench.__name__ + ".py", *argv, "--json", str(json_path)])
    err = None
    try:
        bench.main()
    except SystemExit as e:
        err = e
    return lib, json.loads(json_path.read_text()), err
