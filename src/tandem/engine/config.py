"""One engine configuration, built once from the user's arguments: the offline `LLM`, the CLI and
the server all turn their knobs into an `EngineConfig`, which resolves the model and tokenizer
paths and reads the model's config a single time. It is plain data, so it crosses into the
engine-core process.

The knobs are vLLM's (same names, defaults and meanings; docs/coming-from-vllm.md lists every
one). A knob that means nothing on this device, or that tandem does not act on yet, is accepted
and said so in the log when the config is built: never silently different.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.attention.backends import resolve_attention_backend
from tandem.config import ModelConfig
from tandem.core.scheduler import SchedulerConfig
from tandem.generation_config import SAMPLING_KEYS, generation_config_defaults
from tandem.kv_transfer.config import KVTransferConfig
from tandem.models.gguf_loader import gguf_has_packable_weights
from tandem.models.loader import DEFAULT_MODEL, load_model_config, resolve_model_path
from tandem.sampling_params import LOGPROBS_MODES, SamplingParams, num_top_logprobs
from tandem.spec_decode.config import SpeculativeConfig
from tandem.worker.model_runner import (
    DEFAULT_KV_CACHE_MEMORY,
    DTYPES,
    RunnerConfig,
    check_kv_cache_dtype,
    parse_kv_cache_dtype,
)

logger = logging.getLogger(__name__)

PREFIX_CACHING_HASH_ALGOS = ("xxhash", "sha256")
# vLLM's dtype names: "half" is float16 and "float" float32; "auto" is resolved per device.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DTYPE_CHOICES = ("auto", *DTYPES, *DTYPE_ALIASES)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # with chunked prefill (vLLM's offline default too)
DEFAULT_MAX_LOGPROBS = 20  # vLLM's
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's
# num_scheduler_steps=None on a CPU whose decode steps run fused (packed weights, the cpu
# attention backend): up to this many forwards a step of decodes alone, as many as fit
# the scheduler's MULTI_STEP_WINDOW (a batch-1 step of the default model's ~220 us of engine
# work is then ~2% of its tokens' time instead of ~7%: BENCHMARKS.md).
DEFAULT_CPU_SCHEDULER_STEPS = 8
# Stream writes first (EngineConfig.stream_writes_first, engine/core_process.py): after an
# outputs message for at least this many streams (the API process's chunks for 8 take ~0.4 ms
# of CPU) the engine core waits for the API process to have written them, at most this long.
WRITES_MIN_OUTPUTS = 8
WRITES_MAX_WAIT_SECONDS = 0.005
GENERATION_CONFIG_SOURCES = ("auto", "vllm")  # or a folder holding generation_config.json


@dataclass(frozen=True)
class EngineConfig:
    model_path: Path
    model_config: ModelConfig
    runner: RunnerConfig
    scheduler: SchedulerConfig
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "xxhash"
    skip_tokenizer_init: bool = False
    tokenizer_path: Path | None = None  # None: the model's own (model_path)
    seed: int | None = 0  # seeds random, numpy and torch in the engine core's process
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # -1: no limit
    logprobs_mode: str = "raw_logprobs"  # for requests that do not choose their own
    disable_log_stats: bool = False
    # Where sampling defaults come from: a folder with generation_config.json, or None for
    # vLLM's own defaults (generation_config="vllm"); plus override_generation_config.
    generation_config_path: Path | None = None
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    step_log: Path | None = None  # a JSON line per engine step is appended here
    # The machine's ceilings for MFU / MBU; None: the data sheet (known GPUs) or a probe (CPU).
    peak_tflops: float | None = None
    peak_bandwidth_gbps: float | None = None
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # The draft model's runner (speculative method "draft_model"); its KV cache gets as many
    # blocks as the target's, whatever num_kv_blocks says here.
    draft_runner: RunnerConfig | None = None
    # Schedule and prepare the next step while the current one's forward runs (a thread).
    async_scheduling: bool = False
    # Disaggregated serving: this instance's role and where its KV transfers meet; None:
    # prefill and decode both happen here (role "both").
    kv_transfer: KVTransferConfig | None = None
    # The engine core waits (briefly) for the API process to write a step's streamed chunks
    # before its next forward (engine/core_process.py): on CPU, where the forward takes every
    # core; on a GPU the device would idle meanwhile.
    stream_writes_first: bool = False
    # On CPU, drop forward threads while other processes hold some of the cores, and take
    # them back once the cores are free (worker/cpu_threads.py).
    adapt_cpu_threads: bool = True

    @classmethod
    def create(
        cls,
        model: str | Path = DEFAULT_MODEL,
        *,
        tokenizer: str | Path | None = None,
        skip_tokenizer_init: bool = False,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        dtype: str | torch.dtype = "auto",
        kv_cache_dtype: str = "auto",
        device: str | None = None,
        seed: int | None = 0,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 256,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        logprobs_mode: str = "raw_logprobs",
        disable_log_stats: bool = False,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        prefix_caching_hash_algo: str = "xxhash",
        scheduling_policy: str = "fcfs",
        batching_policy: str = "decode-first",
        max_num_partial_prefills: int = 1,
        long_prefill_token_threshold: int = 0,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        generation_config: str | Path = "auto",
        override_generation_config: dict[str, Any] | None = None,
        gpu_memory_utilization: float | None = None,
        swap_space: float | None = None,
        enforce_eager: bool | None = None,
        compilation_config: int | dict[str, Any] | None = None,
        step_log: str | Path | None = None,
        peak_tflops: float | None = None,
        peak_bandwidth_gbps: float | None = None,
        target_itl_ms: float | None = None,
        speculative_config: dict[str, Any] | None = None,
        async_scheduling: bool | None = None,
        kv_transfer_config: KVTransferConfig | None = None,
        attention_backend: str | None = "auto",
        num_scheduler_steps: int | None = None,
        adapt_cpu_threads: bool = True,
        stream_writes_first: bool | None = None,
    ) -> EngineConfig:
        """Validate every knob before anything heavy loads; raises ValueError/FileNotFoundError
        naming what to change. None for gpu_memory_utilization, swap_space and enforce_eager
        means "not given" (vLLM's defaults: 0.9, 4 GiB, False). async_scheduling None: on
        for CUDA, off on CPU (where the forward's threads use every core and overlap measured
        slower: BENCHMARKS.md), and off with speculative decoding or num_scheduler_steps > 1.
        num_scheduler_steps None: DEFAULT_CPU_SCHEDULER_STEPS where a CPU's decode steps run
        fused and async scheduling is off, else 1. stream_writes_first None: on for CPU."""
        if trust_remote_code:
            raise ValueError(
                "trust_remote_code=True: tandem never runs code shipped with a checkpoint; the "
                "architectures it supports need none, so leave trust_remote_code=False"
            )
        for name, peak in (("peak_tflops", peak_tflops),
                           ("peak_bandwidth_gbps", peak_bandwidth_gbps),
                           ("target_itl_ms", target_itl_ms)):  # fmt: skip
            if peak is not None and (isinstance(peak, bool) or not isinstance(peak, int | float)
                                     or not 0 < peak < float("inf")):  # fmt: skip
                raise ValueError(f"{name} must be a positive number, got {peak!r}")
        if tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size}: tandem runs a model on one device, "
                "so tensor_parallel_size must be 1"
            )
        if prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ValueError(
                f"prefix_caching_hash_algo must be one of {', '.join(PREFIX_CACHING_HASH_ALGOS)}, "
                f"got {prefix_caching_hash_algo!r}"
            )
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}"
            )
        if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int):
            raise ValueError(f"max_logprobs must be an int (-1: no limit), got {max_logprobs!r}")
        if max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0 or -1 (no limit), got {max_logprobs}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        if stream_writes_first is not None and not isinstance(stream_writes_first, bool):
            raise ValueError(
                f"stream_writes_first must be True, False or None, got {stream_writes_first!r}"
            )
        if not isinstance(adapt_cpu_threads, bool):
            raise ValueError(f"adapt_cpu_threads must be True or False, got {adapt_cpu_threads!r}")
        check_kv_cache_dtype(kv_cache_dtype)
        speculative = SpeculativeConfig.parse(speculative_config)
        multi_step = _check_scheduler_steps(num_scheduler_steps, async_scheduling)
        if async_scheduling and speculative is not None:
            raise ValueError(
                "async_scheduling cannot be combined with speculative decoding (which drafts "
                "to verify depends on the tokens still in flight): drop one of them"
            )
        model_path = resolve_model_path(model)
        model_config = load_model_config(model_path)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        # CUDA sizes the cache by profiling unless its size is given (vLLM's rule).
        profile_memory = (
            device.startswith("cuda") and num_kv_blocks is None and kv_cache_memory is None
        )
        _note_no_effect(device, gpu_memory_utilization, swap_space, enforce_eager, profile_memory)
        if max_model_len is not None and max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} is larger than the model's "
                f"max_position_embeddings={model_config.max_position_embeddings}: lower it"
            )
        max_model_len = max_model_len or model_config.max_position_embeddings
        if max_num_batched_tokens is None:  # vLLM's rule: without chunking a prompt must fit
            max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
            if not enable_chunked_prefill:
                max_num_batched_tokens = max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
        dtype_name, packed_max_tokens, packed_int8_min_tokens = resolve_dtype(
            dtype, device, model_config, model_path
        )
        attention = resolve_attention_backend(attention_backend, device)
        kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, dtype_name, attention)
        parse_kv_cache_dtype(kv_cache_dtype, DTYPES[dtype_name], attention)
        decode_graphs = device.startswith("cuda") and not enforce_eager
        if decode_graphs and attention != "triton":
            logger.info("decode steps run eagerly: CUDA graphs need the triton attention backend")
            decode_graphs = False
        runner = RunnerConfig(
            compile_layers=compile_layers(compilation_config, device),
            model=model_path,
            dtype=dtype_name,
            kv_cache_dtype=kv_cache_dtype,
            packed_max_tokens=packed_max_tokens,
            packed_int8_min_tokens=packed_int8_min_tokens,
            dense_max_tokens=dense_max_tokens(dtype_name, packed_max_tokens, device, model_config),
            device=device,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory or DEFAULT_KV_CACHE_MEMORY,
            gpu_memory_utilization=(gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION)
            if profile_memory
            else None,
            profile_num_tokens=max_num_batched_tokens,
            profile_num_seqs=max_num_seqs,
            attention_backend=attention,
            decode_graph_max_batch=max_num_seqs if decode_graphs else 0,
            max_model_len=max_model_len,
        )
        logger.info("attention backend: %s", runner.attention_backend)
        if runner.compile_layers and runner.eager_max_tokens >= max_num_batched_tokens:
            logger.info(
                "compilation_config: no step is compiled: steps of up to %d tokens (the whole "
                "step budget) multiply the packed weights or the dense kernel",
                runner.eager_max_tokens,
            )
        fused = packed_max_tokens > 0 and attention == "cpu" and device == "cpu"
        if multi_step and not fused:
            logger.warning(
                "num_scheduler_steps=%d: one forward per step here (several need a CPU whose "
                "decode steps run fused: packed GGUF weights under dtype auto, the cpu "
                "attention backend)", num_scheduler_steps,
            )  # fmt: skip
            num_scheduler_steps, multi_step = 1, False
        if async_scheduling is None:
            async_scheduling = device.startswith("cuda") and speculative is None and not multi_step
        if stream_writes_first is None:
            stream_writes_first = device == "cpu"
        if num_scheduler_steps is None:
            steps_apply = fused and not async_scheduling
            num_scheduler_steps = DEFAULT_CPU_SCHEDULER_STEPS if steps_apply else 1
        draft_runner = None
        if speculative is not None and speculative.method == "draft_model":
            if profile_memory:
                raise ValueError(
                    "a draft model on CUDA needs the KV cache size given (the profile that "
                    "sizes it does not count the draft model's weights and cache): pass "
                    "kv_cache_memory or num_kv_blocks"
                )
            draft_runner = _draft_runner(speculative, runner, model_config, max_model_len)
        scheduler = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_partial_prefills=max_num_partial_prefills,
            long_prefill_token_threshold=long_prefill_token_threshold,
            batching_policy=batching_policy,
            scheduling_policy=scheduling_policy,
            enable_chunked_prefill=enable_chunked_prefill,
            target_step_time=None if target_itl_ms is None else target_itl_ms / 1000,
            num_speculative_tokens=0 if speculative is None else speculative.num_speculative_tokens,
            adaptive_speculation=speculative is None or speculative.adaptive,
            speculation_max_running=None if speculative is None
            else speculative.disable_by_batch_size,
            num_scheduler_steps=num_scheduler_steps,
        )  # fmt: skip
        return cls(
            model_path=model_path,
            model_config=model_config,
            runner=runner,
            scheduler=scheduler,
            enable_prefix_caching=enable_prefix_caching,
            prefix_caching_hash_algo=prefix_caching_hash_algo,
            skip_tokenizer_init=skip_tokenizer_init,
            tokenizer_path=None if tokenizer is None else resolve_tokenizer_path(tokenizer),
            seed=seed,
            max_logprobs=max_logprobs,
            logprobs_mode=logprobs_mode,
            disable_log_stats=disable_log_stats,
            generation_config_path=_generation_config_path(generation_config, model_path),
            override_generation_config=dict(override_generation_config or {}),
            step_log=None if step_log is None else Path(step_log),
            peak_tflops=peak_tflops,
            peak_bandwidth_gbps=peak_bandwidth_gbps,
            speculative=speculative,
            draft_runner=draft_runner,
            async_scheduling=async_scheduling,
            kv_transfer=kv_transfer_config,
            adapt_cpu_threads=adapt_cpu_threads,
            stream_writes_first=stream_writes_first,
        )

    @property
    def tokenizer_source(self) -> Path:
        """Where the tokenizer (and chat template) is read from."""
        return self.tokenizer_path or self.model_path

    def eos_token_ids(self, tokenizer_eos: int | None) -> tuple[int | None, tuple[int, ...]]:
        """The EOS id requests stop at, and the model's other EOS ids (become stop tokens)."""
        eos = tokenizer_eos
        if eos is None and self.model_config.eos_token_ids:
            eos = self.model_config.eos_token_ids[0]
        extra = tuple(t for t in self.model_config.eos_token_ids if t != eos)
        return eos, extra

    def sampling_defaults(self) -> dict[str, Any]:
        """SamplingParams defaults from the generation config (vLLM's get_diff_sampling_param):
        generation_config.json's sampling fields (generation_config="auto" or a folder) with
        override_generation_config on top; only the overrides for generation_config="vllm"."""
        overrides = self.override_generation_config
        if self.generation_config_path is not None:
            return generation_config_defaults(self.generation_config_path, overrides)
        return {
            name: overrides[key]
            for key, name in SAMPLING_KEYS.items()
            if overrides.get(key) is not None
        }

    def request_params(self, params: SamplingParams) -> SamplingParams:
        """A request's SamplingParams as this engine runs them: the engine-wide logprobs_mode
        where the request chose none, and ValueError for more logprobs than max_logprobs.
        Front ends (LLM, AsyncLLM) call it before queueing anything."""
        self.check_logprobs(params)
        if self.logprobs_mode != "raw_logprobs" and "logprobs_mode" not in params.fields_set:
            params = params.with_defaults({"logprobs_mode": self.logprobs_mode})
        return params

    def check_logprobs(self, params: SamplingParams) -> None:
        """ValueError naming both numbers when a request asks for more logprobs (or prompt
        logprobs) than max_logprobs, as vLLM refuses it."""
        vocab_size = self.model_config.vocab_size
        limit = vocab_size if self.max_logprobs == -1 else self.max_logprobs
        if params.logprob_token_ids and len(params.logprob_token_ids) > limit:
            raise ValueError(
                f"logprob_token_ids has {len(params.logprob_token_ids)} ids, more than "
                f"max_logprobs={limit}: ask for at most {limit}, or start the engine with a "
                "larger max_logprobs (-1: no limit)"
            )
        for name in ("logprobs", "prompt_logprobs"):
            requested = getattr(params, name)
            if requested is not None and num_top_logprobs(requested, vocab_size) > limit:
                asked = "-1 (the whole vocabulary)" if requested == -1 else str(requested)
                raise ValueError(
                    f"{name}={asked} is more than max_logprobs={limit}: ask for at most {limit}, "
                    f"or start the engine with a larger max_logprobs (-1: no limit)"
                )


def resolve_dtype(
    dtype: str | torch.dtype, device: str, model_config: ModelConfig, model_path: Path
) -> tuple[str, int, int]:
    """vLLM's dtype names to one of DTYPES, the largest step (in tokens) that multiplies
    packed 4-bit weights (0: none) and the smallest of those that quantizes its activations
    to int8 (0: none). "auto" on CPU: what the CPU format probe measures fastest
    here (engine/cpu_formats.py); on CUDA the checkpoint's own dtype, with float32 (or unknown,
    e.g. GGUF) checkpoints run in bfloat16 (float16 without bf16). An explicit dtype runs the
    dense weights only: float32 stays the reference."""
    if isinstance(dtype, torch.dtype):
        names: dict[torch.dtype, str] = {}
        for name, value in DTYPES.items():
            names.setdefault(value, name)  # the long name ("float16", not "fp16")
        if dtype not in names:
            raise ValueError(f"dtype {dtype} is not supported; choose one of {DTYPE_CHOICES}")
        return names[dtype], 0, 0
    if not isinstance(dtype, str) or dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {DTYPE_CHOICES}")
    if dtype != "auto":
        return DTYPE_ALIASES.get(dtype, dtype), 0, 0
    saved = model_config.torch_dtype
    if not device.startswith("cuda"):
        from tandem.engine.cpu_formats import cpu_formats

        packable = model_path.suffix == ".gguf" and gguf_has_packable_weights(model_path)
        formats = cpu_formats(model_config, packable)
        logger.info("dtype='auto' on %s: %s", device, formats.describe())
        return formats.dtype, formats.packed_max_tokens, formats.int8_min_tokens
    if saved in ("bfloat16", "float16"):
        chosen = saved
    else:
        chosen = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    logger.info("dtype='auto' on %s: %s (checkpoint saved in %s)", device, chosen, saved)
    return chosen, 0, 0


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, dtype: str | torch.dtype, dtype_name: str, attention: str
) -> str:
    """vLLM's "auto" is the model's dtype. Under dtype="auto" on the CPU kernels a float32
    model's cache is bfloat16 instead: decode attention reads every request's context from
    memory each step, and half the bytes made it 1.5-1.65x faster, the offline workload 15%
    and 32 x 128 10% faster on the AVX2 EPYC, within issue 10's quality bar (BENCHMARKS.md).
    kv_cache_dtype="float32" keeps it exact; an explicit dtype keeps vLLM's rule."""
    if kv_cache_dtype != "auto" or dtype != "auto" or attention != "cpu" or dtype_name != "float32":
        return kv_cache_dtype
    logger.info("kv_cache_dtype='auto' under dtype='auto' on the cpu attention backend: bfloat16")
    return "bfloat16"


