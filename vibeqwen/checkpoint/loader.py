"""Load and validate a checkpoint directory in the vendor's NVFP4 (ModelOpt MIXED_PRECISION) layout.

Every expected tensor is checked for presence, dtype and shape against `layout.py` before any weight is
read; a failure raises `CheckpointError` naming the file and the tensor. Shard headers are checked against
the file size first, so a truncated download is reported as such rather than as a crash mid-load.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from vibeqwen.checkpoint.layout import (
    Precision,
    checkpoint_modules,
    precision_from_quant_config,
)
from vibeqwen.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
IGNORED_PREFIXES = ("model.visual.",)

_ST_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """A checkpoint directory cannot be served; the message names the file and tensor at fault."""


@dataclass
class Checkpoint:
    """A validated, loaded checkpoint.

    tensors: stored name -> tensor, as on disk (uint8 / float8_e4m3fn / float32 / bfloat16).
    precisions: module path -> Precision for every weight-bearing module of the text model (and MTP).
    """

    path: Path
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    precisions: dict[str, Precision]
    has_mtp: bool
    load_seconds: float


def read_header(path: Path) -> dict[str, dict]:
    """The safetensors header of `path`: tensor name -> {"dtype", "shape", "data_offsets"}.

    Raises CheckpointError if the header is malformed or any tensor's bytes lie beyond the end of the file
    (a truncated file).
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: file is truncated (only {size} bytes, no safetensors header)")
            (n,) = struct.unpack("<Q", raw)
            if 8 + n > size:
                raise CheckpointError(f"{path}: file is truncated inside its header ({size} bytes, header needs {8 + n})")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (bad header: {e})") from None
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    for name, info in header.items():
        end = info.get("data_offsets", [0, 0])[1]
        if end > data_bytes:
            raise CheckpointError(
                f"{path}: file is truncated: tensor {name!r} needs data bytes up to {end} but the file holds "
                f"only {data_bytes}; re-download this shard"
            )
    return header


def _quant_config(ckpt: Path, hf: dict) -> dict:
    qfile = ckpt / "hf_quant_config.json"
    if qfile.exists():
        try:
            return json.loads(qfile.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{qfile}: not valid JSON ({e})") from None
    if "quantization_config" in hf:
        return hf["quantization_config"]
    raise CheckpointError(
        f"{ckpt}: no hf_quant_config.json and no quantization_config in config.json; this version serves the "
        "ModelOpt NVFP4 (MIXED_PRECISION) layout"
    )


def _shard_files(ckpt: Path) -> list[Path]:
    index = ckpt / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (ckpt / f).exists():
                raise CheckpointError(f"{ckpt / f}: shard listed in {INDEX_FILE} is missing")
        return [ckpt / f for f in files]
    if (ckpt / SINGLE_FILE).exists():
        return [ckpt / SINGLE_FILE]
    raise CheckpointError(f"{ckpt}: no {INDEX_FILE} and no {SINGLE_FILE}")


def _same_shape(expected: tuple[int, ...], actual: list[int]) -> bool:
    # scalars are written as 0-d or 1-element tensors in the wild
    if expected == () and list(actual) in ([], [1]):
        return True
    return tuple(actual) == expected


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu") -> Checkpoint:
    """Validate then load the checkpoint at `path` onto `device`.

    Raises CheckpointError (missing file, truncated shard, missing/misshapen/mistyped tensor: the message
    names the file and the tensor, expected and actual) or ConfigError (bad config.json).
    """
    t0 = time.perf_counter()
    ckpt = Path(path)
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: not a directory")
    cfg_file = ckpt / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{cfg_file}: missing")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    cfg = ModelConfig.from_hf(hf, source=str(cfg_file))
    quant = _quant_config(ckpt, hf)

    headers: dict[str, tuple[Path, dict]] = {}
    for shard in _shard_files(ckpt):
        for name, info in read_header(shard).items():
            headers[name] = (shard, info)

    has_mtp = any(name.startswith("mtp.") for name in headers)
    problems: list[str] = []
    precisions: dict[str, Precision] = {}
    expected_shapes: dict[str, tuple[int, ...]] = {}
    for m in checkpoint_modules(cfg, include_mtp=has_mtp):
        prec = precision_from_quant_config(quant, m.path)
        m = type(m)(m.path, prec, m.shape, m.leaf)
        precisions[m.path] = prec
        for name, (shape, dtype) in m.tensors().items():
            expected_shapes[name] = shape
            if name not in headers:
                problems.append(f"tensor {name!r} is missing (expected {_fmt(dtype, shape)}, {prec.value})")
                continue
            shard, info = headers[name]
            actual_dtype = _ST_DTYPES.get(info["dtype"])
            if actual_dtype != dtype or not _same_shape(shape, info["shape"]):
                problems.append(
                    f"{shard.name}: tensor {name!r} is {info['dtype']}{list(info['shape'])}, expected "
                    f"{_fmt(dtype, shape)} ({prec.value})"
                )
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise CheckpointError(
            f"{ckpt}: {len(problems)} problem(s) with the checkpoint tensors{more}:\n  " + "\n  ".join(problems[:10])
        )
    unexpected = sorted(n for n in headers if n not in expected_shapes and not n.startswith(IGNORED_PREFIXES))
    if unexpected:
        log.warning("%s: ignoring %d unexpected tensor(s), e.g. %s", ckpt, len(unexpected), unexpected[:3])
    if not has_mtp:
        log.warning("%s: no mtp.* weights: MTP speculative decoding is unavailable", ckpt)

    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in expected_shapes:
        by_file.setdefault(headers[name][0], []).append(name)
    for shard, names in by_file.items():
        with safe_open(str(shard), framework="pt", device=str(device)) as f:
            for name in names:
                # scalars stored as [1] are normalised to 0-d
                tensors[name] = f.get_tensor(name).reshape(expected_shapes[name])
    secs = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    log.info("loaded %s: %d tensors, %.1f MB in %.2f s (%.0f MB/s)", ckpt, len(tensors), nbytes / 1e6, secs,
             nbytes / 1e6 / max(secs, 1e-9))
    return Checkpoint(ckpt, cfg, tensors, precisions, has_mtp, secs)


def _fmt(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    inv = {v: k for k, v in _ST_DTYPES.items()}
    return f"{inv[dtype]}{list(shape)}"


__all__ = ["Checkpoint", "CheckpointError", "ConfigError", "load_checkpoint", "read_header"]
