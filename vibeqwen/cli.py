"""Command line: `vibeqwen serve`, `vibeqwen make-checkpoint`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger("vibeqwen")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vibeqwen", description="Serve Qwen3.6-35B-A3B (NVFP4) with an OpenAI API.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    s.add_argument("--weights", required=True, help="checkpoint directory, or 'demo' for the built-in tiny checkpoint")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="model name clients send (default: folder name)")
    s.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion, in tokens")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype of the reference (CPU) path")
    s.add_argument("--device", default="cpu")
    s.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once (one GDN slot each)")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per forward pass; longer prompts are prefilled in chunks")
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    s.add_argument("--cache-memory-gb", type=float, default=0.25,
                   help="KV cache + GDN state budget in GiB on the CPU")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights, activations and cache")
    s.add_argument("--max-queue-len", type=int, default=256,
                   help="requests admitted beyond max-num-seqs; more get HTTP 503")
    s.add_argument("--speculative", default="off", choices=["off", "mtp", "ngram", "mtp+ngram"],
                   help="lossless speculative decoding: the MTP head, n-gram prompt lookup, or both")
    s.add_argument("--num-speculative-tokens", type=int, default=3, help="drafts verified per step")
    s.add_argument("--log-level", default="info")

    m = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint in the vendor NVFP4 layout")
    m.add_argument("--config", default="tiny", help="'tiny', 'full', or a path to a config JSON")
    m.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--device", default="cpu", help="where to generate and quantize (a GPU is much faster)")
    m.add_argument("--shard-gb", type=float, default=4.0, help="maximum shard size in GB")
    return p


def _serve(args) -> int:
    import uvicorn

    from vibeqwen.checkpoint.demo import demo_checkpoint
    from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
    from vibeqwen.engine.spec import SpecConfig
    from vibeqwen.server.app import create_app
    from vibeqwen.server.async_engine import AsyncEngine

    if args.weights == "demo":
        weights = demo_checkpoint()
        name = args.served_model_name or "vibeqwen-demo"
    else:
        weights = Path(args.weights)
        name = args.served_model_name or weights.name
    config = EngineConfig(
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        cache_memory_bytes=int(args.cache_memory_gb * 2**30), gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype, device=args.device,
        spec=SpecConfig(args.speculative, args.num_speculative_tokens),
    )
    engine = LLMEngine.from_checkpoint(weights, model_name=name, config=config)
    log.info("serving %s as %r on http://%s:%d (max_model_len %d)", weights, name, args.host, args.port,
             engine.max_model_len)
    app = create_app(AsyncEngine(engine, max_queued=args.max_queue_len), served_model_name=name)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _make_checkpoint(args) -> int:
    from vibeqwen.checkpoint.writer import write_checkpoint
    from vibeqwen.config import CONFIG_NAMES, ModelConfig

    cfg = ModelConfig.named(args.config) if args.config in CONFIG_NAMES else ModelConfig.from_file(args.config)
    out = write_checkpoint(cfg, args.out, seed=args.seed, device=args.device,
                           max_shard_bytes=int(args.shard_gb * (1 << 30)))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from vibeqwen.checkpoint.loader import CheckpointError
    from vibeqwen.config import ConfigError

    args = _parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            return _serve(args)
        return _make_checkpoint(args)
    except (CheckpointError, ConfigError, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"vibeqwen: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
