"""Load and validate a checkpoint directory in any layout a user may hold, normalised to the vendor layout.

`load_checkpoint(path)` detects the layout (ModelOpt, compressed-tensors, BF16 original; see `formats.py`),
plans every tensor from the safetensors headers, and checks each one for presence, dtype and shape before
any weight is read; a failure raises `CheckpointError` naming the file, the tensor, expected and actual, and
the detected layout. Shard headers are checked against the file size first, so a truncated download is
reported as such rather than as a crash mid-load.

Reading: shards are memory-mapped and read by a pool of threads (one shard per task) straight into the
destination tensors, with a progress bar over bytes. A module's tensors are normalised (renamed, views
split, or quantized for a BF16 checkpoint) as soon as all of its inputs have arrived, and the raw inputs
are dropped then, so the host never holds the raw checkpoint and the normalised one at the same time.
Mapped pages are released after copying, so they do not count twice either.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import struct
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from vibeqwen.checkpoint.formats import (
    IGNORED_PREFIXES,
    CheckpointError,
    DiskTensor,
    Plan,
    Recipe,
    detect_layout,
    fmt_tensor,
    hf_checkpoint_config,
    model_config_of,
    plan_checkpoint,
    read_json,
    st_dtype,
)
from vibeqwen.checkpoint.layout import Precision
from vibeqwen.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: the largest header the safetensors format allows (its own readers refuse more: 100 MB)
MAX_HEADER_BYTES = 100_000_000
# Bytes copied between progress updates (and released from the mapping afterwards).
_COPY_CHUNK = 64 << 20
_MAX_PROBLEMS_SHOWN = 10

@dataclass
class Checkpoint:
    """A validated, loaded checkpoint, normalised to the vendor (ModelOpt) naming whatever its layout.

    tensors: vendor name -> tensor (uint8 / float8_e4m3fn / float32 / bfloat16), e.g. `{path}.weight`,
        `{path}.weight_scale`, `{path}.weight_scale_2` for NVFP4 modules. Tensors of fused experts on disk
        are per-expert views of the fused storage.
    precisions: module path -> Precision for every weight-bearing module of the text model (and MTP).
    layout: what was detected on disk: 'modelopt', 'compressed-tensors' or 'bf16'.
    """

    path: Path
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    precisions: dict[str, Precision]
    has_mtp: bool
    load_seconds: float
    layout: str = "modelopt"
    bytes_read: int = 0


def read_header(path: Path) -> dict[str, dict]:
    """The safetensors header of `path`: tensor name -> {"dtype", "shape", "data_offsets"}.

    Raises CheckpointError if the header is malformed or any tensor's bytes lie beyond the end of the file
    (a truncated file).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: file is truncated (only {size} bytes, no safetensors header)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:  # safetensors caps its header at 100 MB: random bytes, not a short file
                raise CheckpointError(f"{path}: not a safetensors file (its first 8 bytes give a header of {n} bytes; "
                                      f"a safetensors header is at most {MAX_HEADER_BYTES})")
            if 8 + n > size:
                raise CheckpointError(f"{path}: file is truncated inside its header ({size} bytes, header needs {8 + n})")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (bad header: {e})") from None
    except OSError as e:  # unreadable: permissions, an I/O error
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(header, dict) or not all(
            isinstance(v, dict) for k, v in header.items() if k != "__metadata__"):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not an object of tensor entries)")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    for name, info in header.items():
        _check_entry(path, name, info)
        info["_base"] = 8 + n
        end = info["data_offsets"][1]
        if end > data_bytes:
            raise CheckpointError(
                f"{path}: file is truncated: tensor {name!r} needs data bytes up to {end} but the file holds "
                f"only {data_bytes}; re-download this shard"
            )
    return header


