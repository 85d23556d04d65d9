"""Tuned launch-configuration tables (JSON files in `configs/`, written by the tuners in `bench/kernels/`)."""

from __future__ import annotations

import json
import os


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
