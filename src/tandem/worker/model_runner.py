"""The tensor side of a step: owns the model and the paged KV cache, turns scheduled requests
into one flattened batch, runs the forward and returns logits at the sampling positions (and,
for requests that ask, the logprobs of their prompt tokens in this step's chunk)."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tandem.attention.backends import BACKENDS, attention_function
from tandem.attention.block_tables import BlockTables
from tandem.attention.metadata import BatchInputs, RequestSlice, build_batch, forward_context
from tandem.cache import cache_root
from tandem.config import ModelConfig
from tandem.models.layers import Linear
from tandem.models.llama import CausalLM
from tandem.models.loader import load_model
from tandem.worker.cpu_decode import CpuDecode, unsupported_reason
from tandem.worker.gpu_memory import MemoryProfile, profile_requests
from tandem.worker.inference_mode import inference_mode
from tandem.worker.sampler import BurstDraws, LogprobsTensors, token_logprobs

if TYPE_CHECKING:
    from tandem.worker.cuda_graphs import DecodeGraphs

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

DEFAULT_KV_CACHE_MEMORY = 2 << 30  # bytes
# Prompt positions whose logits are alive at once: 256 x a 49k vocab in fp32 is 50 MB, where a
# whole 2k-token chunk would be 400 MB (twice that with its log_softmax).
PROMPT_LOGITS_ROWS = 256


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def keep_freed_memory_in_heap() -> None:
    """glibc returns large freed buffers to the OS and page-faults them back on the next step;
    a forward allocates several multi-MB activations per layer, so on CPU that cost up to 25%
    of a prefill. Keep them in the heap instead (what tcmalloc does for vLLM's CPU backend)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum
    libc.mallopt(m_trim_threshold, 1 << 30)


# The kv_cache_dtype values tandem stores: vLLM's "auto" (the model's dtype; under dtype="auto" on
# CPU a float32 model's cache is bfloat16: engine/config.py) and bfloat16, and float32 to keep a
# float32 model's cache exact there. fp8 is not built: no CPU kernel reads it, and the CUDA path
# has not been measured.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not supported; choose one of "
            f"{', '.join(KV_CACHE_DTYPES)} (a string; auto: the model's dtype, or bfloat16 "
            "for a float32 model under dtype auto on the cpu attention backend)"
        )


