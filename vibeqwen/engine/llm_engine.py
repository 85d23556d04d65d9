"""The engine core: add requests, step, read outputs.

`step()` is the whole story: schedule -> run the model -> update requests. With async scheduling it
launches the next decode step before committing the one in flight (`vibeqwen.engine.inflight`). The async
layer (`vibeqwen.server.async_engine`) drives it from one thread; tests and offline use call it directly.
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from vibeqwen_kernels.gdn.recurrent import STATE_DTYPES

from vibeqwen.checkpoint.formats import hf_checkpoint_config, model_config_of
from vibeqwen.checkpoint.loader import load_checkpoint
from vibeqwen.engine.cache import CacheConfig, CacheManager
from vibeqwen.engine.inflight import InFlightStep, overlappable
from vibeqwen.engine.request import ContextLengthError, Request, prompt_fills_context
from vibeqwen.engine.runner import ModelRunner, RunnerOutput, mtp_graphs_enabled
from vibeqwen.engine.sampler import make_generator, warm_up
from vibeqwen.engine.scheduler import Scheduler, SchedulerConfig
from vibeqwen.engine.spec import SpecConfig, ngram_propose
from vibeqwen.engine.stats import EngineStats, FinishedRequestStats
from vibeqwen.model.cache import ModelCache, gdn_bytes_per_slot, gdn_state_bytes, kv_bytes_per_block
from vibeqwen.model.prefill_graphs import PREFILL_GRAPH_BYTES_PER_TOKEN
from vibeqwen.model.qwen import Qwen3_5MoeForCausalLM
from vibeqwen.model.weights import Weights
from vibeqwen.sampling import SamplingParams
from vibeqwen.tokenizer import Tokenizer

log = logging.getLogger(__name__)

#: Tokens (sequences x (k + 1)) of the largest speculative-verification CUDA graph; its GDN history buffer
#: holds 2 MiB per token and GDN layer (60 MiB a token for the full model) with float32 states, 1 MiB with
#: EngineConfig.gdn_state_dtype "bfloat16".
VERIFY_GRAPH_TOKENS = 128

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: EngineConfig.prefix_cache_slots None: this many GDN snapshots per running sequence (a request leaves up to three:
#: its prompt, a branch point, its end), in at most this share of the cache budget.
PREFIX_CACHE_SLOTS_PER_SEQ = 2
PREFIX_CACHE_BUDGET_SHARE = 0.25

#: EngineConfig.fp8_prefill values; the default (see bench/results/h200_notes.md for the measurements).
FP8_PREFILL_MODES = ("w8a8", "w8a16")
FP8_PREFILL_DEFAULT = "w8a8"

#: EngineConfig.gdn_state_dtype values: the storage dtype of the GDN recurrent state (arithmetic stays float32), the
#: dtypes the GDN kernels take (vibeqwen_kernels.gdn.recurrent.STATE_DTYPES) by name.
GDN_STATE_DTYPES = {name: d for name, d in DTYPES.items() if d in STATE_DTYPES}
GDN_STATE_DTYPE_DEFAULT = "float32"


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits. cache_memory_bytes is the KV + GDN-state budget on the CPU; on a GPU
    gpu_memory_utilization of the device's memory, less what the weights already took, is used."""

    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    cache_memory_bytes: int = 256 << 20
    gpu_memory_utilization: float = 0.9
    dtype: str = "float32"  # or "auto": bfloat16 on a GPU, float32 on the CPU
    device: str = "cpu"  # or "auto": cuda when a CUDA GPU is present (the GPU path), else cpu
    cuda_graphs: bool = True  # GPU path: replay captured CUDA graphs for decode steps
    # GPU path with cuda_graphs: also replay CUDA graphs of whole prompt chunks of one sequence (1 <= T <=
    # max_num_batched_tokens; vibeqwen.model.prefill_graphs), and run a step that mixes decode or verification
    # rows with up to 4 chunks as one replay per piece (ModelRunner._graph_pieces); ignored on the CPU. The
    # 1k-token prefill on the H200: 24.2 ms instead of 55.6 ms eager (bench/results/h200.json).
    prefill_graphs: bool = True
    spec: SpecConfig = SpecConfig()
    quantize: str = "nvfp4"  # BF16 checkpoints: quantize at load to the vendor mix, or "none"
    # launch decode step N+1 before reading step N's tokens (vibeqwen.engine.inflight); None: on for the GPU
    # path with decode CUDA graphs. Not with MTP drafting (every step runs the MTP head); with n-gram lookup,
    # steps go ahead while no request has drafts (LLMEngine.async_scheduling_active).
    async_scheduling: bool | None = None
    # GPU path: how FP8 projections (attention and GDN) run in passes that carry prompt tokens, above
    # FP8_DECODE_MAX_M rows: "w8a8" quantizes the bf16 activations per token to E4M3 for the FP8 tensor cores,
    # "w8a16" multiplies bf16 activations by the weights widened to bf16 (the oracle's numerics). Decode-only
    # passes and speculative verification always run W8A16; decode rows batched with a prompt chunk run with the
    # chunk (vibeqwen.model.quant_linear).
    fp8_prefill: str = FP8_PREFILL_DEFAULT
    # storage dtype of the GDN recurrent state (the cache's state slots and the speculative-verification history):
    # "float32", or "bfloat16" (half the state's memory and traffic). Arithmetic stays float32 either way: kernels
    # and references load the state, upcast, and round once when they store it (round to nearest even): once per
    # decode token; a multi-token pass (prefill chunk, verification) keeps its running state in float32 and rounds
    # only what it stores (the final state, and each per-token state kept for rollback).
    gdn_state_dtype: str = GDN_STATE_DTYPE_DEFAULT
    # automatic prefix caching (vibeqwen.engine.prefix_cache): a request starts after the longest cached prefix of
    # its tokens. prefix_cache_slots: GDN state snapshots kept (one GDN slot each, ~61 MiB for the full model with
    # float32 states); None: PREFIX_CACHE_SLOTS_PER_SEQ x max_num_seqs, in at most PREFIX_CACHE_BUDGET_SHARE of the
    # cache budget; 0: off
    enable_prefix_caching: bool = True
    prefix_cache_slots: int | None = None

    def __post_init__(self):
        if self.prefix_cache_slots is not None and self.prefix_cache_slots < 0:
            raise ValueError(f"prefix_cache_slots must be >= 0, got {self.prefix_cache_slots}")
        if self.fp8_prefill not in FP8_PREFILL_MODES:
            raise ValueError(f"fp8_prefill must be one of {', '.join(FP8_PREFILL_MODES)}, got {self.fp8_prefill!r}")
        if self.gdn_state_dtype not in GDN_STATE_DTYPES:
            raise ValueError(f"gdn_state_dtype must be one of {', '.join(GDN_STATE_DTYPES)}, "
                             f"got {self.gdn_state_dtype!r}")


