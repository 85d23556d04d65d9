"""Tuned launch-configuration tables (JSON files in `configs/`, written by the tuners in `bench/kernels/`)."""

from __future__ import annotations

import json
import math
import os


def log2_distance(key: str, m: int) -> float:
    """How far a table entry's size key (a decimal string: tokens or rows) is from ``m`` in log2: the tables
    pick the entry nearest the launch's size this way. Raises ValueError for a key that is not a positive
    integer."""
    return abs(math.log2(int(key)) - math.log2(max(m, 1)))


def load_tuned_table(filename: str, env_var: str) -> dict:
    """The table `configs/<filename>` as installed (package `vibeqwen_configs`), or the file `$<env_var>` names
    when set. Returns {} when the file is absent or unreadable (callers then use their heuristics); never
    raises. Callers cache the result (one read per process)."""
    path = os.environ.get(env_var)
    try:
        if path:
            with open(path) as f:
                return json.load(f)
        from importlib import resources

        return json.loads((resources.files("vibeqwen_configs") / filename).read_text())
    except (FileNotFoundError, ModuleNotFoundError, json.JSONDecodeError, OSError, TypeError):
        return {}