def _check_entry(path: Path, name: str, info: dict) -> None:
    """A header entry's dtype, shape and data_offsets are well formed and agree (offsets [start, end] with
    end - start = the bytes of shape x dtype, for the dtypes this engine reads). Raises CheckpointError naming the
    file and the tensor."""
    shape, offsets = info.get("shape"), info.get("data_offsets")
    ok_shape = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
    ok_offsets = (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                  and 0 <= offsets[0] <= offsets[1])
    if not isinstance(info.get("dtype"), str) or not ok_shape or not ok_offsets:
        raise CheckpointError(f"{path}: not a safetensors file (tensor {name!r} has a malformed header entry: "
                              f"dtype {info.get('dtype')!r}, shape {shape!r}, data_offsets {offsets!r})")
    dtype = st_dtype(info["dtype"])
    if dtype is not None:
        want = math.prod(shape) * dtype.itemsize
        if offsets[1] - offsets[0] != want:
            raise CheckpointError(f"{path}: tensor {name!r} is {info['dtype']}{shape} ({want} bytes) but its "
                                  f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes")


def _weight_map(ckpt: Path) -> dict[str, str] | None:
    """The index's tensor name -> shard file name, or None without an index. Raises CheckpointError (malformed)."""
    index = ckpt / INDEX_FILE
    if not index.exists():
        return None
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: malformed index (it needs a \"weight_map\" object mapping tensor names to "
                              "shard file names)")
    outside = sorted({f for f in weight_map.values() if Path(f).is_absolute() or ".." in Path(f).parts or not f})
    if outside:
        raise CheckpointError(f"{index}: shard file names must be relative paths inside the checkpoint, got "
                              f"{outside[:3]}")
    return weight_map


def shard_files(ckpt: Path) -> list[Path]:
    """The safetensors shards of a checkpoint (from the index, else the single file). Raises CheckpointError: no
    shard file, a malformed index (not a missing shard it lists: `read_headers` reports that)."""
    return _shards(ckpt, _weight_map(ckpt))


def _shards(ckpt: Path, weight_map: dict[str, str] | None) -> list[Path]:
    """shard_files with the index's weight map already read (None: no index)."""
    if weight_map is not None:
        return [ckpt / f for f in sorted(set(weight_map.values()))]
    if (ckpt / SINGLE_FILE).exists():
        return [ckpt / SINGLE_FILE]
    raise CheckpointError(f"{ckpt}: no {INDEX_FILE} and no {SINGLE_FILE}")


def read_headers(ckpt: Path, failed: dict[Path, str] | None = None,
                 shards: list[Path] | None = None) -> dict[str, tuple[Path, dict]]:
    """Tensor name -> (shard, header entry) over all shards (`shards`, else `shard_files(ckpt)`).

    Raises CheckpointError for a shard that is missing, a directory, truncated or not a safetensors file, or that
    holds a tensor an earlier shard holds too (which one is meant is ambiguous); with `failed` given, the shard and
    its message go there instead and the other shards are read (what `inspect` reports)."""
    headers: dict[str, tuple[Path, dict]] = {}
    for shard in shards if shards is not None else shard_files(ckpt):
        try:
            if shard.is_dir():
                raise CheckpointError(f"{shard}: a directory, not a safetensors file")
            if not shard.is_file():
                raise CheckpointError(f"{shard}: shard listed in {INDEX_FILE} is missing")
            entries = read_header(shard)
            twice = sorted(name for name in entries if name in headers)
            if twice:
                raise CheckpointError(f"{shard}: tensor {twice[0]} is also in {headers[twice[0]][0].name}"
                                      + (f" ({len(twice) - 1} more such tensors)" if len(twice) > 1 else "")
                                      + "; each tensor must be in one shard")
        except CheckpointError as e:
            if failed is None:
                raise
            failed[shard] = str(e)
            continue
        for name, info in entries.items():
            headers[name] = (shard, info)
    return headers


def tensor_nbytes(info: dict) -> int:
    start, end = info["data_offsets"]
    return end - start


@dataclass
class Survey:
    """A checkpoint examined from its config files and headers only (what `inspect` reports)."""

    path: Path
    config: ModelConfig
    plan: Plan
    headers: dict[str, tuple[Path, dict]]
    problems: list[str]
    unexpected: list[str]
    ignored: list[str]  # vision tower tensors, never read


def survey_checkpoint(path: str | Path, quantize: str = "nvfp4") -> Survey:
    """Detect the layout, plan every tensor and check it against the headers, without reading weights.

    Raises CheckpointError / ConfigError for problems that stop planning (missing config, unknown
    architecture or quantization method, no shard file, a malformed index); shards that are missing, truncated
    or not safetensors files, then tensor problems, are returned in `problems`.
    """
    ckpt = Path(path)
    hf = hf_checkpoint_config(ckpt)
    source = str(ckpt / "config.json")
    cfg = model_config_of(hf, source)
    layout, quant, where = detect_layout(ckpt, hf)
    failed: dict[Path, str] = {}
    weight_map = _weight_map(ckpt)  # the index, read once
    headers = read_headers(ckpt, failed, _shards(ckpt, weight_map))
    # tensors the index places in a shard that could not be read: planned as present, reported once (the shard;
    # without an index the failed shard is the only one: no tensor is reported missing)
    unread = {name for name, f in (weight_map or {}).items() if ckpt / f in failed}
    plan = plan_checkpoint(cfg, layout, quant, set(headers) | unread, quantize=quantize)
    plan.source = where
    missing_too = not failed or weight_map is not None
    problems = list(failed.values()) + _check(plan, headers, unread, report_missing=missing_too)
    used = {d.name for r in plan.recipes for d in r.inputs}
    ignored = sorted(n for n in headers if n.startswith(IGNORED_PREFIXES))
    unexpected = sorted(n for n in headers if n not in used and not n.startswith(IGNORED_PREFIXES))
    return Survey(ckpt, cfg, plan, headers, problems, unexpected, ignored)


def _check(plan: Plan, headers: dict[str, tuple[Path, dict]], unread: set[str] = frozenset(),
           report_missing: bool = True) -> list[str]:
    problems: list[str] = []
    for r in plan.recipes:
        for d in r.inputs:
            what = f"{r.disk.value} {r.module}"
            if d.name in unread:  # its shard's problem is reported
                continue
            if d.name not in headers:
                if not d.optional and report_missing:
                    expected = fmt_tensor(d.dtype, d.shape)
                    problems.append(f"tensor {d.name!r} is missing from every shard (expected {expected}, {what})")
                continue
            shard, info = headers[d.name]
            if not d.matches(st_dtype(info["dtype"]), info["shape"]):
                problems.append(
                    f"{shard.name}: tensor {d.name!r} is {info['dtype']}{list(info['shape'])}, expected "
                    f"{fmt_tensor(d.dtype, d.shape)} ({what})"
                )
    return problems


def load_checkpoint(
    path: str | Path,
    device: torch.device | str = "cpu",
    *,
    quantize: str = "nvfp4",
    progress: bool | None = None,
    num_threads: int | None = None,
) -> Checkpoint:
    """Validate then load the checkpoint at `path` onto `device`, normalised to the vendor layout.

    quantize: for a BF16 checkpoint, "nvfp4" (default) quantizes at load to the vendor mix with ModelOpt's
        math (NVFP4 experts / shared experts / lm_head, FP8 attention and GDN projections, BF16 else) and
        "none" keeps every module BF16. Quantized checkpoints load as stored.
    progress: show a progress bar over bytes (default: when stderr is a terminal).
    num_threads: reader threads (default: one per shard, at most 8).

    Raises CheckpointError (missing file, truncated shard, missing/misshapen/mistyped tensor: the message
    names the file and the tensor, expected and actual, and the detected layout; a NaN or infinite value, or a
    negative quantization scale, naming the shard and the tensor) or ConfigError (bad config.json, unknown
    architecture). An exception in the caller's thread while the shards are read (Ctrl-C: KeyboardInterrupt) stops
    the readers at their next chunk and propagates.
    """
    t0 = time.perf_counter()
    survey = survey_checkpoint(path, quantize=quantize)
    ckpt, plan = survey.path, survey.plan
    if survey.problems:
        n = len(survey.problems)
        more = f" (and {n - _MAX_PROBLEMS_SHOWN} more)" if n > _MAX_PROBLEMS_SHOWN else ""
        raise CheckpointError(
            f"{ckpt} ({plan.layout} layout, from {plan.source}): {n} problem(s) with the checkpoint's files or "
            f"tensors{more}:\n  " + "\n  ".join(survey.problems[:_MAX_PROBLEMS_SHOWN])
        )
    if survey.unexpected:
        log.warning("%s: ignoring %d unexpected tensor(s), e.g. %s", ckpt, len(survey.unexpected),
                    survey.unexpected[:3])
    if not plan.has_mtp:
        log.warning("%s: no mtp.* weights: MTP speculative decoding is unavailable", ckpt)
    if plan.layout == "bf16":
        log.info("%s: BF16 checkpoint, %s", ckpt,
                 "quantizing to NVFP4/FP8 at load (ModelOpt math)" if quantize == "nvfp4" else "kept in BF16")
    elif quantize != "nvfp4":
        log.info("%s: --quantize %s applies to BF16 checkpoints only; loading the %s layout as stored",
                 ckpt, quantize, plan.layout)

    tensors, nbytes = _read(plan, survey.headers, torch.device(device), progress, num_threads)
    secs = time.perf_counter() - t0
    log.info("loaded %s (%s layout): %d tensors, %.1f MB read in %.2f s (%.0f MB/s)", ckpt, plan.layout,
             len(tensors), nbytes / 1e6, secs, nbytes / 1e6 / max(secs, 1e-9))
    return Checkpoint(ckpt, survey.config, tensors, plan.precisions, plan.has_mtp, secs, plan.layout, nbytes)


class _Assembler:
    """Collects raw tensors as reader threads deliver them and runs each recipe once its inputs are in."""

    def __init__(self, plan: Plan, present: set[str]):
        self.lock = threading.Lock()
        self.raw: dict[str, torch.Tensor] = {}
        self.out: dict[str, torch.Tensor] = {}
        self.recipe_of: dict[str, Recipe] = {}
        self.pending: dict[int, int] = {}
        for r in plan.recipes:
            names = [d.name for d in r.inputs if d.name in present]
            self.pending[id(r)] = len(names)
            for n in names:
                self.recipe_of[n] = r

    def deliver(self, name: str, t: torch.Tensor) -> None:
        r = self.recipe_of[name]
        with self.lock:
            self.raw[name] = t
            self.pending[id(r)] -= 1
            if self.pending[id(r)]:
                return
            inputs = {d.name: self.raw.pop(d.name) for d in r.inputs if d.name in self.raw}
        try:
            built = r.build(inputs)
        except ValueError as e:
            raise CheckpointError(f"{r.module}: cannot convert ({e})") from None
        with self.lock:
            self.out.update(built)


def _needed(plan: Plan, headers: dict[str, tuple[Path, dict]]) -> dict[Path, list[str]]:
    by_shard: dict[Path, list[str]] = {}
    for r in plan.recipes:
        for d in r.inputs:
            if d.name in headers:
                by_shard.setdefault(headers[d.name][0], []).append(d.name)
    for names in by_shard.values():
        names.sort(key=lambda n: headers[n][1]["data_offsets"][0])  # sequential within a file
    return by_shard


def _read(plan: Plan, headers, device: torch.device, progress: bool | None, num_threads: int | None):
    from tqdm import tqdm

    by_shard = _needed(plan, headers)
    total = sum(tensor_nbytes(headers[n][1]) for names in by_shard.values() for n in names)
    asm = _Assembler(plan, {n for names in by_shard.values() for n in names})
    workers = max(1, min(len(by_shard), num_threads or min(8, os.cpu_count() or 1)))
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="loading weights",
               disable=None if progress is None else not progress, leave=False)
    stop = threading.Event()  # set when the load is abandoned: the readers leave at their next chunk
    pool = ThreadPoolExecutor(workers, thread_name_prefix="ckpt-read")
    try:
        futures = [pool.submit(_read_shard, shard, names, headers, device, asm, bar, stop)
                   for shard, names in by_shard.items()]
        for f in futures:
            f.result()
    except BaseException:
        # a bad shard, or Ctrl-C in this thread: neither waits for the other shards to be read (the pool's
        # context exit would, minutes for the full model)
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        pool.shutdown(wait=True)  # (at once after the above: the readers stop within one chunk)
        bar.close()
    _release_freed_host_memory()
    return asm.out, total