def dense_max_tokens(
    dtype: str, packed_max_tokens: int, device: str, model_config: ModelConfig
) -> int:
    """Up to how many tokens the steps of a float32 model without packed weights multiply in
    the C dense kernel on CPU, as measured here (engine/cpu_formats.py); 0 elsewhere. Packed
    weights take the small steps where the kernel would win."""
    if torch.device(device).type != "cpu" or DTYPES[dtype] != torch.float32 or packed_max_tokens:
        return 0
    from tandem.engine.cpu_formats import dense_kernel_max_tokens

    return dense_kernel_max_tokens(model_config)


def _draft_runner(
    speculative: SpeculativeConfig,
    target: RunnerConfig,
    target_config: ModelConfig,
    max_model_len: int,
) -> RunnerConfig:
    """The draft model's runner: same device and block size as the target, its own dtype."""
    assert speculative.draft_model is not None
    path = resolve_model_path(speculative.draft_model)
    config = load_model_config(path)
    if config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"the draft model {speculative.draft_model!r} has a vocabulary of {config.vocab_size} "
            f"tokens, the target {target_config.vocab_size}: a draft must share the target's "
            "tokenizer"
        )
    if config.max_position_embeddings < max_model_len:
        raise ValueError(
            f"the draft model {speculative.draft_model!r} handles {config.max_position_embeddings}"
            f" positions, fewer than max_model_len={max_model_len}: lower max_model_len"
        )
    dtype, packed_max_tokens, int8_min_tokens = resolve_dtype(
        speculative.draft_dtype, target.device, config, path
    )
    return RunnerConfig(
        model=path,
        dtype=dtype,
        # The target's cache type where it applies (a float32 draft): the draft's cache has
        # the target's block count.
        kv_cache_dtype=target.kv_cache_dtype if DTYPES[dtype] == torch.float32 else "auto",
        packed_max_tokens=packed_max_tokens,
        packed_int8_min_tokens=int8_min_tokens,
        dense_max_tokens=dense_max_tokens(dtype, packed_max_tokens, target.device, config),
        device=target.device,
        block_size=target.block_size,
        attention_backend=target.attention_backend,
    )


