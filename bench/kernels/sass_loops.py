"""Instruction counts of the CUDA kernels' loops, read from their sm_90a SASS (no GPU needed).

Builds ``csrc/<source>.cu`` (its ``#include "x.cuh"`` lines expanded as ``kernels/cuda_build.py`` does) with the
engine's nvcc flags into a cubin for ``--arch``, disassembles it with ``cuobjdump -sass`` and, for every kernel whose
mangled name matches ``--kernel`` (a regular expression), lists its loops: each backward branch and the
instructions from its target to the branch (the body of one pass). Per loop: the instruction count and the counts
of the opcodes that say where a streaming kernel's issue slots go (``HMMA``, ``LDS``, ``LDGSTS``, ``HMUL2``, ``LOP3``,
``SHF``, ``IMAD``, ``F2FP`` and the local-memory spills ``STL`` / ``LDL``), plus the registers a thread from
``cuobjdump -res-usage``. Loops without any of ``--min-op`` (default ``HMMA``) are left out.

Why: a decode kernel that streams weights near the copy rate must also issue its instructions at a matching
rate. For the one-launch expert MLP (``moe_mlp_kernel``, 8-column CTA, e4m3 scales) at 32 tokens on the H200 (4.24
TB/s over 132 SMs at up to 1.98 GHz: ~16 bytes an SM clock), each SM must finish one warp's ring step (4 chunks,
2304 bytes) every ~140 clocks; at ~350 instructions a step that is ~2.5 of the 4 instructions an SM can issue a
clock. The step's instruction count per byte is the number the notes compare between variants
(bench/results/h200_notes.md, fifty-sixth session).

    python bench/kernels/sass_loops.py [--source moe_mma] [--kernel moe_mlp_kernel] [--arch sm_90a] [--json PATH]

nvcc comes from $CUDA_HOME, PATH or /usr/local/cuda; cuobjdump from PATH (on a host without it, the PyPI wheel
``nvidia-cuda-cuobjdump`` holds one: ``pip download --no-deps nvidia-cuda-cuobjdump``, unzip, put its ``bin`` on
PATH). Exits with a message naming what is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

#: opcodes counted per loop (the first dot-separated part of the mnemonic)
OPS = ("HMMA", "LDS", "LDGSTS", "HMUL2", "LOP3", "SHF", "IMAD", "F2FP", "STL", "LDL")

_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.IGNORECASE)
# a branch's target: BRA with modifiers (`BRA.U`, `BRA.DIV`) and a predicate or register operand before it
_BRA = re.compile(r"\bBRA(?:\.\w+)*\s+(?:[!\w]+,\s*)?(?:`\(\S+\)\s*)?(0x[0-9a-f]+)", re.IGNORECASE)


def parse_sass(text: str) -> dict[str, list[tuple[int, str]]]:
    """``cuobjdump -sass`` output -> {mangled kernel name: [(address, instruction text without the trailing ';'),
    ...]} in address order. A kernel starts at a ``Function : <name>`` line; lines that are not instructions (headers,
    the encodings' second lines) are skipped."""
    kernels: dict[str, list[tuple[int, str]]] = {}
    current: list[tuple[int, str]] | None = None
    for line in text.splitlines():
        if "Function : " in line:
            current = kernels.setdefault(line.split("Function : ", 1)[1].strip(), [])
            continue
        m = _INSN.match(line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(2)))
    return kernels


def opcode(insn: str) -> str:
    """The opcode of one instruction's text: its mnemonic without a guard predicate (``@P0``, ``@!PT``) or
    modifiers (``HMMA.16816.F32.BF16`` -> ``HMMA``)."""
    parts = insn.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else ""


