"""Command line: `vibeqwen serve`, `vibeqwen make-checkpoint`, `vibeqwen inspect`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from vibeqwen import __version__

log = logging.getLogger("vibeqwen")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return value


def _device(text: str) -> str:
    """auto, cpu, cuda or cuda:N (checked before anything loads)."""
    t = text.strip().lower()
    if t in ("auto", "cpu", "cuda") or (t.startswith("cuda:") and t[5:].isdigit()):
        return t
    raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {text!r}")


# argparse names a type function in "invalid <name> value": say what is expected, not the function's name
_positive_int.__name__ = "positive integer"
_non_negative_int.__name__ = "non-negative integer"
_positive_float.__name__ = "positive number"


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def _json_str_list(text: str) -> list[str]:
    """A JSON list of strings (vLLM's CORS flags take the same: '["https://a.example", "https://b.example"]')."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'must be a JSON list of strings such as \'["*"]\', got {text!r}')
    return value


_port.__name__ = "port number"
_fraction.__name__ = "fraction"
_seconds.__name__ = "number of seconds"
_json_str_list.__name__ = "JSON list"


def _check_port_free(host: str, port: int) -> None:
    """Fail fast, before the model loads, when the address cannot be bound."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


#: `vibeqwen serve --help` epilog: the environment variables a user may set (README "Environment variables").
ENV_HELP = """environment variables:
  VIBEQWEN_API_KEY          default for --api-key
  VIBEQWEN_CACHE            cache root: demo checkpoint, tokenizer files, CUDA kernel builds
                            (default $XDG_CACHE_HOME/vibeqwen or ~/.cache/vibeqwen)
  VIBEQWEN_REFERENCE=1      run the PyTorch reference path even on a GPU
  VIBEQWEN_MOE_MMA=0        GPU: no shuffled copies for the CUDA MMA kernels (saves ~21 GB of experts, 318 MB
                            of LM head, 1.3 GB of FP8 projections; those then run Triton kernels)
  VIBEQWEN_MOE_WGMMA=0      GPU (Hopper): the CUDA MoE kernel's 32-pair blocks on mma.sync, not wgmma
  VIBEQWEN_PDL=0            GPU (Hopper): launch kernels without programmatic dependent launch
  VIBEQWEN_PDL_EARLY=0      GPU (Hopper): decode graphs of <= 32 tokens without early launch of the next kernel
  VIBEQWEN_FP8_MMA=0        GPU: decode-step FP8 projections on the Triton kernels, not the CUDA MMA kernel
                            (and no shuffled copy of their weights: 1.3 GB on the full model)
  VIBEQWEN_BF16_MMA=0       GPU: small bf16 decode GEMMs (GDN's b|a) on cuBLAS, not the CUDA MMA kernel (also
                            turns the fused router off)
  VIBEQWEN_FUSED_ROUTE=0    GPU: route decode batches in separate launches (GEMM, Triton top-k and alignment),
                            not the one CUDA launch
  VIBEQWEN_FUSED_ATTENTION=1
                            GPU (experimental): the attention q/k norm + RoPE + KV store of decode steps inside
                            the split-KV kernel, not in its own launch (off: slower on the H200 so far)
  VIBEQWEN_FP8_WIDE=0       GPU: FP8 projections of 8192+ rows at 5-32 rows on the 8-warp plan, not 12 warps
  VIBEQWEN_MOE_FUSED_DECODE=0
                            GPU: a 1-token decode step's MoE block as router + expert GEMM launches, not one launch
  VIBEQWEN_FP8_CONV=0       GPU: GDN's decode conv1d in its own launch, not in the qkv|z GEMM's epilogue
  VIBEQWEN_SIDE_STREAM=0    GPU: GDN's decode b|a projection in the main chain, not on a side stream
  VIBEQWEN_GDN_PERSIST=0    GPU: GDN's decode delta rule (32+ sequences) on the Triton kernel, not the persistent
                            CUDA kernel
  VIBEQWEN_MOE_MLP=0        GPU: the expert MLP of 16-64-token decode steps as gate|up (+ SiLU-mul) and down
                            launches, not one launch
  VIBEQWEN_CUDA_ALIGN=0     GPU: group 15-512 tokens' expert pairs with the three Triton launches, not the one
                            CUDA launch of csrc/moe_align.cu
  VIBEQWEN_MOE_DECODE_KERNEL=regs|regs2|async|async2|async4|regs2p
                            GPU: force one CUDA MoE decode kernel instead of the per-GEMM rule (from 16 tokens
                            only with VIBEQWEN_MOE_MLP=0)
  VIBEQWEN_NO_CUDA_EXT=1    GPU: build and use none of the CUDA C++ kernels in csrc/ (needs no nvcc)
  CUDA_HOME                 where nvcc is, for the CUDA C++ kernels (else PATH, /usr/local/cuda)
  VIBEQWEN_MOE_CONFIGS, VIBEQWEN_NVFP4_CONFIGS, VIBEQWEN_FP8_CONFIGS
                            GPU: tuned launch-configuration tables to use instead of configs/*.json
"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help (but not "None", which the help texts explain), the epilog as written."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vibeqwen", description="Serve Qwen3.6-35B-A3B (NVFP4) with an OpenAI API.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                       formatter_class=_HelpFormatter, epilog=ENV_HELP)
    s.add_argument("--weights", required=True, help="checkpoint directory, or 'demo' for the built-in tiny checkpoint")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=_port, default=8000, help="TCP port to listen on")
    s.add_argument("--served-model-name", default=None,
                   help="model name clients send (unset: the checkpoint folder's name; 'vibeqwen-demo' for the demo)")
    s.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="longest prompt + completion, in tokens (default: the model's context length, capped by "
                        "what the cache holds)")
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype: auto = bfloat16 on a GPU, float32 on the CPU")
    s.add_argument("--device", type=_device, default="auto",
                   help="auto = the GPU path on cuda:0 when a CUDA GPU is present, else the CPU reference path; "
                        "or cpu, cuda, cuda:N")
    s.add_argument("--enforce-eager", action="store_true",
                   help="GPU: run every step eagerly instead of replaying captured CUDA graphs for decode")
    s.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="GPU path with CUDA graphs (default: on): replay CUDA graphs of whole prompt chunks of one sequence "
                        "(1 .. max-num-batched-tokens tokens, padded to a power-of-two bucket) instead of launching "
                        "the prefill's kernels one by one, and split steps that mix decoding sequences with up to 4 "
                        "prompt chunks into one replay per piece; costs ~0.5 MiB of cache per token of the largest "
                        "bucket")
    s.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each decode step before reading the previous step's tokens, hiding the host "
                        "work between steps (lossless; decode steps only, not with MTP drafting); default: "
                        "on for the GPU path with CUDA graphs")
    s.add_argument("--fp8-prefill", choices=["w8a8", "w8a16"], default="w8a8",
                   help="GPU path: how the FP8 attention / GDN projections run in passes that carry prompt tokens: "
                        "w8a8 quantizes activations per token to FP8 for the FP8 tensor cores (faster prefill, "
                        "~2%% relative noise on those projections), w8a16 keeps bf16 activations (the oracle's "
                        "numerics); decode-only steps and speculative verification always run w8a16 (decode rows batched with a "
                        "prompt chunk too when they replay their own graph; in an eager mixed pass they run with the "
                        "chunk)")
    s.add_argument("--gdn-state-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="storage dtype of the Gated DeltaNet recurrent state (cache slots, speculative-verification "
                        "history); arithmetic stays float32 and only what is stored is rounded: once per decode "
                        "token, once per prompt chunk, each state kept for rollback. bfloat16 halves the state's "
                        "memory and traffic (the cache left goes to KV blocks)")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="automatic prefix caching: a request starts after the longest cached prefix of its tokens "
                        "(KV blocks shared, the Gated DeltaNet state restored from a snapshot taken at the end of a "
                        "prompt, at the end of a reply, or where prompts branch)")
    s.add_argument("--prefix-cache-slots", type=_non_negative_int, default=None,
                   help="Gated DeltaNet state snapshots the prefix cache keeps (one GDN state slot each, ~61 MiB for "
                        "the full model with float32 states); default: twice --max-num-seqs, at most a quarter of the "
                        "cache budget; 0 turns prefix caching off")
    s.add_argument("--max-num-seqs", type=_positive_int, default=64, help="sequences running at once (one GDN slot each)")
    s.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048,
                   help="tokens per forward pass; longer prompts are prefilled in chunks")
    s.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV cache block")
    s.add_argument("--cache-memory-gb", type=_positive_float, default=0.25,
                   help="KV cache + GDN state budget in GiB on the CPU (at most the host's available memory)")
    s.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                   help="fraction of GPU memory for weights, activations and cache")
    s.add_argument("--max-queue-len", type=_non_negative_int, default=256,
                   help="sequences (a request's n x prompts choices) admitted beyond max-num-seqs; more get HTTP 503")
    s.add_argument("--speculative", default="off", choices=["off", "mtp", "ngram", "mtp+ngram"],
                   help="lossless speculative decoding: the MTP head, n-gram prompt lookup, or both")
    s.add_argument("--num-speculative-tokens", type=_positive_int, default=None,
                   help="drafts verified per step (3 when not given; needs --speculative)")
    s.add_argument("--speculation-policy", default="auto", choices=["auto", "always", "cost-aware"],
                   help="when to verify proposed drafts: always, or cost-aware (skip a step's drafts when its "
                        "measured verification cost outweighs the tokens they are expected to add; lossless "
                        "either way); auto = cost-aware on the GPU path, always on the CPU")
    s.add_argument("--quantize", default="nvfp4", choices=["nvfp4", "none"],
                   help="BF16 checkpoints: quantize at load to the vendor NVFP4/FP8 mix (nvfp4) or keep BF16 "
                        "(none); quantized checkpoints load as stored")
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every route but /health (unset: $VIBEQWEN_API_KEY, else no key)")
    s.add_argument("--allowed-origins", type=_json_str_list, default=["*"], metavar="JSON",
                   help='CORS: origins a browser page may call the API from, a JSON list (["*"]: any)')
    s.add_argument("--allowed-methods", type=_json_str_list, default=["*"], metavar="JSON",
                   help="CORS: HTTP methods allowed across origins, a JSON list")
    s.add_argument("--allowed-headers", type=_json_str_list, default=["*"], metavar="JSON",
                   help="CORS: request headers allowed across origins, a JSON list")
    s.add_argument("--allow-credentials", action="store_true",
                   help="CORS: let browsers send cookies and credentials with their requests")
    s.add_argument("--reasoning-parser", default="qwen3", choices=["qwen3", "none"],
                   help="qwen3: split <think>...</think> into reasoning_content; none: reasoning stays in content")
    s.add_argument("--generation-config", default="auto",
                   help="sampling defaults for unset request fields: 'auto' (the checkpoint's generation_config.json), "
                        "'none' (OpenAI's), or a folder holding a generation_config.json")
    s.add_argument("--max-request-bytes", type=_positive_int, default=16 << 20,
                   help="larger request bodies get HTTP 413")
    s.add_argument("--shutdown-grace-period", type=_seconds, default=10.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, how long the replies in flight may go on; one still running then "
                        "ends with the error server_shutting_down (a stream with an error event and [DONE], a plain "
                        "reply as HTTP 503), and connections still open 5 s later are closed (a second Ctrl-C "
                        "quits at once)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server and engine log verbosity")

    m = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint (vendor NVFP4 layout by default)",
                       formatter_class=_HelpFormatter)
    m.add_argument("--config", default="tiny", help="'tiny', 'full', or a path to a config JSON")
    m.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    m.add_argument("--seed", type=int, default=0, help="seed of the random weights (the same seed: the same BF16 "
                                                       "weights whatever the format)")
    m.add_argument("--device", type=_device, default="cpu",
                   help="where to generate and quantize: cpu, cuda, cuda:N or auto (a GPU is much faster)")
    m.add_argument("--shard-gb", type=_positive_float, default=4.0, help="maximum shard size in GB")
    m.add_argument("--format", default="modelopt", choices=["modelopt", "compressed-tensors", "bf16"],
                   help="on-disk layout: the vendor's ModelOpt NVFP4 release, llm-compressor nvfp4-pack-quantized, "
                        "or the BF16 original")

    i = sub.add_parser("inspect", help="describe a checkpoint from its headers (layout, precisions, problems); "
                                       "reads no weights")
    i.add_argument("dir", help="checkpoint directory, or `demo` (the built-in demo checkpoint)")
    i.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _serve(args) -> int:
    from vibeqwen.checkpoint.demo import demo_checkpoint
    from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
    from vibeqwen.server.app import create_app
    from vibeqwen.server.async_engine import AsyncEngine
    from vibeqwen.server.shutdown import serve

    _check_port_free(args.host, args.port)
    if not args.weights.strip():
        raise ValueError("--weights must name a checkpoint directory (or 'demo')")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name must not be empty (leave it out to use the checkpoint folder's name)")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty (leave it out to serve without a key)")
    named_defaults = None
    if args.generation_config not in ("auto", "none"):  # a folder the user named: its file must parse (before loading)
        from vibeqwen.server.serving import load_generation_defaults

        if not (Path(args.generation_config) / "generation_config.json").is_file():
            raise ValueError(f"--generation-config {args.generation_config}: no generation_config.json in that folder")
        named_defaults = load_generation_defaults(args.generation_config, strict=True)
    # resolve the device first: a CUDA device on a machine without one fails before anything loads
    from vibeqwen.engine.llm_engine import resolve_device

    resolved = resolve_device(EngineConfig(dtype=args.dtype, device=args.device))
    log.info("device %s, dtype %s (%s path)%s", resolved.device, resolved.dtype,
             "GPU" if resolved.device.startswith("cuda") and os.environ.get("VIBEQWEN_REFERENCE", "0") != "1"
             else "reference", "" if resolved.device.startswith("cuda") or not args.enforce_eager else
             "; --enforce-eager has no effect on the CPU")
    if args.weights == "demo":
        weights = demo_checkpoint()
        name = args.served_model_name or "vibeqwen-demo"
    else:
        weights = Path(args.weights)
        name = args.served_model_name or served_name(weights)
    _check_max_model_len(weights, args.max_model_len)
    from vibeqwen.model.quant_linear import decode_w8a8_min_rows

    decode_w8a8_min_rows()  # a measuring switch read inside the model: a bad value fails here, before loading
    config = engine_config(args)
    warn_ignored_flags(args, config)
    engine = LLMEngine.from_checkpoint(weights, model_name=name, config=config)
    if args.max_model_len is not None and engine.max_model_len < args.max_model_len:
        # as vLLM: an explicit context length the server cannot give is an error, not a silent cap
        positions = engine.model.cfg.max_position_embeddings
        if args.max_model_len > positions:
            why = f"the model's max_position_embeddings is {positions}"
        else:
            cc = engine.cache_manager.config
            why = (f"the KV cache holds {cc.num_blocks * cc.block_size} tokens, less the speculative lookahead; give "
                   "it more memory with --gpu-memory-utilization on a GPU, --cache-memory-gb on the CPU")
        raise ValueError(f"--max-model-len {args.max_model_len} exceeds what this server can serve, "
                         f"{engine.max_model_len} tokens: {why}")
    policy = "cost-aware" if engine._adaptive() else "always"
    host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address in a URL takes brackets
    log.info("serving %s as %r on http://%s:%s (max_model_len %d, async scheduling %s, speculative %s)", weights,
             name, host, args.port or "<a free port: uvicorn's line below names it>", engine.max_model_len,
             "on" if engine.async_scheduling_active else "off",
             "off" if not config.spec.enabled else
             f"{config.spec.method} k={config.spec.num_speculative_tokens}, policy {policy}")
    async_engine = AsyncEngine(engine, max_queued=args.max_queue_len, warmup=True)
    app = create_app(async_engine, served_model_name=name, config=_server_config(args, weights, named_defaults))
    try:
        stopped_by = serve(app, app.state.serving.shutdown, host=args.host, port=args.port, log_level=args.log_level)
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled once the server has stopped
        stopped_by = [signal.SIGINT]
    finally:
        # a second Ctrl-C leaves requests running: stop the engine thread before the interpreter exits under it
        async_engine.shutdown()
    if signal.SIGINT in stopped_by:  # (also where SIGINT was ignored at start, so that uvicorn's re-raise did nothing)
        log.info("stopped by Ctrl-C")
        return 130  # the shell's status for a process that SIGINT ended (128 + 2), as SIGTERM's is 143
    return 0


def warn_ignored_flags(args, config) -> None:
    """Log a warning for each given `serve` flag that the rest of the command line makes ineffective (as vLLM warns,
    rather than refusing to start): args, the parsed flags; config, their EngineConfig (`engine_config`)."""
    if args.prefill_graphs and args.enforce_eager:
        log.warning("--prefill-graphs has no effect with --enforce-eager")
    if not config.spec.enabled:
        if args.speculation_policy != "auto":
            log.warning("--speculation-policy %s has no effect without --speculative", args.speculation_policy)
        if args.num_speculative_tokens is not None:
            log.warning("--num-speculative-tokens %d has no effect without --speculative", args.num_speculative_tokens)


def served_name(weights: Path) -> str:
    """The model name served for checkpoint folder `weights` without --served-model-name: the folder's own name, also
    for a relative path such as `.` or `ckpt/..` (whose last part names no folder)."""
    return weights.name if weights.name not in ("", ".", "..") else weights.resolve().name


def _check_max_model_len(weights: Path, max_model_len: int | None) -> None:
    """Refuse a --max-model-len above the model's max_position_embeddings from config.json, before the weights load
    (the cache's own limit is checked once it exists). A config that cannot be read is left to the loader's
    errors."""
    from vibeqwen.checkpoint.formats import hf_checkpoint_config
    from vibeqwen.config import ModelConfig

    if max_model_len is None:
        return
    try:
        positions = ModelConfig.from_hf(hf_checkpoint_config(weights)).max_position_embeddings
    except (OSError, ValueError):  # CheckpointError and ConfigError are ValueErrors
        return
    if max_model_len > positions:
        raise ValueError(f"--max-model-len {max_model_len} exceeds what this model can serve: its "
                         f"max_position_embeddings is {positions} ({weights / 'config.json'})")


def engine_config(args):
    """The EngineConfig of `serve`'s parsed flags (argparse.Namespace from `_parser`). Raises ValueError for a
    bad speculative combination (`spec_config`, SpecConfig's checks)."""
    from vibeqwen.engine.llm_engine import EngineConfig

    return EngineConfig(
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        cache_memory_bytes=int(args.cache_memory_gb * 2**30), gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype, device=args.device, cuda_graphs=not args.enforce_eager,
        prefill_graphs=args.prefill_graphs is not False, spec=spec_config(args), quantize=args.quantize,
        async_scheduling=args.async_scheduling, fp8_prefill=args.fp8_prefill, gdn_state_dtype=args.gdn_state_dtype,
        enable_prefix_caching=args.enable_prefix_caching, prefix_cache_slots=args.prefix_cache_slots,
    )


def spec_config(args):
    """The SpecConfig of `serve`'s flags (--speculation-policy auto leaves the choice to the engine; without
    --num-speculative-tokens, or with --speculative off, SpecConfig's default k: an ignored k must not size the
    engine's verification tables)."""
    from vibeqwen.engine.spec import SpecConfig

    adaptive = {"auto": None, "always": False, "cost-aware": True}[args.speculation_policy]
    k = ({} if args.num_speculative_tokens is None or args.speculative == "off"
         else {"num_speculative_tokens": args.num_speculative_tokens})
    return SpecConfig(args.speculative, adaptive=adaptive, **k)


def _server_config(args, weights: Path, named_defaults: dict | None = None):
    """The HTTP layer's settings from the serve flags: API key (flag, else $VIBEQWEN_API_KEY), reasoning split,
    sampling defaults from generation_config.json, body size limit. named_defaults: the sampling defaults already
    read from the folder that --generation-config names (None: read them here)."""
    from vibeqwen.server.app import ServerConfig, load_generation_defaults

    if args.generation_config == "none":
        defaults = {}
    elif named_defaults is not None:
        defaults = named_defaults
    else:
        auto = args.generation_config == "auto"
        defaults = load_generation_defaults(weights if auto else args.generation_config, strict=not auto)
    if defaults:
        log.info("sampling defaults from generation_config.json: %s", defaults)
    return ServerConfig(
        api_key=args.api_key if args.api_key is not None else os.environ.get("VIBEQWEN_API_KEY") or None,
        max_body_bytes=args.max_request_bytes, reasoning=args.reasoning_parser == "qwen3",
        generation_defaults=defaults, shutdown_grace_s=args.shutdown_grace_period,
        allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
    )


def _make_checkpoint(args) -> int:
    from vibeqwen.checkpoint.writer import write_checkpoint
    from vibeqwen.config import CONFIG_NAMES, ModelConfig

    if args.config not in CONFIG_NAMES and not Path(args.config).is_file():
        raise ValueError(f"--config must be one of {sorted(CONFIG_NAMES)} or a config JSON file; {args.config!r} "
                         "is neither")
    cfg = ModelConfig.named(args.config) if args.config in CONFIG_NAMES else ModelConfig.from_file(args.config)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is an existing file; give a directory (it is created if missing)")
    device = _available_device(args.device)
    out = write_checkpoint(cfg, args.out, seed=args.seed, device=device,
                           max_shard_bytes=int(min(args.shard_gb * (1 << 30), 1 << 62)), fmt=args.format)
    print(f"wrote {out}")
    return 0


def _available_device(device: str) -> str:
    """`make-checkpoint --device` (from `_device`) as a torch device string: auto -> cuda where one is available,
    else cpu. Raises ValueError for a CUDA device this machine does not have."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        index = int(device[5:]) if device.startswith("cuda:") else 0
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA device is available here; use --device cpu")
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _inspect(args) -> int:
    import json

    from vibeqwen.checkpoint.report import format_report, inspect_checkpoint

    code = 2
    try:
        if args.dir == "demo":  # as `serve --weights demo`
            from vibeqwen.checkpoint.demo import demo_checkpoint

            args.dir = str(demo_checkpoint())
        rep = inspect_checkpoint(args.dir)
        code = 0 if rep["loadable"] else 1
        text = json.dumps(rep, indent=2) if args.json else format_report(rep)
    except (OSError, ValueError) as e:  # main's exit-2 errors
        if not args.json:
            raise
        # --json always prints JSON: the reason it cannot be read as this model, exit code 2 as without it
        text = json.dumps({"path": args.dir, "error": str(e), "loadable": False}, indent=2)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # the reader left (`| head`): the rest goes nowhere, as with the shell's own tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


def main(argv: list[str] | None = None) -> int:
    """Run a `vibeqwen` command; returns the exit code (2 with a one-line message for bad input; 130 with one line
    for a Ctrl-C before the server runs, e.g. while the weights load or a checkpoint is written, instead of a
    traceback)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "inspect":
            return _inspect(args)
        return _make_checkpoint(args)
    except (OSError, ValueError) as e:  # CheckpointError and ConfigError are ValueErrors
        print(f"vibeqwen: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (a running server handles its own Ctrl-C: _serve returns 130)
        print(f"vibeqwen: {args.command} interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