def _release_freed_host_memory() -> None:
    """Hand the raw tensors' freed heap back to the OS (glibc keeps it per thread arena otherwise)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


#: floating dtypes whose values are checked for NaN / inf at load (the fp8 ones by their bytes: :func:`_all_finite`)
_CHECKED_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
#: elements per isfinite pass (bounds its temporary mask, e.g. on the GPU for the 0.5 G-element embedding)
_FINITE_CHUNK = 1 << 24
#: name endings of the quantization scales (NVFP4 block scales and global scales, FP8 weight and input scales,
#: ModelOpt's and compressed-tensors' names): every value must also be >= 0
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "weight_global_scale", "input_global_scale")


def _all_finite(t: torch.Tensor, nonnegative: bool = False) -> torch.Tensor:
    """A 0-d bool tensor on t's device: whether every value of floating tensor `t` is finite, and with `nonnegative`
    also >= 0 (chunk by chunk). float8_e4m3fn is read as bytes: NaN is a byte with all 7 exponent and mantissa bits
    set (the format has no inf; OCP 8-bit floating point specification, E4M3), a negative value one with the sign bit
    and a nonzero rest (-0 is 0)."""
    flat = t.reshape(-1)
    if t.dtype == torch.float8_e4m3fn:
        flat = flat.view(torch.uint8)

        def ok(c):
            m = c & 0x7F
            good = m != 0x7F
            return (good & ((c < 0x80) | (m == 0))) if nonnegative else good
    else:
        def ok(c):
            return (torch.isfinite(c) & (c >= 0)) if nonnegative else torch.isfinite(c)
    parts = [ok(flat[a:a + _FINITE_CHUNK]).all() for a in range(0, flat.numel(), _FINITE_CHUNK)]
    return parts[0] if len(parts) == 1 else torch.stack(parts).all()


def _check_finite(shard: Path, flags: list[tuple[str, torch.Tensor]]) -> None:
    """Raise CheckpointError naming the first tensor of `shard` whose flag (from :func:`_all_finite`) is false: a
    NaN or inf in a norm weight, a bias, an FP8 weight or a scale, or a negative scale, is a damaged checkpoint,
    which would otherwise serve garbage (NaN logits: text of token 0, logprobs at the floor) without any warning.
    One device sync per shard."""
    if flags and not bool(torch.stack([f for _, f in flags]).all()):
        bad = next(n for n, f in flags if not bool(f))
        what = "NaN, infinite or negative values (a quantization scale)" if _is_scale(bad) else "NaN or infinite values"
        raise CheckpointError(f"{shard}: tensor {bad} holds {what} (a damaged or wrongly converted checkpoint)")


def _is_scale(name: str) -> bool:
    """Whether tensor `name` is a quantization scale (:data:`_SCALE_SUFFIXES`), whose values must be >= 0."""
    return name.endswith(_SCALE_SUFFIXES)


def _read_shard(shard: Path, names: list[str], headers, device: torch.device, asm: _Assembler, bar,
                stop: threading.Event | None = None) -> None:
    """Copy `names` from the memory-mapped `shard` into fresh tensors on `device`, chunk by chunk; bf16 / fp16 / fp32
    / fp8 (e4m3) tensors with a NaN or inf value, and quantization scales with a negative one, stop the load
    (:func:`_check_finite`). Returns early (nothing delivered past that point) once `stop` is set."""
    page = mmap.PAGESIZE
    flags: list[tuple[str, torch.Tensor]] = []
    with open(shard, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for name in names:
            info = headers[name][1]
            start, end = info["data_offsets"]
            offset, nbytes = info["_base"] + start, end - start
            dtype, shape = st_dtype(info["dtype"]), tuple(info["shape"])
            dst = torch.empty(shape, dtype=dtype, device=device)
            if nbytes == 0:
                asm.deliver(name, dst)
                continue
            dst_bytes = dst.reshape(-1).view(torch.uint8)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the mapping is read-only; we only copy out of it
                src = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)
            for a in range(0, nbytes, _COPY_CHUNK):
                if stop is not None and stop.is_set():
                    return
                b = min(a + _COPY_CHUNK, nbytes)
                dst_bytes[a:b].copy_(src[a:b])
                if hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
                    # drop the copied pages from this process (they stay in the page cache)
                    lo = (offset + a) // page * page
                    mm.madvise(mmap.MADV_DONTNEED, lo, offset + b - lo)
                bar.update(b - a)
            del src, dst_bytes
            if dst.dtype in _CHECKED_FLOATS:
                flags.append((name, _all_finite(dst, nonnegative=_is_scale(name))))
            asm.deliver(name, dst)
    _check_finite(shard, flags)


__all__ = [
    "Checkpoint", "CheckpointError", "ConfigError", "DiskTensor", "Survey", "load_checkpoint",
    "read_header", "read_headers", "shard_files", "survey_checkpoint",
]
