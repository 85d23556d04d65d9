"""gdn_commit_states (speculative rollback of every GDN layer in one launch) against indexing in PyTorch,
on fresh random inputs: under Triton's interpreter on the CPU, and on a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_gpu = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA GPU")

_CHECK = textwrap.dedent("""
    def check(device, seed):
        from vibeqwen_kernels.gdn.commit import gdn_commit_states

        g = torch.Generator().manual_seed(seed)
        for n_layers, n_slots, n_rows, state, n_seqs in [(3, 9, 12, (2, 4, 4), 4), (1, 5, 3, (3, 5), 3),
                                                           (4, 17, 40, (2, 8, 8), 16), (2, 4, 4, (2050,), 2)]:
            ssm = torch.randn(n_layers, n_slots, *state, generator=g).to(device)
            states = torch.randn(n_layers, n_rows, *state, generator=g).to(device)
            slots = torch.randperm(n_slots, generator=g)[:n_seqs].to(device)
            rows = torch.randint(0, n_rows, (n_seqs,), generator=g).to(device)
            expect = ssm.clone()
            expect[:, slots] = states[:, rows]
            gdn_commit_states(ssm, states, slots, rows)
            assert torch.equal(ssm, expect), (n_layers, n_slots, state)
        print("ok")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_commit_interpreted():
    script = "import torch\n" + _CHECK + "\ncheck('cpu', 0)\n"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


def test_commit_rejects_bad_inputs(monkeypatch):
    from vibeqwen_kernels.gdn.commit import gdn_commit_states

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ssm, states = torch.zeros(2, 4, 8), torch.zeros(2, 6, 8)
    idx = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="CUDA"):
        gdn_commit_states(ssm, states, idx, idx)
    with pytest.raises(ValueError, match="must be"):
        gdn_commit_states(ssm, torch.zeros(3, 6, 8), idx, idx)
    with pytest.raises(ValueError, match="one dtype"):
        gdn_commit_states(ssm, states.double(), idx, idx)
    with pytest.raises(ValueError, match=r"\[S\]"):
        gdn_commit_states(ssm, states, idx, torch.tensor([0]))


@pytest.mark.gpu
@requires_gpu
def test_commit_gpu():
    scope: dict = {"torch": torch}
    exec(_CHECK, scope)
    scope["check"]("cuda", 1)