def available_host_memory() -> int | None:
    """Bytes of memory the host can give a new allocation without swapping: Linux's MemAvailable
    (/proc/meminfo), else the free physical pages (os.sysconf), else None where neither can be read. Never
    raises."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def resolve_device(config: EngineConfig) -> EngineConfig:
    """Resolve device/dtype "auto": cuda:0 and bfloat16 when a CUDA GPU is present, else cpu and float32.
    Raises ValueError for a CUDA device on a machine without one."""
    from dataclasses import replace

    device = config.device
    if device == "auto":
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {config.device}: no CUDA GPU is available on this machine")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise ValueError(f"--device {config.device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"  # pin the index: graphs and caches live on one GPU
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))  # Triton launches and graph captures follow the current device
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return replace(config, device=device, dtype=dtype)


def release_cached_gpu_memory() -> None:
    """Collect unreachable objects (an engine dropped in a reference cycle) and hand the CUDA caching allocator's
    unused blocks back to the driver. Called before an engine's weights load onto a GPU, not only before the cache
    budget is read: an engine dropped earlier in the process, if collected while the weights load, leaves its KV
    cache and state tensors as free allocator blocks, and weights placed inside them would keep those segments
    reserved, which the new engine's cache budget (`LLMEngine._cache_budget`) then counts as used. On an 80 GB
    H100 the engine of the sixteenth test of tests/model/test_gpu_path.py got a budget of 0, most likely that way:
    with the memory released after every test, no test ended with more than 3.7 GiB in use
    (bench/results/h200_notes.md, fifty-fifth session).

    Raises:
        RuntimeError: from torch.cuda.empty_cache where CUDA fails to initialise (the caller has checked that a
            CUDA GPU is present: resolve_device)."""
    gc.collect()
    torch.cuda.empty_cache()


@dataclass
class StepOutput:
    """What one step produced for one request: its new tokens and, on the last, the finish reason.

    logprobs: one (logprob, [(id, logprob), ...]) per new token when the request asked for logprobs.
    prompt_logprobs: with a request's first output, one entry per prompt token after the first (if asked).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    num_output_tokens: int
    request: Request
    logprobs: list | None = None
    prompt_logprobs: list | None = None


def _padded_drafts(proposed: int, room: int, width: int) -> int:
    """Drafts a sequence verifies after padding to `width` (`LLMEngine._pad_width`): fillers up to the width,
    never past its room (the drafts that fit before max_tokens), never fewer than it proposed."""
    return max(min(width, room), proposed)


#: Cost-aware speculation verifies the drafts anyway after this many skipped steps in a row (re-measuring).
ADAPTIVE_RETRY_STEPS = 32


