"""One engine configuration, built once from the user's arguments: the offline `LLM`, the CLI and
the server all turn their knobs into an `EngineConfig`, which resolves the model path and reads
the model's config a single time. It is plain data, so it crosses into the engine-core process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.config import ModelConfig
from tandem.core.scheduler import SchedulerConfig
from tandem.models.loader import load_model_config, resolve_model_path
from tandem.worker.model_runner import DEFAULT_KV_CACHE_MEMORY, RunnerConfig, parse_dtype

PREFIX_CACHING_HASH_ALGOS = ("xxhash", "sha256")


@dataclass(frozen=True)
class EngineConfig:
    model_path: Path
    model_config: ModelConfig
    runner: RunnerConfig
    scheduler: SchedulerConfig
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "xxhash"
    skip_tokenizer_init: bool = False

    @classmethod
    def create(
        cls,
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
    ) -> EngineConfig:
        """Validate every knob before anything heavy loads; raises ValueError/FileNotFoundError
        naming what to change."""
        if prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ValueError(
                f"prefix_caching_hash_algo must be one of {', '.join(PREFIX_CACHING_HASH_ALGOS)}, "
                f"got {prefix_caching_hash_algo!r}"
            )
        parse_dtype(dtype)
        model_path = resolve_model_path(model)
        model_config = load_model_config(model_path)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if max_model_len is not None and max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} is larger than the model's "
                f"max_position_embeddings={model_config.max_position_embeddings}: lower it"
            )
        runner = RunnerConfig(
            model=model_path,
            dtype=dtype,
            device=device,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory,
        )
        scheduler = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len or model_config.max_position_embeddings,
            max_num_partial_prefills=max_num_partial_prefills,
            long_prefill_token_threshold=long_prefill_token_threshold,
            batching_policy=batching_policy,
        )
        return cls(
            model_path=model_path,
            model_config=model_config,
            runner=runner,
            scheduler=scheduler,
            enable_prefix_caching=enable_prefix_caching,
            prefix_caching_hash_algo=prefix_caching_hash_algo,
            skip_tokenizer_init=skip_tokenizer_init,
        )

    def eos_token_ids(self, tokenizer_eos: int | None) -> tuple[int | None, tuple[int, ...]]:
        """The EOS id requests stop at, and the model's other EOS ids (become stop tokens)."""
        eos = tokenizer_eos
        if eos is None and self.model_config.eos_token_ids:
            eos = self.model_config.eos_token_ids[0]
        extra = tuple(t for t in self.model_config.eos_token_ids if t != eos)
        return eos, extra
