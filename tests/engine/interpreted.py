"""Runs a script through the GPU path's code on the CPU: Triton kernels under the interpreter (TRITON_INTERPRET=1,
VIBEQWEN_FAST=1), in a subprocess (the interpreter is chosen at import), on a tiny checkpoint with a 512-token
vocabulary and no EOS."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys


def run_interpreted(script: str, tmp_path) -> str:
    """Write the checkpoint under `tmp_path`, run `script` with its path as argv[1]; returns its last stdout line.
    Fails the test (AssertionError with the output's tail) when the script exits non-zero."""
    from vibeqwen.checkpoint.writer import write_checkpoint
    from vibeqwen.config import ModelConfig

    cfg = dataclasses.replace(ModelConfig.named("tiny"), vocab_size=512, eos_token_id=None)
    path = write_checkpoint(cfg, tmp_path / "ckpt", seed=0)
    env = dict(os.environ, TRITON_INTERPRET="1", VIBEQWEN_FAST="1")
    proc = subprocess.run([sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]