def resolve_tokenizer_path(tokenizer: str | Path) -> Path:
    """A tokenizer folder (no config.json needed), a .gguf file, or "default"."""
    if str(tokenizer) == DEFAULT_MODEL:
        return resolve_model_path(tokenizer)
    path = Path(tokenizer).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"tokenizer path {str(path)!r} does not exist: pass a folder with tokenizer files "
            "(tokenizer.json / tokenizer_config.json) or a .gguf file"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"tokenizer {str(path)!r} is a file but not .gguf: pass its folder")
    return path


def _generation_config_path(source: str | Path, model_path: Path) -> Path | None:
    if str(source) == "auto":
        return model_path
    if str(source) == "vllm":
        return None
    path = Path(source).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"generation_config={str(source)!r} is neither 'auto', 'vllm' nor a folder: pass "
            "the folder holding generation_config.json"
        )
    return path


COMPILATION_LEVELS = (0, 1, 2, 3)  # vLLM's: 0 eager, 1-3 kinds of torch.compile


def compile_layers(compilation_config: int | dict[str, Any] | None, device: str) -> bool:
    """Whether vLLM's `compilation_config` (a level, or a dict with "level" or "mode") asks
    for torch.compile: any level above 0 compiles each layer's halves around attention
    (CausalLM.compile_layers) on CPU. None is eager here (vLLM's default compiles: a
    departure, for start-up time)."""
    level = compilation_config
    if isinstance(compilation_config, dict):
        unknown = sorted(set(compilation_config) - {"level", "mode"})
        if unknown:
            raise ValueError(
                f"compilation_config keys {unknown} are not supported: tandem reads only "
                '"level" (or "mode"), 0 for eager, 1-3 to torch.compile the layers'
            )
        level = compilation_config.get("level", compilation_config.get("mode", 0))
    if level is None:
        return False
    if isinstance(level, bool) or level not in COMPILATION_LEVELS:
        raise ValueError(
            f"compilation_config={compilation_config!r} is not supported: give a level in "
            f"{COMPILATION_LEVELS} (0 eager, 1-3 torch.compile of the layers), or "
            '{"level": n}'
        )
    if level and device.startswith("cuda"):
        logger.warning(
            "compilation_config level %s has no effect on CUDA yet: the layers run eagerly",
            level,
        )
        return False
    return level > 0


