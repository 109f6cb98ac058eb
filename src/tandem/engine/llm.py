"""`LLM`: the offline API, shaped like vLLM's so its users already know it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from tandem.engine.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.tokenizer import load_tokenizer
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.worker.model_runner import DEFAULT_KV_CACHE_MEMORY

PromptType = str | dict[str, Any]
Conversation = list[dict[str, str]]


class LLM:
    def __init__(
        self,
        model: str | Path = "default",
        *,
        dtype: str = "float32",
        device: str | None = None,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        prefix_caching_hash_algo: str = "xxhash",
        batching_policy: str = "decode-first",
        max_num_partial_prefills: int = 1,
        long_prefill_token_threshold: int = 0,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY,
        skip_tokenizer_init: bool = False,
    ) -> None:
        self.config = EngineConfig.create(
            model,
            dtype=dtype,
            device=device,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            prefix_caching_hash_algo=prefix_caching_hash_algo,
            batching_policy=batching_policy,
            max_num_partial_prefills=max_num_partial_prefills,
            long_prefill_token_threshold=long_prefill_token_threshold,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory,
            skip_tokenizer_init=skip_tokenizer_init,
        )
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(self.config.model_path)
        core = EngineCore(self.config)
        eos, extra_eos = self.config.eos_token_ids(
            self.tokenizer.eos_token_id if self.tokenizer is not None else None
        )
        self.engine = LLMEngine(core, self.tokenizer, eos, extra_eos)
        self._next_request_id = 0

    @property
    def step_stats(self):
        return self.engine.core.step_stats

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while requests hold blocks."""
        return self.engine.core.kv_cache_manager.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or {"prompt_token_ids": [...]} / {"prompt": text},
        optionally with a "cache_salt"); outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = self._params_list(sampling_params, len(prompts))
        encoded = [self._encode(prompt) for prompt in prompts]  # validate all before queueing
        request_ids = []
        try:
            for prompt, (text, token_ids), params in zip(
                prompts, encoded, params_list, strict=True
            ):
                request_id = str(self._next_request_id)
                self._next_request_id += 1
                salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                self.engine.add_request(request_id, token_ids, params, prompt=text, cache_salt=salt)
                request_ids.append(request_id)
        except ValueError:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer: do not pass skip_tokenizer_init=True")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            for conversation in conversations
        ]
        token_prompts = [
            {"prompt": text, "prompt_token_ids": self._tokenize(text, add_special_tokens=False)}
            for text in prompts
        ]
        return self.generate(token_prompts, sampling_params, use_tqdm)

    def _params_list(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(
                f"got {len(sampling_params)} SamplingParams for {count} prompts: give one, "
                "or one per prompt"
            )
        return list(sampling_params)

    def _tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "text prompts need a tokenizer: give {'prompt_token_ids': [...]} when "
                    "skip_tokenizer_init=True"
                )
            return prompt, self._tokenize(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            token_ids = list(prompt["prompt_token_ids"])
            vocab_size = self.engine.core.runner.model_config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab_size for t in token_ids):
                raise ValueError(f"prompt_token_ids must be ints in [0, {vocab_size})")
            return prompt.get("prompt"), token_ids
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._encode(prompt["prompt"])
        raise ValueError(
            "a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
            f"got {type(prompt).__name__}"
        )

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        start = time.perf_counter()
        prefill_tokens = decode_tokens = 0
        last_stats = self.step_stats[-1] if self.step_stats else None
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
            stats = self.step_stats[-1] if self.step_stats else None
            if use_tqdm and stats is not last_stats:
                last_stats = stats
                prefill_tokens += stats.num_prefill_tokens
                decode_tokens += stats.num_decode_tokens
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(
                    f"prefill {prefill_tokens / elapsed:.0f} tok/s, "
                    f"decode {decode_tokens / elapsed:.0f} tok/s"
                )
        bar.close()
        return [finished[request_id] for request_id in request_ids]
