"""How to pick tokens and when to stop: the per-request knobs, named and bounded as in vLLM."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Below this temperature the logits / temperature division overflows float32 for ordinary logits,
# and the distribution is a one-hot anyway, so it is sampled as argmax (vLLM uses the same cut).
GREEDY_TEMPERATURE = 1e-5


def _check_int(name: str, value: object, minimum: int, allowed: str) -> None:
    """bool is an int subclass; `max_tokens=True` is a bug in the caller, not the value 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_float(
    name: str, value: object, low: float, high: float, allowed: str, low_open: bool = False
) -> None:
    """Also rejects NaN and infinities, which slip past range comparisons or poison the logits."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not low <= value <= high
        or (low_open and value == low)
    ):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class SamplingParams:
    """Per-request sampling settings; invalid values are rejected when the object is built, so a
    bad request fails at the API boundary instead of inside a running batch."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list
    ignore_eos: bool = False
    logprobs: int | None = None
    # Logprobs of the prompt tokens (each with its rank) plus the top-N at every prompt position
    # (RequestOutput.prompt_logprobs). Such a request computes its whole prompt: no prefix-cache
    # hits, as in vLLM.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, 1, ">= 1")
        _check_float("temperature", self.temperature, 0.0, math.inf, ">= 0 (finite)")
        _check_float("top_p", self.top_p, 0.0, 1.0, "in (0, 1]", low_open=True)
        _check_int("top_k", self.top_k, -1, ">= -1 (0 or -1 disables it)")
        _check_float("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), "an int or None")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, ">= 1 or None")
        _check_int("min_tokens", self.min_tokens, 0, ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}"
            )
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(
                f"stop must be a non-empty string or a list of them, got {self.stop!r}"
            )
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, "a list of token ids >= 0")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, ">= 0 or None")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, ">= 0 or None")
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_float(
            "repetition_penalty",
            self.repetition_penalty,
            0.0,
            math.inf,
            "> 0 (finite)",
            low_open=True,
        )

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: no randomness, so the seed and top_p/min_p do not matter."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
