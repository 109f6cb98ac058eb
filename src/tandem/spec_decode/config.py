"""vLLM's `speculative_config`: which proposer guesses tokens, and how many per step.

Keys read (vLLM's names and defaults): `method` ("ngram", or "draft_model", the method when a
`model` is given; vLLM's older spelling `model="ngram"` too), `model` (the draft: a path,
"default" or a .gguf, sharing the target's tokenizer), `num_speculative_tokens`,
`prompt_lookup_min` / `prompt_lookup_max` (n-gram; both 5 when neither is given, one copies the
other when one is), `disable_by_batch_size`. tandem's own: `adaptive` (default True) lets the
scheduler verify fewer drafts, or none, where the step-cost model says they would not pay
(False: all the proposer found), and `draft_dtype` (default "auto": on CPU the fastest format
here, packed 4-bit weights for small steps) for the draft model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
# vLLM keys that ask for nothing beyond what tandem does at their default value.
_NOOP_KEYS = {
    "draft_tensor_parallel_size": (None, 1),
    "disable_padded_drafter_batch": (None, False, True),
    "enforce_eager": (None, False, True),
}
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    # Speculation is off in a step with at least this many running requests (vLLM's knob).
    disable_by_batch_size: int | None = None
    adaptive: bool = True
    draft_model: str | None = None  # method "draft_model": the draft's path
    draft_dtype: str = "auto"

    @classmethod
    def parse(cls, config: dict[str, Any] | None) -> SpeculativeConfig | None:
        """From vLLM's dict (None: speculation off); ValueError naming the key to change."""
        if config is None:
            return None
        if not isinstance(config, dict):
            raise ValueError(
                f"speculative_config must be a dict such as "
                f'{{"method": "ngram", "num_speculative_tokens": 4}}, got {config!r}'
            )
        known = {
            "method", "model", "num_speculative_tokens", "prompt_lookup_min",
            "prompt_lookup_max", "disable_by_batch_size", "adaptive", "draft_dtype",
            *_NOOP_KEYS,
        }  # fmt: skip
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(
                f"speculative_config keys {unknown} are not supported; tandem reads "
                f"{', '.join(sorted(known))}"
            )
        for key, allowed in _NOOP_KEYS.items():
            if key in config and config[key] not in allowed:
                raise ValueError(f"speculative_config {key}={config[key]!r} is not supported")
        method = config.get("method")
        model = config.get("model")
        if model == "ngram" and method in (None, "ngram"):
            method, model = "ngram", None
        elif model is not None and method is None:
            method = "draft_model"
        if method not in METHODS:
            raise ValueError(
                f"speculative_config method={method!r} is not supported; choose one of "
                f"{', '.join(METHODS)}"
            )
        num_tokens = config.get("num_speculative_tokens")
        if not _is_int(num_tokens) or num_tokens < 1:
            raise ValueError(
                "speculative_config needs num_speculative_tokens, a positive int, got "
                f"{num_tokens!r}"
            )
        lookup_min = config.get("prompt_lookup_min")
        lookup_max = config.get("prompt_lookup_max")
        if lookup_min is None and lookup_max is None:
            lookup_min = lookup_max = DEFAULT_PROMPT_LOOKUP
        elif lookup_min is None:
            lookup_min = lookup_max
        elif lookup_max is None:
            lookup_max = lookup_min
        if not (_is_int(lookup_min) and _is_int(lookup_max) and 1 <= lookup_min <= lookup_max):
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max (ints), "
                f"got {lookup_min!r} and {lookup_max!r}"
            )
        disable_by = config.get("disable_by_batch_size")
        if disable_by is not None and (not _is_int(disable_by) or disable_by < 1):
            raise ValueError(
                "speculative_config disable_by_batch_size must be a positive int, got "
                f"{disable_by!r}"
            )
        adaptive = config.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be true or false, got {adaptive!r}")
        if method == "draft_model" and not (isinstance(model, str) and model):
            raise ValueError(
                'speculative_config method "draft_model" needs "model": the draft\'s path, '
                '"default" or a .gguf file'
            )
        if method == "ngram" and model is not None:
            raise ValueError(f"speculative_config method ngram takes no model, got {model!r}")
        draft_dtype = config.get("draft_dtype", "auto")
        if not isinstance(draft_dtype, str):
            raise ValueError(
                f"speculative_config draft_dtype must be a string, got {draft_dtype!r}"
            )
        return cls(
            method, num_tokens, lookup_min, lookup_max, disable_by, adaptive, model, draft_dtype
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