def loops(insns: list[tuple[int, str]]) -> list[dict]:
    """Every backward branch of one kernel's instructions (address order) as a loop: ``{"start", "end"}`` (the
    branch target's and the branch's addresses), ``"instructions"`` (both included) and ``"ops"``: the counts of
    :data:`OPS` in the body. A branch whose target is not an instruction of the kernel is skipped."""
    index = {addr: i for i, (addr, _) in enumerate(insns)}
    found = []
    for i, (addr, text) in enumerate(insns):
        m = _BRA.search(text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= addr or target not in index:
            continue
        body = insns[index[target]: i + 1]
        counts = Counter(opcode(t) for _, t in body)
        found.append({"start": hex(target), "end": hex(addr), "instructions": len(body),
                      "ops": {op: counts.get(op, 0) for op in OPS}})
    return found


def parse_registers(text: str) -> dict[str, int]:
    """``cuobjdump -res-usage`` output -> {mangled kernel name: registers a thread}."""
    regs: dict[str, int] = {}
    name = None
    for line in text.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            name = m.group(1)
        m = re.search(r"REG:(\d+)", line)
        if m and name is not None:
            regs[name] = int(m.group(1))
            name = None
    return regs


def short_name(mangled: str) -> str:
    """A mangled kernel name without its namespaces and parameter list:
    ``_ZN<n>_GLOBAL__N_..<n>moe_mlp_kernelILi2E..EEEvPK..`` -> ``moe_mlp_kernelILi2E..EEE`` (the template arguments
    stay: they tell the instantiations apart); a name that is not a nested ``_ZN`` name comes back whole."""
    if not mangled.startswith("_ZN"):
        return mangled
    pos, name_start = 3, 3
    while pos < len(mangled) and mangled[pos].isdigit():  # <length><identifier>, one per nesting level
        digits = re.match(r"\d+", mangled[pos:]).group(0)
        name_start = pos + len(digits)
        pos = name_start + int(digits)
    if mangled.startswith("I", pos):  # template arguments, then E and the void return type
        tail = mangled.find("Ev", pos)
        if tail > 0:
            return mangled[name_start: tail + 1]
    return mangled[name_start:pos]


def _tool(name: str) -> str:
    """Path of nvcc (the engine's own lookup, `cuda_build._nvcc`) or cuobjdump (PATH, then /usr/local/cuda/bin);
    exits with a message naming what is missing."""
    if name == "nvcc":
        from vibeqwen_kernels.cuda_build import _nvcc

        found = _nvcc()
    else:
        found = shutil.which(name) or (f"/usr/local/cuda/bin/{name}" if os.path.exists(f"/usr/local/cuda/bin/{name}")
                                        else None)
    if found is None:
        hint = ""
        if name == "cuobjdump":
            hint = " (pip download --no-deps nvidia-cuda-cuobjdump; unzip; put its bin on PATH)"
        sys.exit(f"sass_loops: {name} not found{hint}")
    return found


def _disassemble(objdump: str, option: str, cubin: Path) -> str:
    """`cuobjdump <option> <cubin>`'s output; exits with its message where it fails (cuobjdump -sass needs nvdisasm
    on PATH too: the `nvidia-cuda-nvdisasm` wheel's, or the one Triton ships in triton/backends/nvidia/bin)."""
    res = subprocess.run([objdump, option, str(cubin)], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        sys.exit(f"sass_loops: {objdump} {option} failed: {(res.stderr or res.stdout).strip()[-2000:]} (nvdisasm "
                 f"must be on PATH: the nvidia-cuda-nvdisasm wheel's, or triton/backends/nvidia/bin/nvdisasm)")
    return res.stdout


def build_cubin(source: str, arch: str, workdir: Path, defines: list[str]) -> Path:
    """csrc/<source>.cu (headers expanded) -> a cubin for ``arch`` in ``workdir``. Exits with a message naming the
    source on a missing file, with nvcc's message on a failed build."""
    from vibeqwen_kernels.cuda_build import _FLAGS, _read_source

    src = workdir / f"{source}.cu"
    try:
        src.write_bytes(_read_source(source))
    except OSError as exc:
        sys.exit(f"sass_loops: cannot read csrc/{source}.cu or a header it includes: {exc}")
    out = workdir / f"{source}.cubin"
    flags = [f for f in _FLAGS if f not in ("-shared", "-Xcompiler", "-fPIC")]
    cmd = [_tool("nvcc"), *flags, f"-arch={arch}", "-cubin", *[f"-D{d}" for d in defines], "-o", str(out), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        sys.exit(f"sass_loops: {' '.join(cmd)} failed:\n{(res.stderr or res.stdout)[-3000:]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="moe_mma", help="csrc/<source>.cu")
    ap.add_argument("--kernel", default="moe_mlp_kernel", help="regular expression on the mangled kernel names")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--min-op", default="HMMA", help="keep loops with at least one of these opcodes (comma list; "
                                                     "empty: every loop)")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="a macro for nvcc (repeatable)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    pattern = re.compile(args.kernel)
    need = [op for op in args.min_op.split(",") if op]
    with tempfile.TemporaryDirectory() as tmp:
        cubin = build_cubin(args.source, args.arch, Path(tmp), args.defines)
        objdump = _tool("cuobjdump")
        sass = _disassemble(objdump, "-sass", cubin)
        usage = _disassemble(objdump, "-res-usage", cubin)
    kernels = parse_sass(sass)
    regs = parse_registers(usage)
    result = {}
    for name, insns in kernels.items():
        if not pattern.search(name):
            continue
        body = [lp for lp in loops(insns) if not need or any(lp["ops"].get(op, 0) for op in need)]
        result[name] = {"registers": regs.get(name), "instructions": len(insns), "loops": body}
    if not result:
        sys.exit(f"sass_loops: no kernel of csrc/{args.source}.cu matches {args.kernel!r}")
    cols = ["instructions", *OPS]
    print(f"| kernel | regs | loop | {' | '.join(cols)} |")
    print("|---|---|---|" + "---|" * len(cols))
    for name, info in result.items():
        short = short_name(name)
        for lp in info["loops"] or [{"start": "-", "end": "-", "instructions": 0, "ops": {}}]:
            vals = [lp["instructions"], *[lp["ops"].get(op, 0) for op in OPS]]
            print(f"| {short} | {info['registers']} | {lp['start']}-{lp['end']} | {' | '.join(map(str, vals))} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