def _note_no_effect(
    device: str, gpu_memory_utilization: float | None, swap_space: float | None,
    enforce_eager: bool | None, profile_memory: bool,
) -> None:  # fmt: skip
    """Log the vLLM knobs that were given but change nothing here (after checking them)."""
    on_gpu = device.startswith("cuda")
    if gpu_memory_utilization is not None:
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        if not profile_memory:
            logger.warning(
                "gpu_memory_utilization=%s has no effect %s: the KV cache takes "
                "kv_cache_memory bytes (or num_kv_blocks)",
                gpu_memory_utilization,
                "when the KV cache size is given" if on_gpu else "on CPU",
            )
    if swap_space is not None:
        if swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {swap_space}")
        logger.warning(
            "swap_space=%s has no effect (as in vLLM v1): a preempted request frees its KV "
            "blocks and recomputes them",
            swap_space,
        )
    if enforce_eager is not None and not on_gpu:
        logger.warning(
            "enforce_eager=%s has no effect on CPU: tandem runs the model eagerly (CUDA graphs "
            "are for CUDA devices)",
            enforce_eager,
        )


def _check_scheduler_steps(num_scheduler_steps: int | None, async_scheduling: bool | None) -> bool:
    """Whether num_scheduler_steps asks for several forwards a step; raises where it cannot
    be."""
    if num_scheduler_steps is None:
        return False
    if isinstance(num_scheduler_steps, bool) or not isinstance(num_scheduler_steps, int):
        raise ValueError(f"num_scheduler_steps must be an int >= 1, got {num_scheduler_steps!r}")
    if num_scheduler_steps < 1:
        raise ValueError(f"num_scheduler_steps must be >= 1, got {num_scheduler_steps}")
    if num_scheduler_steps == 1:
        return False
    if async_scheduling:
        raise ValueError(
            "num_scheduler_steps > 1 runs its forwards inside the step, so it cannot be "
            "combined with async_scheduling: drop one of them"
        )
    return True