def parse_kv_cache_dtype(
    kv_cache_dtype: str, model_dtype: torch.dtype, attention_backend: str
) -> torch.dtype:
    """The cache's element type; refuses a cache no backend reads (one wider than the model,
    or a bf16 cache on the triton backend), or one that saves nothing (bfloat16 halves a
    float32 model's cache; a float16 model's would only lose precision)."""
    check_kv_cache_dtype(kv_cache_dtype)
    dtype = model_dtype if kv_cache_dtype == "auto" else DTYPES[kv_cache_dtype]
    if dtype == model_dtype:
        return dtype
    model = str(model_dtype).removeprefix("torch.")
    if dtype == torch.float32:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} with a {model} model: no attention backend "
            "reads a cache wider than the model; leave kv_cache_dtype 'auto'"
        )
    if model_dtype != torch.float32:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} with a {model} model saves no memory: a "
            "bfloat16 cache is for float32 models; leave kv_cache_dtype 'auto'"
        )
    if attention_backend == "triton":
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} with a {model} model: the triton attention "
            "backend reads a cache of the model's dtype; leave kv_cache_dtype 'auto' (CUDA "
            "runs bfloat16 models by default) or pick the torch backend"
        )
    return dtype


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (keys and values)."""
    element_size = torch.empty(0, dtype=dtype).element_size()
    per_layer = 2 * block_size * config.num_key_value_heads * config.head_dim * element_size
    return per_layer * config.num_hidden_layers


@dataclass(frozen=True)
class RunnerConfig:
    model: str | Path = "default"
    dtype: str | torch.dtype = "float32"
    # The cache's element type: "auto" (the model's; EngineConfig resolves dtype auto's own
    # choice before this), "bfloat16" (half an fp32 model's bytes; keys and values rounded as
    # they are stored, queries rounded to it in decode kernels) or "float32" (an fp32 model's).
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    # Steps of at most this many tokens multiply the GGUF's 4-bit weights packed (CPU; 0: never).
    packed_max_tokens: int = 0
    # Of those, steps of at least this many tokens quantize their activations to int8 (0: none).
    packed_int8_min_tokens: int = 0
    # Steps of at most this many tokens multiply fp32 weights in the C kernel (CPU; 0: never).
    dense_max_tokens: int = 0
    compile_layers: bool = False  # torch.compile each layer's halves around attention
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides the size computed from kv_cache_memory
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY  # bytes for the cache on CPU
    attention_backend: str = "torch"  # attention/backends.py: torch, cpu or triton
    # Decode-only steps of up to this many requests replay CUDA graphs (worker/cuda_graphs.py;
    # triton backend; off CUDA the same padded path runs eagerly). 0: every step eager.
    decode_graph_max_batch: int = 0
    max_model_len: int | None = None  # sizes the graphs' block tables and the profiling step
    # CUDA: the cache takes what this fraction of the device leaves after a profiling step of
    # profile_num_tokens tokens over up to profile_num_seqs requests (worker/gpu_memory.py);
    # None: kv_cache_memory bytes (or num_kv_blocks).
    gpu_memory_utilization: float | None = None
    profile_num_tokens: int = 0
    profile_num_seqs: int = 1

    @property
    def eager_max_tokens(self) -> int:
        """Steps of at most this many tokens multiply in the C kernels (packed weights or the
        dense kernel): compiling them measured no faster, and the C calls cannot be traced."""
        return max(self.packed_max_tokens, self.dense_max_tokens)

    def __post_init__(self) -> None:
        if self.gpu_memory_utilization is not None and not (
            0 < self.gpu_memory_utilization <= 1
            and self.profile_num_tokens >= 1
            and self.max_model_len is not None
        ):
            raise ValueError(
                "gpu_memory_utilization must be in (0, 1] and comes with profile_num_tokens "
                "and max_model_len"
            )
        if self.decode_graph_max_batch and (
            self.attention_backend != "triton" or self.max_model_len is None
        ):
            raise ValueError(
                "decode_graph_max_batch needs attention_backend='triton' and max_model_len"
            )
        if self.attention_backend not in BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory < 1:
            raise ValueError(
                f"kv_cache_memory must be a positive byte count, got {self.kv_cache_memory}"
            )


class ModelRunner:
    def __init__(self, config: RunnerConfig, model: CausalLM | None = None) -> None:
        """`model`: an already built model to serve (config.model is then not loaded)."""
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = parse_dtype(config.dtype)
        self.kv_cache_dtype = parse_kv_cache_dtype(
            config.kv_cache_dtype, self.dtype, config.attention_backend
        )
        self.block_size = config.block_size
        self.block_tables = BlockTables()  # every request's, kept between steps
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()
        # Set after the cache: the profiling step's forward runs before they exist.
        self.decode_graphs: DecodeGraphs | None = None
        self.cpu_decode: CpuDecode | None = None
        profile = None
        if config.gpu_memory_utilization is not None and config.num_kv_blocks is None:
            profile = MemoryProfile(self.device, config.gpu_memory_utilization)  # before loading
        self.model = model or load_model(
            config.model, self.dtype, self.device, config.packed_max_tokens,
            config.packed_int8_min_tokens,
        )  # fmt: skip
        self.model.use_dense_kernel(config.dense_max_tokens)  # off CPU the kernel declines
        if config.compile_layers:
            # Inductor's kernels are cached beside tandem's other caches: a second start reuses
            # them (it still re-traces the graphs).
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
            self.model.compile_layers(min_tokens=config.eager_max_tokens + 1)
        self.model_config: ModelConfig = self.model.config
        bytes_per_block = kv_cache_bytes_per_block(
            self.model_config, self.block_size, self.kv_cache_dtype
        )
        cache_bytes = config.kv_cache_memory
        if profile is not None:
            cache_bytes = self._profile(profile, bytes_per_block)
        self.num_kv_blocks = config.num_kv_blocks or max(1, cache_bytes // bytes_per_block)
        self.kv_caches = self._allocate_kv_cache()
        if config.decode_graph_max_batch:
            self.decode_graphs = self._decode_graphs()
        self.cpu_decode = self._cpu_decode()

    def _profile(self, profile: MemoryProfile, bytes_per_block: int) -> int:
        """Bytes for the cache: run the largest step over a cache just big enough for it."""
        config = self.config
        assert config.max_model_len is not None
        requests = profile_requests(config.profile_num_tokens, config.profile_num_seqs,
                                    config.max_model_len, self.block_size)  # fmt: skip
        self.num_kv_blocks = sum(len(r.block_ids) for r in requests)
        self.kv_caches = self._allocate_kv_cache()

        def step() -> None:
            torch.softmax(self.execute(requests), dim=-1)  # and the sampler's copy of the logits

        cache_bytes = profile.kv_cache_bytes(step, self.num_kv_blocks * bytes_per_block)
        self.kv_caches = []
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.empty(0)
        torch.cuda.empty_cache()
        return cache_bytes

    def _decode_graphs(self) -> DecodeGraphs:
        from tandem.worker.cuda_graphs import DecodeGraphs  # imports triton: only when asked

        cfg = self.model_config
        assert self.config.max_model_len is not None
        graphs = DecodeGraphs(
            self.model, self.config.decode_graph_max_batch,
            -(-self.config.max_model_len // self.block_size), self.block_size,
            cfg.num_attention_heads // cfg.num_key_value_heads, cfg.num_key_value_heads,
            self.device,
        )  # fmt: skip
        if self.device.type == "cuda":
            graphs.capture()
        return graphs

    def _cpu_decode(self) -> CpuDecode | None:
        """Decode steps' layers in one C call, where the weights are packed for it."""
        if self.device.type != "cpu" or self.config.packed_max_tokens <= 0:
            return None
        reason = unsupported_reason(self.model)
        if reason is not None:
            logger.info("decode steps run layer by layer: %s", reason)
            return None
        return CpuDecode(
            self.model, self.config.packed_max_tokens, self.config.packed_int8_min_tokens
        )

    def packed_weights(self) -> tuple[int, int, int]:
        """(weights kept packed, their packed bytes, the largest step that uses them), for the
        roofline's byte count."""
        packed = [
            (module.weight.numel(), module.packed.nbytes)
            for module in self.model.modules()
            if isinstance(module, Linear) and module.packed is not None
        ]
        if self.model.lm_head_packed is not None:
            packed.append((self.model.lm_head_weight.numel(), self.model.lm_head_packed.nbytes))
        if not packed:
            return 0, 0, 0
        return (
            sum(weights for weights, _ in packed),
            sum(nbytes for _, nbytes in packed),
            self.config.packed_max_tokens,
        )

    def _allocate_kv_cache(self) -> list[torch.Tensor]:
        cfg = self.model_config
        shape = (2, self.num_kv_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        caches = []
        attend = attention_function(
            self.config.attention_backend, self.kv_cache_dtype, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim,
        )  # fmt: skip
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
            layer.paged_attention = attend
            caches.append(layer.kv_cache)
        return caches

    def execute(
        self, requests: Sequence[RequestSlice], sample_mask: Sequence[bool] | None = None
    ) -> torch.Tensor:
        """Run one step; returns float32 logits `[num_sampled, vocab]`, one row per request
        whose `sample_mask` entry is true (all by default), in request order."""
        return self.run(requests, sample_mask).logits

    def run(
        self,
        requests: Sequence[RequestSlice],
        sample_mask: Sequence[bool] | None = None,
        prompt_logits_ranges: Sequence[tuple[int, int]] | None = None,
        num_prompt_top: int = 0,
        draft_token_ids: Sequence[Sequence[int]] | None = None,
        argmax: bool = False,
    ) -> RunnerOutput:
        """Run one step: logits as `execute` returns them (a request verifying
        `draft_token_ids` has a row at its last known token and at each draft), and, when
        `prompt_logits_ranges` is given (per request, the positions [start, end) of its new
        tokens to score: see build_batch), the logprob of the token after each such position
        with its rank and the `num_prompt_top` most likely tokens there, row by row in request
        order. `argmax`: every row is sampled greedily: see `forward`."""
        batch = self.prepare(requests, sample_mask, prompt_logits_ranges, draft_token_ids)
        return self.forward(batch, num_prompt_top, argmax=argmax)

    def prepare(
        self,
        requests: Sequence[RequestSlice],
        sample_mask: Sequence[bool] | None = None,
        prompt_logits_ranges: Sequence[tuple[int, int]] | None = None,
        draft_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> BatchInputs:
        """The host half of a step: the flattened batch, its inputs copied to the device."""
        return build_batch(
            requests, self.block_size, self.device, sample_mask, prompt_logits_ranges,
            draft_token_ids, self.block_tables,
        )  # fmt: skip

    @inference_mode
    def forward(
        self,
        batch: BatchInputs,
        num_prompt_top: int = 0,
        placeholder_token_ids: torch.Tensor | None = None,
        argmax: bool = False,
    ) -> RunnerOutput:
        """The device half of a step. `placeholder_token_ids`: the ids of the batch's
        placeholder tokens, sampled by the step before, already on the device. `argmax`: the
        caller takes each row's argmax, so the LM head may find it as it writes the logits
        (RunnerOutput.argmax; a batch-1 step on packed weights; in the CPU's fused decode step
        its logits and argmax are buffers the next such step overwrites)."""
        if batch.placeholder_indices is not None:
            if placeholder_token_ids is None:
                raise ValueError("the batch has placeholder tokens and no ids to fill them in")
            batch.input_ids[batch.placeholder_indices] = placeholder_token_ids
        rows = batch.logits_indices
        prompt = batch.prompt_logits
        fused = self._fused_decode(batch)
        if fused is not None and argmax and prompt is None and rows.shape[0] == 1:
            both = fused.logits_and_argmax(batch)
            if both is not None:  # the layers and the head's argmax pass in one C call
                return RunnerOutput(both[0], argmax=both[1])
        hidden = self._hidden_states(batch, fused)
        # The rows ascend, so as many rows as tokens is every token in order (a decode step):
        # no gather. (shape[0], not len(): a tensor's __len__ is Python, ~3 µs a step here.)
        every_row = rows.shape[0] == hidden.shape[0]
        if argmax and every_row and prompt is None:
            logits, tokens = self.model.compute_logits_and_argmax(hidden)
            return RunnerOutput(logits, argmax=tokens)
        logits = self.model.compute_logits(hidden if every_row else hidden[rows])
        if prompt is None:
            return RunnerOutput(logits)
        parts = [
            token_logprobs(
                self.model.compute_logits(hidden[prompt.indices[start:end]]),
                prompt.target_ids[start:end],
                num_prompt_top,
            )
            for start, end in _slices(len(prompt.indices), PROMPT_LOGITS_ROWS)
        ]
        return RunnerOutput(logits, LogprobsTensors.cat(parts) if parts else None)

    @property
    def max_burst_rows(self) -> int:
        """The most requests decode_steps takes at once (0: it does not run here): the CPU's
        fused decode step with a packed LM head, as many rows as both take packed."""
        return 0 if self.cpu_decode is None else self.cpu_decode.max_burst_rows

    def decode_steps(
        self,
        requests: Sequence[RequestSlice],
        num_steps: int,
        stop_token_ids: Sequence[frozenset[int]],
        draws: BurstDraws | None = None,
    ) -> list[list[int]]:
        """Multi-step scheduling's forwards: the next tokens of decoding requests (one new
        token each, at most max_burst_rows), from up to `num_steps` steps one after another
        (each row fed its argmax of the step before, or with `draws` the sampler's draw) in
        one C call, ending after the step where a request's token is among its
        `stop_token_ids`. Their blocks must hold all the positions fed."""
        batch = self.prepare(requests)
        fused = self._fused_decode(batch)
        if fused is None or not 0 < len(requests) <= fused.max_burst_rows:
            raise ValueError(
                "decode_steps takes decodes on the CPU's fused decode path, at most "
                f"max_burst_rows={self.max_burst_rows} of them"
            )
        num_blocks = [len(request.block_ids) for request in requests]
        return fused.decode_steps(batch, num_blocks, num_steps, stop_token_ids, draws)

    def hidden_states(self, batch: BatchInputs) -> torch.Tensor:
        """The final hidden state of every token of the batch: a captured CUDA graph, the
        fused CPU decode step, or the model layer by layer."""
        return self._hidden_states(batch, self._fused_decode(batch))

    def _hidden_states(self, batch: BatchInputs, fused: CpuDecode | None) -> torch.Tensor:
        if fused is not None:
            return fused.run(batch)
        if self.decode_graphs is not None and self.decode_graphs.fits(batch):
            return self.decode_graphs.run(batch)
        with forward_context(batch.attn_metadata):
            return self.model(batch.input_ids, batch.positions)

    def _fused_decode(self, batch: BatchInputs) -> CpuDecode | None:
        """The CPU's fused decode step where it takes the batch (a decode graph that fits it
        comes first)."""
        if self.cpu_decode is None or not self.cpu_decode.fits(batch):
            return None
        if self.decode_graphs is not None and self.decode_graphs.fits(batch):
            return None
        return self.cpu_decode

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of `tensor`, queued on the device's stream (pinned, not waited for: read
        it after completion_event); the tensor itself on CPU."""
        if tensor.device.type != "cuda":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    def completion_event(self) -> torch.cuda.Event | None:
        """An event that completes with the work queued on the device so far; None on CPU,
        where that work is done when the calls return."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event


@dataclass
class RunnerOutput:
    logits: torch.Tensor  # [num_sampled, vocab] float32
    # Prompt logprobs of this step's chunks, when asked and any position was scored.
    prompt_logprobs: LogprobsTensors | None = None
    # Each row's first argmax, where the forward was asked for it and the LM head found it.
    argmax: torch.Tensor | None = None


def _slices(length: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, length)) for start in range(0, length, size)]
