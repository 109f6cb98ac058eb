"""`LLM`: the offline API, shaped like vLLM's so its users switch by changing the import. Every
argument of vLLM's constructor is either honoured, accepted where it means nothing here (and
logged), or refused with a reason: docs/coming-from-vllm.md has the whole list."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from tandem.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from tandem.engine.config import DEFAULT_MAX_LOGPROBS, EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.gc_policy import step_loop_gc
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.log_stats import LoggingStatLogger
from tandem.engine.tokenizer import load_tokenizer
from tandem.engine.vllm_args import check_vllm_only_args
from tandem.inputs import PromptType, check_prompt_keys, tool_call_arguments
from tandem.metrics_reader import Metric, snapshot
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Conversation = list[dict[str, Any]]
CHAT_CONTENT_FORMATS = ("auto", "string", "openai")
# apply_chat_template arguments chat() sets itself; chat_template_kwargs may not carry them.
_RESERVED_TEMPLATE_KWARGS = ("conversation", "tokenize", "chat_template", "return_dict")


class LLM:
    """Generate from prompts with one engine in this process (vLLM's offline `LLM`)."""

    def __init__(
        self,
        model: str | Path = "default",
        *,
        tokenizer: str | Path | None = None,
        skip_tokenizer_init: bool = False,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        dtype: str | torch.dtype = "auto",
        kv_cache_dtype: str = "auto",
        seed: int | None = 0,
        gpu_memory_utilization: float | None = None,
        swap_space: float | None = None,
        enforce_eager: bool | None = None,
        compilation_config: int | dict | None = None,
        kv_cache_memory_bytes: int | None = None,
        chat_template: str | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 256,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        logprobs_mode: str = "raw_logprobs",
        disable_log_stats: bool = True,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        prefix_caching_hash_algo: str = "xxhash",
        scheduling_policy: str = "fcfs",
        batching_policy: str = "decode-first",
        generation_config: str | Path = "auto",
        override_generation_config: dict[str, Any] | None = None,
        block_size: int = 16,
        max_num_partial_prefills: int = 1,
        long_prefill_token_threshold: int = 0,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        device: str | None = None,
        step_log: str | Path | None = None,
        peak_tflops: float | None = None,
        peak_bandwidth_gbps: float | None = None,
        target_itl_ms: float | None = None,
        speculative_config: dict[str, Any] | None = None,
        async_scheduling: bool | None = None,
        attention_backend: str | None = "auto",
        num_scheduler_steps: int | None = None,
        adapt_cpu_threads: bool = True,
        **vllm_kwargs: Any,
    ) -> None:
        """vLLM's arguments with vLLM's defaults, except: `batching_policy` (tandem's
        decode-first / prefill-first), `kv_cache_memory` / `num_kv_blocks` (the KV cache size;
        `kv_cache_memory_bytes` is vLLM's name for the first), `device`, the step telemetry's
        `step_log` (a JSON line per step), `peak_tflops` / `peak_bandwidth_gbps`, and
        `target_itl_ms` (decode-first sized to a step-time target); async_scheduling defaults to
        None (on for CUDA, off on CPU); num_scheduler_steps (vLLM v0's multi-step scheduling)
        defaults to None (EngineConfig.create: several where a CPU's decode steps run fused);
        `adapt_cpu_threads` (fewer forward threads while other processes hold cores);
        and gpu_memory_utilization, swap_space, enforce_eager default to None ("not given")."""
        check_vllm_only_args(vllm_kwargs)
        self.config = EngineConfig.create(
            model,
            tokenizer=tokenizer,
            skip_tokenizer_init=skip_tokenizer_init,
            trust_remote_code=trust_remote_code,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            device=device,
            seed=seed,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_logprobs=max_logprobs,
            logprobs_mode=logprobs_mode,
            disable_log_stats=disable_log_stats,
            enable_chunked_prefill=enable_chunked_prefill,
            enable_prefix_caching=enable_prefix_caching,
            prefix_caching_hash_algo=prefix_caching_hash_algo,
            scheduling_policy=scheduling_policy,
            batching_policy=batching_policy,
            max_num_partial_prefills=max_num_partial_prefills,
            long_prefill_token_threshold=long_prefill_token_threshold,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory if kv_cache_memory_bytes is None
            else kv_cache_memory_bytes,
            generation_config=generation_config,
            override_generation_config=override_generation_config,
            gpu_memory_utilization=gpu_memory_utilization,
            swap_space=swap_space,
            enforce_eager=enforce_eager,
            compilation_config=compilation_config,
            step_log=step_log,
            peak_tflops=peak_tflops,
            peak_bandwidth_gbps=peak_bandwidth_gbps,
            target_itl_ms=target_itl_ms,
            speculative_config=speculative_config,
            async_scheduling=async_scheduling,
            attention_backend=attention_backend,
            num_scheduler_steps=num_scheduler_steps,
            adapt_cpu_threads=adapt_cpu_threads,
        )  # fmt: skip
        self.chat_template = chat_template
        self.tokenizer = (
            None if skip_tokenizer_init else load_tokenizer(self.config.tokenizer_source)
        )
        self._metrics_logger = None if disable_log_stats else _prometheus_logger(str(model))
        stat_loggers = [] if disable_log_stats else [LoggingStatLogger()]
        if self._metrics_logger is not None:
            stat_loggers.append(self._metrics_logger)
        core = EngineCore(self.config)
        eos, extra_eos = self.config.eos_token_ids(
            self.tokenizer.eos_token_id if self.tokenizer is not None else None
        )
        self.llm_engine = LLMEngine(core, self.tokenizer, eos, extra_eos, stat_loggers)
        self.default_sampling_params = self.config.sampling_defaults()
        self.request_counter = itertools.count()

    @property
    def engine(self) -> LLMEngine:
        """tandem's older name for llm_engine."""
        return self.llm_engine

    @property
    def step_stats(self):
        return self.llm_engine.core.step_stats

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate(sampling_params=None) uses: the model's generation_config.json sampling
        fields (generation_config="auto") over vLLM's defaults, as in vLLM."""
        if self.default_sampling_params:
            return SamplingParams.from_optional(**self.default_sampling_params)
        return SamplingParams()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while requests hold blocks."""
        return self.llm_engine.core.kv_cache_manager.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics now, in vLLM's shapes (tandem.metrics_reader: Counter, Gauge,
        Histogram): the same `tandem:` metrics the server exposes, counted since start. As in
        vLLM, it needs LLM(..., disable_log_stats=False)."""
        if self._metrics_logger is None:
            raise ValueError(
                "get_metrics() needs the engine's stats: create the LLM with "
                "disable_log_stats=False (as vLLM requires)"
                + ("" if self.config.disable_log_stats else " and install tandem[serve]")
            )
        return snapshot(self._metrics_logger.registry)

    # -- generation ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt: a string, {"prompt": text} (TextPrompt) or
        {"prompt_token_ids": [...]} (TokensPrompt), each optionally with a "cache_salt".
        Outputs come back in prompt order. Every prompt is checked before any runs; a bad one
        is a ValueError that says what to change, and leaves nothing in the engine.
        `priority` (one int per prompt, lower first) needs scheduling_policy="priority"."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if lora_request is not None:
            raise ValueError("lora_request is not supported: LoRA adapters are not built yet")
        priorities = self._priorities(priority, len(prompts))
        params_list = self._params_list(sampling_params, len(prompts))
        params_list = [self.config.request_params(p) for p in params_list]
        encoded = [
            self._encode(i, prompt, params, tokenization_kwargs)
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True))
        ]
        request_ids = []
        try:
            for prompt, (text, token_ids), params, prio in zip(
                prompts, encoded, params_list, priorities, strict=True
            ):
                request_id = str(next(self.request_counter))
                salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                self.llm_engine.add_request(
                    request_id, token_ids, params, prompt=text, cache_salt=salt, priority=prio
                )
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        except BaseException:  # a refused request, or an interrupt: leave nothing behind
            self.llm_engine.abort_request(request_ids)
            raise

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation, then generate (vLLM's chat).
        continue_final_message=True continues the last (assistant) message instead of opening
        a new one; chat_template_kwargs reach the template (e.g. enable_thinking)."""
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer: do not pass skip_tokenizer_init=True")
        if lora_request is not None or mm_processor_kwargs is not None:
            raise ValueError("lora_request and mm_processor_kwargs are not supported by tandem")
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message=True continues the last message, so it cannot open a new "
                "one: pass add_generation_prompt=False with it"
            )
        if chat_template_content_format not in CHAT_CONTENT_FORMATS:
            raise ValueError(
                f"chat_template_content_format must be one of {CHAT_CONTENT_FORMATS}, "
                f"got {chat_template_content_format!r}"
            )
        extra = dict(chat_template_kwargs or {})
        reserved = sorted(set(extra) & set(_RESERVED_TEMPLATE_KWARGS))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved}: chat() sets them")
        extra.update(add_generation_prompt=add_generation_prompt,
                     continue_final_message=continue_final_message)  # fmt: skip
        if tools is not None:
            extra["tools"] = tools
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                [_render_content(m, chat_template_content_format) for m in conversation],
                tokenize=False,
                chat_template=chat_template or self.chat_template,
                **extra,
            )
            kwargs = {"add_special_tokens": False, **(tokenization_kwargs or {})}
            token_prompts.append({"prompt": text, "prompt_token_ids": self._tokenize(text, kwargs)})
        return self.generate(token_prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's offline beam search (tandem.beam_search): one BeamSearchOutput per prompt,
        its sequences best first, each with tokens (prompt included), text and cum_logprob."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported: LoRA adapters are not built yet")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        probe = SamplingParams(max_tokens=params.max_tokens)
        token_lists = [self._encode(i, p, probe, None)[1] for i, p in enumerate(prompts)]
        return run_beam_search(self, token_lists, params, use_tqdm, concurrency_limit)

    # -- input checks ---------------------------------------------------------------------------

    def _priorities(self, priority: Sequence[int] | None, count: int) -> list[int]:
        if priority is None:
            return [0] * count
        priorities = list(priority)
        if len(priorities) != count:
            raise ValueError(
                f"got {len(priorities)} priorities for {count} prompts: give one per prompt"
            )
        for value in priorities:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"priority must be a list of ints, got {value!r}")
        if any(priorities) and self.config.scheduler.scheduling_policy != "priority":
            raise ValueError(
                "priority is set but priority scheduling is off: create the LLM with "
                "scheduling_policy='priority' (vLLM's rule too)"
            )
        return priorities

    def _params_list(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(
                f"got {len(sampling_params)} SamplingParams for {count} prompts: give one, "
                "or one per prompt"
            )
        return list(sampling_params)

    def _tokenize(self, text: str, kwargs: dict[str, Any] | None = None) -> list[int]:
        return list(self.tokenizer(text, **(kwargs or {})).input_ids)

    def _encode(
        self,
        index: int,
        prompt: PromptType,
        params: SamplingParams,
        tokenization_kwargs: dict[str, Any] | None,
    ) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt, truncated as params.truncate_prompt_tokens says and
        checked: not empty, ids in the vocabulary, no longer than max_model_len."""
        text, token_ids = self._prompt_tokens(prompt, tokenization_kwargs)
        max_model_len = self.llm_engine.max_model_len
        token_ids = params.truncate_prompt(token_ids, max_model_len)
        where = f"prompt {index}"
        if not token_ids:
            raise ValueError(f"{where} is empty: give at least one token")
        vocab_size = self.config.model_config.vocab_size
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < vocab_size]  # fmt: skip
        if bad:
            raise ValueError(
                f"{where}: token id {bad[0]!r} is outside the vocabulary: prompt_token_ids must "
                f"be ints in [0, {vocab_size})"
            )
        if len(token_ids) > max_model_len:
            raise ValueError(
                f"{where} is {len(token_ids)} tokens long, more than max_model_len="
                f"{max_model_len}: shorten it (or set truncate_prompt_tokens), or raise "
                "max_model_len"
                + ("" if max_model_len == self.config.scheduler.max_model_len
                   else " or the KV cache (kv_cache_memory / num_kv_blocks)")
            )  # fmt: skip
        return text, token_ids

    def _prompt_tokens(
        self, prompt: PromptType, tokenization_kwargs: dict[str, Any] | None
    ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            check_prompt_keys(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            token_ids = prompt["prompt_token_ids"]
            if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
                raise ValueError(f"prompt_token_ids must be a list of ints, got {token_ids!r}")
            return prompt.get("prompt"), list(token_ids)
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise ValueError(
                "a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
                f"got {type(prompt).__name__}"
            )
        if self.tokenizer is None:
            raise ValueError(
                "text prompts need a tokenizer: give {'prompt_token_ids': [...]} when "
                "skip_tokenizer_init=True"
            )
        return text, self._tokenize(text, tokenization_kwargs)

    # -- the loop -------------------------------------------------------------------------------

    def _run(
        self, request_ids: list[str], use_tqdm: bool | Callable[..., tqdm]
    ) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        show = bool(use_tqdm)
        bar = make_bar(total=len(request_ids), desc="Processed prompts", disable=not show)
        start = time.perf_counter()
        core = self.llm_engine.core
        prefill_before, decode_before = core.num_prefill_tokens, core.num_decode_tokens
        num_steps = core.num_steps
        try:
            # Inference mode for the whole loop: the per-step functions need not enter it each
            # step (worker/inference_mode.py).
            with step_loop_gc(), torch.inference_mode(), core.forward_thread_count():
                while self.llm_engine.has_unfinished_requests():
                    for output in self.llm_engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
                    if show and core.num_steps != num_steps:
                        num_steps = core.num_steps
                        prefill_tokens = core.num_prefill_tokens - prefill_before
                        decode_tokens = core.num_decode_tokens - decode_before
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(
                            f"prefill {prefill_tokens / elapsed:.0f} tok/s, "
                            f"decode {decode_tokens / elapsed:.0f} tok/s"
                        )
        except BaseException:
            with contextlib.suppress(Exception):  # the telemetry of the steps before it
                core.finish_stats()
            raise
        bar.close()
        return [finished[request_id] for request_id in request_ids]


def _render_content(message: dict[str, Any], content_format: str) -> dict[str, Any]:
    """A message as the template gets it: a list of text parts is joined into one string for
    templates that expect strings ("auto", "string"); "openai" keeps the parts. Its tool
    calls' JSON arguments become objects, as vLLM passes them."""
    calls = message.get("tool_calls")
    if calls:
        message = {**message, "tool_calls": [_with_object_arguments(call) for call in calls]}
    content = message.get("content")
    if not isinstance(content, list):
        return message
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise ValueError(f"only text content parts are supported ({_describe(part)} given)")
    if content_format == "openai":
        return message
    return {**message, "content": "\n".join(part["text"] for part in content)}


def _with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call  # arguments already an object, or a shape the template alone knows
    arguments = tool_call_arguments(function["arguments"])
    return {**call, "function": {**function, "arguments": arguments}}


def _describe(part: Any) -> str:
    return f"type {part.get('type')!r}" if isinstance(part, dict) else repr(part)


def _prometheus_logger(model_name: str):
    """The server's Prometheus metrics, kept in a private registry for get_metrics()."""
    try:
        from prometheus_client import CollectorRegistry

        from tandem.server.metrics import PrometheusStatLogger
    except ImportError:
        logger.warning("get_metrics() needs prometheus_client: pip install 'tandem[serve]'")
        return None
    return PrometheusStatLogger(model_name, registry=CollectorRegistry())
