"""`vibeqwen inspect DIR`: what a checkpoint holds, from its config files and safetensors headers only.

No weight is read: the layout is detected, every module is planned as the loader would plan it, and the
headers are checked for presence, dtype and shape. The report lists precision counts and on-disk sizes per
part of the model, shards that are missing, truncated or unreadable, missing or misshapen tensors, unexpected
tensors, missing or unusable tokenizer files (the tokenizer is loaded as `serve` loads it), the skipped vision
tower, and whether MTP weights exist.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from vibeqwen.checkpoint.formats import CheckpointError, module_kind, read_json
from vibeqwen.checkpoint.layout import Precision
from vibeqwen.checkpoint.loader import Survey, shard_files, survey_checkpoint, tensor_nbytes

_PART_ORDER = ["routed experts", "shared expert", "attention", "GDN projections", "lm_head", "routers",
               "embedding", "GDN other", "attention norms", "norms", "mtp"]
_PREC_ORDER = [Precision.NVFP4, Precision.FP8, Precision.BF16]
_SHOWN = 20


def _mb(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def inspect_checkpoint(path: str | Path) -> dict:
    """A JSON-able description of the checkpoint at `path` (see module docstring). Reads no weights.

    Raises CheckpointError / ConfigError when the directory cannot even be planned (no config, unknown
    architecture or quantization method); unreadable shards, tensor problems and missing or unusable tokenizer
    files are reported in `problems`.
    """
    from vibeqwen.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer

    s: Survey = survey_checkpoint(path)
    problems = list(s.problems)
    n_problems = len(problems)
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
        if not (s.path / name).is_file():
            problems.append(f"{s.path / name}: missing (`serve` loads the tokenizer from {TOKENIZER_FILE} and "
                            f"{TOKENIZER_CONFIG_FILE})")
            continue
        try:
            if not isinstance(read_json(s.path / name), dict):
                problems.append(f"{s.path / name}: not a JSON object")
        except CheckpointError as e:
            problems.append(str(e))
    if len(problems) == n_problems:
        try:  # then the tokenizer itself, as `serve` loads it (a JSON object can still be no usable tokenizer)
            Tokenizer.from_dir(s.path)
        except Exception as e:  # noqa: BLE001 - whatever stops `serve` is a problem to report, not a crash
            problems.append(str(e) if isinstance(e, (ValueError, OSError))
                            else f"{s.path}: the tokenizer cannot be loaded: {type(e).__name__}: {e}")
    plan, headers = s.plan, s.headers
    parts: dict[tuple[str, Precision], dict[str, int]] = defaultdict(lambda: {"modules": 0, "bytes": 0})
    for module, prec in plan.disk_precisions.items():
        parts[(module_kind(module), prec)]["modules"] += 1
    for r in plan.recipes:
        nbytes = sum(tensor_nbytes(headers[d.name][1]) for d in r.inputs if d.name in headers)
        parts[(r.kind, r.disk)]["bytes"] += nbytes
    by_precision: dict[str, dict[str, int]] = {}
    for (kind, prec), v in parts.items():
        agg = by_precision.setdefault(prec.name, {"modules": 0, "bytes": 0})
        agg["modules"] += v["modules"]
        agg["bytes"] += v["bytes"]
    at_load: dict[str, int] = defaultdict(int)
    for prec in plan.precisions.values():
        at_load[prec.name] += 1
    shards = shard_files(s.path)  # those listed, read or not
    cfg = s.config
    return {
        "path": str(s.path),
        "layout": plan.layout,
        "layout_source": plan.source,
        "config": {
            "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "experts": cfg.num_experts, "experts_per_token": cfg.num_experts_per_tok,
            "mtp_layers": cfg.mtp_num_hidden_layers,
        },
        "shards": len(shards),
        "total_bytes": sum(tensor_nbytes(info) for _, info in headers.values()),
        "tensors": len(headers),
        "experts_fused_layers": plan.fused_experts,
        "has_mtp": plan.has_mtp,
        "by_precision": by_precision,
        "by_part": [
            {"part": kind, "precision": prec.name, **parts[(kind, prec)]}
            for kind in _PART_ORDER for prec in _PREC_ORDER if (kind, prec) in parts
        ],
        "precisions_at_load": dict(at_load) if plan.layout == "bf16" else None,
        "vision_tensors": len(s.ignored),
        "vision_bytes": sum(tensor_nbytes(headers[n][1]) for n in s.ignored),
        "problems": problems,
        "unexpected": s.unexpected,
        "loadable": not problems,
    }


def format_report(rep: dict) -> str:
    """The human-readable form of `inspect_checkpoint`'s result."""
    c = rep["config"]
    fused = rep["experts_fused_layers"]
    experts = f"fused (gate_up_proj / down_proj) in {fused} layer(s)" if fused else "stored per expert"
    mtp = "present (mtp.*)" if rep["has_mtp"] else "ABSENT: speculative decoding with MTP is unavailable"
    lines = [
        f"checkpoint   {rep['path']}",
        f"layout       {rep['layout']} (from {rep['layout_source']})",
        (f"model        Qwen3.6 MoE: {c['layers']} layers, hidden {c['hidden_size']}, "
         f"vocab {c['vocab_size']}, {c['experts']} experts (top {c['experts_per_token']}), "
         f"MTP layers in config {c['mtp_layers']}"),
        f"files        {rep['shards']} shard(s), {rep['tensors']} tensors, {_mb(rep['total_bytes'])}",
        f"experts      {experts}",
        f"MTP          {mtp}",
        f"vision tower {rep['vision_tensors']} tensor(s), {_mb(rep['vision_bytes'])}: skipped, never read",
        "",
        f"{'precision':<12}{'modules':>8}{'size':>16}",
    ]
    for prec in _PREC_ORDER:
        v = rep["by_precision"].get(prec.name)
        if v:
            lines.append(f"{prec.name:<12}{v['modules']:>8}{_mb(v['bytes']):>16}")
    lines += ["", f"{'part':<18}{'precision':<12}{'modules':>8}{'size':>16}"]
    for row in rep["by_part"]:
        lines.append(f"{row['part']:<18}{row['precision']:<12}{row['modules']:>8}{_mb(row['bytes']):>16}")
    if rep["precisions_at_load"]:
        at = ", ".join(f"{k} {v}" for k, v in sorted(rep["precisions_at_load"].items()))
        lines += ["", (f"at load      serve --quantize nvfp4 (default) quantizes to the vendor mix: {at} "
                       "modules; --quantize none keeps BF16")]
    problems, unexpected = rep["problems"], rep["unexpected"]
    lines.append("")
    if problems:
        lines.append(f"PROBLEMS     {len(problems)} (unreadable shards, missing, misshapen or mistyped tensors, "
                     "missing tokenizer files):")
        lines += [f"  {p}" for p in problems[:_SHOWN]]
        if len(problems) > _SHOWN:
            lines.append(f"  ... and {len(problems) - _SHOWN} more")
    else:
        lines.append("problems     none: every expected tensor is present with the right dtype and shape, and the "
                     "tokenizer files are there")
    if unexpected:
        lines.append(f"unexpected   {len(unexpected)} tensor(s) the loader will ignore:")
        lines += [f"  {n}" for n in unexpected[:_SHOWN]]
        if len(unexpected) > _SHOWN:
            lines.append(f"  ... and {len(unexpected) - _SHOWN} more")
    else:
        lines.append("unexpected   none")
    # from the headers alone: the values (NaN or infinite ones included) are checked when `serve` reads them
    verdict = "NOT loadable"
    if rep["loadable"]:
        verdict = "loadable by its headers (serve checks the values as it loads them)"
    lines.append(f"verdict      {verdict}")
    return "\n".join(lines)