class LLMEngine:
    """Owns the scheduler, cache and model runner.

    Thread-unsafe by design: one thread calls add_request / abort_request / step.
    """

    def __init__(self, model: Qwen3_5MoeForCausalLM, tokenizer: Tokenizer, model_name: str,
                 config: EngineConfig = EngineConfig()):
        cfg = model.cfg
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.config = config
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        dtype = model.dtype
        if config.spec.uses_mtp and model.mtp is None:
            raise ValueError("speculative method uses MTP but the checkpoint has no mtp.* weights; "
                             "use --speculative ngram or off")
        mtp_layers = (cfg.num_hidden_layers,) if model.mtp is not None else ()
        block_bytes = kv_bytes_per_block(cfg, config.block_size, dtype, extra_layers=len(mtp_layers))
        state_dtype = GDN_STATE_DTYPES[config.gdn_state_dtype]
        slot_bytes = gdn_bytes_per_slot(cfg, dtype, state_dtype)
        budget = self._cache_budget()
        cache_config = CacheConfig.from_budget(budget, block_bytes, slot_bytes, config.block_size,
                                               config.max_num_seqs, self._prefix_slots(budget, slot_bytes))
        self.cache_manager = CacheManager(cache_config)
        # the MTP head's K/V at a prefix's last position depends on the token after it: hits must agree on it
        self.cache_manager.match_next_token = config.spec.uses_mtp
        k = config.spec.num_speculative_tokens if config.spec.enabled else 0
        # a context longer than the whole cache could never be served: advertise what fits, with the k slots
        # of speculative lookahead the scheduler reserves after a sequence's tokens
        self.max_model_len = min(self.max_model_len, cache_config.num_blocks * cache_config.block_size - k)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, max(config.max_num_batched_tokens, 1), k), self.cache_manager
        )
        cache = ModelCache(cfg, cache_config.num_blocks, cache_config.block_size,
                           cache_config.num_slots + cache_config.num_prefix_slots, dtype, model.device,
                           extra_attention_layers=mtp_layers, state_dtype=state_dtype)
        self.runner = ModelRunner(model, cache, self.cache_manager, config.spec,
                                  fp8_prefill_w8a8=config.fp8_prefill == "w8a8",
                                  token_vocab=tokenizer.vocab_size if 0 < tokenizer.vocab_size < cfg.vocab_size
                                  else None)
        if model.device.type == "cuda" and config.cuda_graphs and model.graph_capturable:
            self.runner.capture_decode_graphs(min(config.max_num_seqs, cache_config.num_slots), self.max_model_len)
            self.model.enable_prefill_graphs(max(config.max_num_batched_tokens, 1))
            if config.prefill_graphs:
                self.runner.capture_prefill_graphs(config.max_num_batched_tokens, self.max_model_len)
            if config.spec.enabled and k + 1 <= config.block_size:
                try:
                    self.runner.capture_verify_graphs(min(config.max_num_seqs, cache_config.num_slots),
                                                      self.max_model_len, max_tokens=VERIFY_GRAPH_TOKENS)
                except (RuntimeError, ValueError) as e:  # verification then runs eagerly, still correct
                    log.warning("could not capture speculative verification CUDA graphs (%s); running eagerly", e)
                    self.runner.verify_graphs, self.runner.history_buffers = {}, None
            if config.spec.uses_mtp and mtp_graphs_enabled():
                self.runner.capture_mtp_graphs(min(config.max_num_seqs, cache_config.num_slots), self.max_model_len)
        if model.device.type == "cuda":
            warm_up(cfg.vocab_size, model.device)  # the fused sampler's kernels built before any request
        self.async_scheduling = self._resolve_async_scheduling()
        self._inflight = None  # async scheduling: the step launched, not yet committed (a property)
        self._last_ahead: tuple[float, int] | None = None  # (time, sequences) of the last step that went ahead
        self.stats = EngineStats()
        # (sequences, tokens per sequence, graph replayed) -> the step's wall time in ms (cost-aware speculation)
        self.step_costs: dict[tuple[int, int, bool], float] = {}
        self._skipped_in_a_row = 0
        self._force_verify = False  # a retry fell due at a stale lookup (see _worth_speculating)
        # the cost-aware policy's recent decisions: (sequences, query length, graphed, c_plain ms, c_spec ms,
        # expected accepted drafts, sequences drafting, requests waiting, verified)
        self.spec_policy_log: deque[tuple] = deque(maxlen=512)
        self._cost_samples: dict[tuple[int, int, bool], int] = {}
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        log.info(
            "cache: %d KV blocks x %d tokens = %d tokens (%.1f MiB); %d GDN state slots (%.1f MiB, %s recurrent "
            "state); prefix caching %s; max_num_seqs %d, max_num_batched_tokens %d, max_model_len %d",
            cache_config.num_blocks, cache_config.block_size, cache_config.num_blocks * cache_config.block_size,
            cache_config.num_blocks * block_bytes / 2**20, cache_config.num_slots,
            cache_config.num_slots * slot_bytes / 2**20, config.gdn_state_dtype,
            f"on ({cache_config.num_prefix_slots} state snapshots, {cache_config.num_prefix_slots * slot_bytes / 2**20:.1f}"
            " MiB)" if cache_config.num_prefix_slots else "off", config.max_num_seqs,
            config.max_num_batched_tokens, self.max_model_len,
        )

    def _prefix_slots(self, budget: int, slot_bytes: int) -> int:
        """GDN state slots for prefix-cache snapshots (EngineConfig.prefix_cache_slots, None resolved)."""
        c = self.config
        if not c.enable_prefix_caching:
            return 0
        if c.prefix_cache_slots is not None:
            return c.prefix_cache_slots
        return max(0, min(PREFIX_CACHE_SLOTS_PER_SEQ * c.max_num_seqs,
                          int(PREFIX_CACHE_BUDGET_SHARE * budget) // slot_bytes))

    @property
    def _inflight(self) -> InFlightStep | None:
        """Async scheduling: the step launched, not yet committed (None when none is)."""
        return self.__inflight

    @_inflight.setter
    def _inflight(self, step: InFlightStep | None) -> None:
        self.__inflight = step
        # the scheduler takes no prefix-cache snapshot of a request whose state such a step has moved on
        self.scheduler.in_flight = frozenset(s.request.request_id for s in step.sched.scheduled) if step else frozenset()

    def _resolve_async_scheduling(self) -> bool:
        """EngineConfig.async_scheduling, None resolved: on for the GPU path with decode CUDA graphs."""
        if self.config.async_scheduling and self.config.spec.uses_mtp:
            log.warning("async scheduling is off with MTP speculative decoding (every step runs the MTP head)")
        if self.config.async_scheduling is not None:
            return self.config.async_scheduling
        return self.model.device.type == "cuda" and self.runner.graphs is not None

    def _cache_budget(self) -> int:
        """Bytes for the KV blocks and GDN state slots: on a GPU, gpu_memory_utilization of its memory less what is
        in use (unreachable objects collected and the caching allocator's unused blocks released first) and the
        activation reserve; on the CPU, cache_memory_bytes. Raises ValueError where cache_memory_bytes is more than
        the host's available memory (the allocation would get the process killed by the kernel's out-of-memory
        killer, with no message)."""
        c = self.config
        if self.model.device.type == "cuda":
            # memory of unreachable objects (an engine dropped in a reference cycle) and blocks this process's
            # caching allocator holds but no tensor uses are free for the cache too: a process that ran other GPU
            # work before building the engine would otherwise lose them
            release_cached_gpu_memory()
            free, total = torch.cuda.mem_get_info(self.model.device)
            used = total - free
            return max(int(c.gpu_memory_utilization * total) - used - self._activation_reserve(), 0)
        available = available_host_memory()
        if available is not None and c.cache_memory_bytes > available:
            raise ValueError(f"the cache budget of {c.cache_memory_bytes / 2**30:.2f} GiB (--cache-memory-gb) is more "
                             f"than the {available / 2**30:.2f} GiB of memory this host has available; lower it")
        return c.cache_memory_bytes

    def _activation_reserve(self) -> int:
        """GPU bytes kept out of the cache for activations, CUDA graphs and, when speculating, the GDN state
        after every verified token ([Hv, Dk, Dv] per token and GDN layer in EngineConfig.gdn_state_dtype, until the
        step commits)."""
        cfg, c = self.model.cfg, self.config
        reserve = 4 << 30
        if c.cuda_graphs:
            # the GDN chunk-prefill graphs (`enable_prefill_graphs`): static q, k, v, o buffers of every bucket
            # (~2x the largest) and their shared pool of fla's intermediates (~4x the inputs of the largest)
            per_token = 2 * (cfg.linear_num_key_heads * cfg.linear_key_head_dim
                             + cfg.linear_num_value_heads * cfg.linear_value_head_dim) * self.model.dtype.itemsize
            reserve += 6 * max(c.max_num_batched_tokens, 1) * per_token
        if c.cuda_graphs and c.prefill_graphs:
            # the whole-chunk prefill graphs' pool: the activation peak of one pass over the largest bucket,
            # kept for good (the eager passes' activations, in the 4 GiB above, are freed between steps)
            reserve += PREFILL_GRAPH_BYTES_PER_TOKEN * max(c.max_num_batched_tokens, 1)
        if c.spec.enabled:
            per_token = gdn_state_bytes(cfg, GDN_STATE_DTYPES[c.gdn_state_dtype])
            # + the conv inputs and the conv state before the pass (GDNHistoryBuffers)
            per_token += cfg.gdn_conv_dim * cfg.linear_conv_kernel_dim * self.model.dtype.itemsize
            # an eager verification pass of every sequence, plus the verification graphs' preallocated history
            tokens = c.max_num_seqs * (c.spec.num_speculative_tokens + 1) + VERIFY_GRAPH_TOKENS
            reserve += tokens * per_token * len(cfg.gdn_layers)
        return reserve

    @classmethod
    def from_checkpoint(cls, path: str | Path, model_name: str | None = None,
                        config: EngineConfig = EngineConfig()) -> "LLMEngine":
        """Load, validate and build the engine: config.json (architecture and fields), then the tokenizer files,
        then the weights, so that a bad directory fails before ~20 GB are read. Raises CheckpointError /
        ConfigError on a bad checkpoint, FileNotFoundError / ValueError on missing or malformed tokenizer files,
        ValueError on bad limits; nothing is left running when it does."""
        config = resolve_device(config)
        if config.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {config.dtype!r}")
        # the config first (not a directory, another model, fields missing or malformed), then the tokenizer: either
        # fails before the weights load
        model_config_of(hf_checkpoint_config(Path(path)), str(Path(path) / "config.json"))
        tokenizer = Tokenizer.from_dir(path)
        on_gpu = config.device.startswith("cuda")
        if on_gpu:
            release_cached_gpu_memory()
        # the GPU path reads packed weights as stored: load them straight onto the GPU
        ckpt = load_checkpoint(path, device=config.device if on_gpu else "cpu", quantize=config.quantize)
        if config.spec.uses_mtp and not ckpt.has_mtp:
            raise ValueError(f"{path}: --speculative {config.spec.method} needs the MTP head but the checkpoint "
                             "has no mtp.* weights; use --speculative ngram or off")
        weights = Weights(ckpt.tensors, ckpt.precisions, DTYPES[config.dtype], config.device)
        model = Qwen3_5MoeForCausalLM.from_weights(ckpt.config, weights, with_mtp=config.spec.uses_mtp)
        # the model keeps what it uses (packed or dense); drop the rest (the cache budget, read in __init__ after
        # release_cached_gpu_memory, then sees the freed load-time copies)
        del weights, ckpt
        return cls(model, tokenizer, model_name or Path(path).name, config)

    # ---- requests ----
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (with the limit in the message) for a request this engine cannot serve."""
        params.validate()
        vocab = self.model.cfg.vocab_size
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"the prompt holds token ids outside [0, {vocab})")
        ids = params.logit_bias_tensors[0]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = ids[(ids < 0) | (ids >= vocab)][:5].tolist()
            raise ValueError(f"logit_bias holds token ids outside [0, {vocab}): {bad}")
        if n >= self.max_model_len:
            raise ContextLengthError(prompt_fills_context(n, self.max_model_len))
        if n + params.max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the completion). "
                f"Please reduce the prompt or max_tokens."
            )
        capacity = self.cache_manager.config.num_blocks * self.cache_manager.block_size
        if n + params.max_tokens > capacity:
            raise ValueError(
                f"the request needs {n + params.max_tokens} tokens of KV cache but the cache holds {capacity}"
            )

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request. Raises ValueError for an invalid or duplicate request."""
        self.validate_request(prompt_token_ids, params)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids,
                      generator=None if params.greedy else make_generator(params, self.model.device))
        self.scheduler.add_request(req)
        self._requests[request_id] = req
        return req

    def abort_request(self, request_id: str, reason: str = "abort") -> Request | None:
        """Stop a request and free its cache; returns it, or None if it is not in the engine. `reason` is
        the finish reason recorded ('stop' when the caller matched a stop string)."""
        req = self.scheduler.abort_request(request_id, reason)
        if req is not None:
            self._retire(req)
            self._drop_dead_inflight()
            self._refresh_gauges()  # an idle engine takes no step that would (the metrics showed it running)
        return req

    @property
    def vocab_size(self) -> int:
        """Width of the logits (embedding rows), which token ids and logit_bias keys must stay below."""
        return self.model.cfg.vocab_size

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    def running_request_ids(self) -> list[str]:
        """Ids of the requests in the running batch (those a failed step was working on)."""
        return [r.request_id for r in self.scheduler.running]

    # ---- the loop ----
    def step(self) -> list[StepOutput]:
        """Schedule, run one forward pass, update requests. Returns outputs of requests that progressed.

        With async scheduling a decode step is launched and left in flight: the next call launches the
        decode step after it (`Scheduler.schedule_ahead`) before committing it, so each call returns the
        outputs of the step in flight when it was called (or of the step it runs itself when none was).
        Whatever cannot go ahead (see `vibeqwen.engine.inflight`) runs as the synchronous step.
        """
        prev = self._inflight
        if prev is None:
            sched = self.scheduler.schedule()
            if not self._can_overlap(sched):
                self._last_ahead = None
                return self._commit(sched, self._execute(sched))
            prev = self.runner.launch_decode(sched)
        self._inflight = None
        # drafts proposed at the last commit mean the next step verifies (a synchronous step): stop going ahead
        drafting = self.config.spec.enabled and any(r.spec_token_ids for r in self.scheduler.running)
        ahead = self.scheduler.schedule_ahead(prev.sched) if self.async_scheduling_active and not drafting else None
        if ahead is not None:
            self._inflight = self.runner.launch_decode(ahead, prev)
            self.stats.async_steps_total += 1
            self._record_async_step_cost(len(ahead.scheduled))
        else:
            self._last_ahead = None
        outputs = self._commit(prev.sched, RunnerOutput(tokens=prev.wait()))
        self._drop_dead_inflight()
        return outputs

    def _drop_dead_inflight(self) -> None:
        """Forget the in-flight step once every request in it has finished (stopped at the step before it or
        aborted): nothing of it is left to read, and the device finishes it in stream order. So the next call
        runs new work, and an idle engine holds no step."""
        if self._inflight is not None and all(s.request.finished for s in self._inflight.sched.scheduled):
            self._inflight = None
            self._last_ahead = None  # the next launch follows idle time or other work, not this step

    @property
    def async_scheduling_active(self) -> bool:
        """Whether decode steps go ahead: `async_scheduling` (which may be switched between steps), with
        speculative decoding off or n-gram only. With n-gram lookup, a step goes ahead while no request has
        drafts: each commit still looks its requests up (on the tokens committed so far), and a hit stops the
        next step from going ahead, so the step after it verifies the drafts looked up once the in-flight
        step is committed (synchronously; a lookup hit costs one step of latency, no token). MTP drafts come
        out of every forward pass, which the overlapped decode step does not run: no async scheduling."""
        spec = self.config.spec
        return self.async_scheduling and (not spec.enabled or (spec.uses_ngram and not spec.uses_mtp))

    def _record_async_step_cost(self, n: int) -> None:
        """Cost-aware speculation with async scheduling: a decode step that goes ahead costs the interval
        between two launches in a row of the same batch (what verifying drafts must beat), not the
        synchronous step's wall time; recorded under the decode graph's key."""
        now = time.perf_counter()
        last, self._last_ahead = self._last_ahead, (now, n)
        if last is None or last[1] != n or not (self.config.spec.enabled and self._adaptive()):
            return
        self._update_step_cost(self._cost_key(n, 1, self.runner.last_graphed), (now - last[0]) * 1e3)

    def _can_overlap(self, sched) -> bool:
        """Async scheduling applies to this step: a decode step (every request `overlappable`) of every
        running request. (Seeded sampling requests too: their draws are keyed by sequence position, so whether a
        step verifies drafts or goes ahead changes none of their tokens; `sampler.position_key`.)"""
        return (self.async_scheduling_active and bool(sched.scheduled) and len(sched.scheduled) == len(self.scheduler.running)
                and all(overlappable(s) for s in sched.scheduled))

    def _execute(self, sched) -> RunnerOutput:
        """The synchronous forward pass of `sched` (its wall time feeds cost-aware speculation)."""
        if not sched.scheduled:
            return RunnerOutput()
        t0 = time.perf_counter()
        ran = self.runner.execute(sched)  # ends with a device sync (the sampled tokens): wall time = cost
        self._record_step_cost(sched, (time.perf_counter() - t0) * 1e3)
        return ran

    def _commit(self, sched, ran: RunnerOutput) -> list[StepOutput]:
        """Apply a step's results to its requests (append, stop checks, drafts, stats); their outputs."""
        for rid, lps in ran.prompt_logprobs.items():
            self._requests[rid].prompt_logprobs.extend(lps)
        results = self.scheduler.update(sched, ran.tokens)
        if self.config.spec.enabled:
            self._propose(results, ran.mtp_drafts, stale=self._inflight is not None)
        self._account(sched, results, ran.tokens)
        outputs = []
        for req, toks in results:
            out = StepOutput(req.request_id, toks, req.finish_reason, req.num_output_tokens, req)
            if req.params.logprobs is not None:
                out.logprobs = ran.logprobs[req.request_id][: len(toks)]
                req.output_logprobs.extend(out.logprobs)
            if req.params.prompt_logprobs is not None and req.num_output_tokens == len(toks):
                out.prompt_logprobs = list(req.prompt_logprobs)
            outputs.append(out)
        return outputs

    def _propose(self, results, mtp_drafts: dict[str, list[int]], stale: bool = False) -> None:
        """Set each decoding request's drafts for the next step: n-gram lookup first (when on), else MTP.
        With cost-aware speculation (SpecConfig.adaptive) the drafts are dropped when verifying them is not
        worth its measured cost (`_worth_speculating`). With draft padding (SpecConfig.pad_drafts), every
        request that has room gets filler drafts up to `_pad_width`, so the next verification batch has one
        query length (a CUDA graph)."""
        spec = self.config.spec
        rooms: dict[str, int] = {}
        for req, _ in results:
            if req.finished:
                continue
            # never draft past max_tokens (the step also samples one token of its own)
            room = min(spec.num_speculative_tokens, req.params.max_tokens - req.num_output_tokens - 1)
            if req.params.constraint is not None:
                room = 0  # a constraint's mask depends on every accepted token: verify one at a time
            drafts: list[int] = []
            if room > 0 and spec.uses_ngram:
                drafts = ngram_propose(req.all_token_ids, room, spec.prompt_lookup_min, spec.prompt_lookup_max)
            if room > 0 and not drafts and spec.uses_mtp:
                drafts = mtp_drafts.get(req.request_id, [])[:room]
            req.spec_token_ids, req.num_real_drafts = drafts, len(drafts)
            rooms[req.request_id] = room
        width = self._pad_width(rooms)
        # stale (async scheduling): the next step is already in flight without drafts, so these can never be
        # verified; they only say whether the step after it should stop going ahead and verify what the next
        # commit looks up (kept, unpadded, as a marker when the policy would verify them, else dropped)
        if rooms and not self._worth_speculating(rooms, width, stale=stale):
            if not stale:
                self.stats.spec_skipped_steps_total += 1
            for rid in rooms:
                req = self._requests[rid]
                req.spec_token_ids, req.num_real_drafts = [], 0
            return
        if stale:
            return
        for rid, room in rooms.items():
            req = self._requests.get(rid)
            if req is None:
                continue
            extra = _padded_drafts(len(req.spec_token_ids), room, width) - len(req.spec_token_ids)
            if extra == 0:
                continue
            fill = req.spec_token_ids[-1] if req.spec_token_ids else (
                req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1])
            req.spec_token_ids = req.spec_token_ids + [fill] * extra

    # ---- cost-aware speculation (SpecConfig.adaptive) ----
    def _adaptive(self) -> bool:
        """Whether the cost-aware policy decides (SpecConfig.adaptive; None: on the GPU path)."""
        a = self.config.spec.adaptive
        return a if a is not None else (self.model.fast and self.model.device.type == "cuda")

    def _cost_key(self, num_seqs: int, query_len: int, graphed: bool) -> tuple[int, int, bool]:
        """Graph replays of n sequences cost what the captured graph of the next size up costs; eager steps
        are keyed by n itself."""
        graphs = self.runner.graphs if query_len == 1 else self.runner.verify_graphs.get(query_len)
        if graphed and graphs is not None and num_seqs <= graphs.max_batch:
            num_seqs = next(g for g in graphs.sizes if g >= num_seqs)
        return num_seqs, query_len, graphed

    def _record_step_cost(self, sched, ms: float) -> None:
        """Wall time of decode / verification steps by (sequences, longest query, graph or eager): what the
        speculation policy weighs. The first samples of a key keep their minimum (the first step of a shape
        may include a compile), later ones a moving average that is quick to come down and slow to go up.
        Steps with prompt tokens are not recorded."""
        if not (self.config.spec.enabled and self._adaptive()):
            return
        if any(x.num_new_tokens > len(x.spec_token_ids) + 1 for x in sched.scheduled):
            return  # a prompt chunk: not a decode step
        key = self._cost_key(len(sched.scheduled), max(x.num_new_tokens for x in sched.scheduled),
                             self.runner.last_graphed)
        self._update_step_cost(key, ms)

    def _update_step_cost(self, key: tuple[int, int, bool], ms: float) -> None:
        """One sample of a step shape's cost (see `_record_step_cost`)."""
        old, n = self.step_costs.get(key), self._cost_samples.get(key, 0)
        if old is None:
            new = ms
        elif n < 3 or ms <= old:
            new = min(old, ms) if n < 3 else 0.5 * old + 0.5 * ms
        else:
            new = 0.9 * old + 0.1 * ms
        self.step_costs[key], self._cost_samples[key] = new, n + 1

    def _worth_speculating(self, rooms: dict[str, int], width: int | None = None, stale: bool = False) -> bool:
        """Whether the next step should verify the proposed drafts, from the measured costs of a decode step
        (c_plain) and of the verification step this batch would run (c_spec), and each sequence's expected
        accepted drafts g_i (`EngineStats.expected_accepted`; 0 for a sequence with no drafts of its own,
        whose padding drafts are the target's tokens only by chance):

        * requests waiting (the batch is full): throughput, speculate iff
          sum_i (1 + g_i) / c_spec >= n / c_plain. Finishing sooner frees a slot for a waiting request.
        * nothing waiting: mean time per output token over the running requests, speculate iff
          sum_i c_spec / (1 + g_i) <= n * c_plain. Verification of a padded batch makes every sequence pay
          for the longest query, so a few drafting sequences must not slow the others more than they gain
          themselves; a closed batch finishes with its slowest sequences (bench/results/h200_notes.md).

        Unmeasured shapes are tried (that measures them), except an eager verification step while verification
        graphs exist (host-bound, and maybe compiling kernels): declined until the retry below measures it.
        Only with SpecConfig.adaptive (default: the GPU
        path; seeded requests included: their draws are keyed by sequence position, so the decision changes none
        of their tokens). width: the step's `_pad_width` when the
        caller has it. Each decision is appended to `spec_policy_log`.

        stale: a lookup made while the next step is in flight (async scheduling), whose drafts cannot be
        verified: the same rule, but neither logged nor counted, except that declined lookups count toward
        the retry, and a retry that falls due is kept (`_force_verify`) for the next real decision."""
        if not self._adaptive():
            return True
        reqs = [self._requests[rid] for rid in rooms]
        drafts = [len(r.spec_token_ids) for r in reqs]
        longest = max(drafts, default=0)
        if longest == 0:
            return True
        if width is None:
            width = self._pad_width(rooms)
        n = len(rooms)
        q, spec_graphed = self._verification_graphed(rooms, width)
        plain = self.step_costs.get(self._cost_key(n, 1, self.runner.graphs is not None
                                                    and n <= self.runner.graphs.max_batch))
        spec = self.step_costs.get(self._cost_key(n, q, spec_graphed))
        if spec is None and not spec_graphed and self.runner.verify_graphs and plain is not None:
            spec = math.inf  # eager next to graphs (see above): only a retry measures it
        if plain is None or spec is None:
            return True
        gains = [self.stats.expected_accepted(d) for d in drafts]
        waiting = any(r.request_id not in rooms for r in self.scheduler.waiting)
        if waiting:
            worth = (n + sum(gains)) / spec >= n / plain
        else:
            worth = sum(spec / (1 + g) for g in gains) <= n * plain
        if not stale:
            # an unmeasured eager step's inf is logged as None (strict JSON readers reject Infinity)
            self.spec_policy_log.append((n, q, spec_graphed, round(plain, 3),
                                         round(spec, 3) if math.isfinite(spec) else None,
                                         round(sum(gains), 2), sum(d > 0 for d in drafts), waiting, worth))
        if not stale and self._force_verify:  # a retry that fell due at a stale lookup
            self._force_verify = False
            if not worth:
                return True
        if worth:
            if not stale:
                self._skipped_in_a_row = 0
            return True
        self._skipped_in_a_row += 1
        if self._skipped_in_a_row >= ADAPTIVE_RETRY_STEPS:  # re-measure now and then: costs and rates drift
            self._skipped_in_a_row = 0
            self._force_verify = stale  # a stale lookup cannot verify: the next real decision does
            return True
        return False

    def _pad_width(self, rooms: dict[str, int]) -> int:
        """Drafts per sequence to pad the next step to (0: no padding). With verification graphs: the smallest
        captured k' + 1 >= the longest proposal + 1 whose graphs take this many sequences (else none: a padded
        batch that runs eagerly only adds tokens), also for a single sequence (only the captured query lengths
        replay a graph; on the H200 an eager verification step took 3-7x a replay). pad_drafts=True without
        graphs: the longest proposal, for two or more sequences."""
        spec = self.config.spec
        graphs = self.runner.verify_graphs
        if not (spec.pad_drafts if spec.pad_drafts is not None else bool(graphs)) or not rooms:
            return 0
        if not graphs and len(rooms) < 2:
            return 0  # one sequence is one query length already: fillers would only add tokens
        longest = max(len(self._requests[rid].spec_token_ids) for rid in rooms)
        if longest == 0:
            return 0
        if not graphs:
            return longest
        fits = [q for q, g in graphs.items() if q >= longest + 1 and len(rooms) <= g.max_batch]
        return min(fits) - 1 if fits else 0

    def _verification_graphed(self, rooms: dict[str, int], width: int) -> tuple[int, bool]:
        """The query length of the verification step `_propose` would schedule (the longest, after padding to
        `width` within each sequence's room) and whether a captured verification graph runs it: every
        sequence at that length and a graph for it taking this many sequences."""
        qs = {_padded_drafts(len(self._requests[rid].spec_token_ids), room, width) + 1
              for rid, room in rooms.items()}
        q = max(qs)
        vg = self.runner.verify_graphs.get(q)
        return q, len(qs) == 1 and vg is not None and len(rooms) <= vg.max_batch

    def _account(self, sched, results, sampled: dict[str, list[int]]) -> None:
        s = self.stats
        s.steps_total += 1
        s.preemptions_total += len(sched.preempted)
        for x in sched.scheduled:
            if x.skipped:  # finished before this step's results (update() left it alone)
                continue
            # update() already advanced num_computed_tokens past this step's chunk [start, end)
            end = x.request.num_computed_tokens
            s.prompt_tokens_total += max(0, min(end, len(x.request.prompt_token_ids)) - (end - x.num_new_tokens))
        s.generation_tokens_total += sum(len(t) for _, t in results)
        for x in sched.scheduled:
            d = x.num_real_drafts  # padding drafts are not counted
            verified = sampled.get(x.request.request_id)
            if d and verified is not None:
                accepted = x.accepted_real(len(verified))
                s.spec_steps_total += 1
                s.spec_drafted_total += d
                s.spec_accepted_total += accepted
                for pos in range(d):
                    s.record_position(pos, pos < accepted)
        for req, _ in results:
            if req.finished:
                self._retire(req)
        self._refresh_gauges()

    def _refresh_gauges(self) -> None:
        """The stats' gauges (requests running / waiting, KV-cache and GDN-slot usage) from the current state."""
        s = self.stats
        s.num_running, s.num_waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        s.kv_usage, s.gdn_slot_usage = self.cache_manager.usage()
        s.prefix_cache_queries_total = self.scheduler.prefix_cache_queries
        s.prefix_cache_hits_total = self.scheduler.prefix_cache_hits

    def _retire(self, req: Request) -> None:
        if self._requests.pop(req.request_id, None) is None:
            return
        self.stats.finished.append(FinishedRequestStats(
            req.request_id, req.finish_reason or "abort", len(req.prompt_token_ids), req.num_output_tokens,
            req.ttft, req.tpot, (req.finish_time or time.monotonic()) - req.arrival_time,
        ))

    # ---- offline convenience ----
    def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> Iterator[tuple[int, str | None]]:
        """Yield (token_id, finish_reason) for one request, stepping the engine (and anything else queued).

        finish_reason is None until the last token: 'stop' (EOS or a stop token id, which is yielded) or
        'length'. Closing the generator aborts the request. Raises ValueError for an invalid request.
        """
        rid = f"gen-{next(self._ids)}"
        req = self.add_request(rid, prompt_token_ids, params)
        try:
            while not req.finished:
                for out in self.step():
                    if out.request_id == rid:
                        for tok in out.new_token_ids:
                            yield tok, out.finish_reason
        finally:
            if not req.finished:
                self.abort_request(rid)

    def generate_batch(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
        """Run several requests to completion together; return each one's output token ids."""
        reqs = [self.add_request(f"batch-{next(self._ids)}", p, sp) for p, sp in zip(prompts, params)]
        while any(not r.finished for r in reqs):
            self.step()
        return [r.output_token_ids for r in reqs]
