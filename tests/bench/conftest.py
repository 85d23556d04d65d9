"""Fixtures of the bench scripts' CPU tests."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="session")
def bench_script():
    """``load(relpath, name)``: the module of ``bench/<relpath>`` under ``name``, executed once a session with its
    folder on ``sys.path`` while it loads (the scripts import their neighbours)."""
    loaded: dict = {}

    def load(relpath: str, name: str):
        if name not in loaded:
            path = BENCH / relpath
            sys.path.insert(0, str(path.parent))
            try:
                spec = importlib.util.spec_from_file_location(name, path)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
            finally:
                sys.path.remove(str(path.parent))
            loaded[name] = mod
        return loaded[name]

    return load
