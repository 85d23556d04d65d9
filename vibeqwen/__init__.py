"""VibeQwen: a serving engine for Qwen3.6-35B-A3B with NVFP4 weights on one GPU."""

__version__ = "0.1.0"
