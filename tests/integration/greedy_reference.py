"""What a served greedy request must say: the offline `LLM`'s output for the same prompt and
settings. Batching may differ between the two (the server batches whatever arrives together),
and fp32 rounding can flip an argmax where the top two logits nearly tie; so, as DESIGN.md's
invariant says, token ids are compared up to the first position whose top-2 gap in the offline
run is below TIE_GAP, and the text only when there is no such position."""

from __future__ import annotations

from typing import Any

from tandem.outputs import CompletionOutput
from tandem.sampling_params import SamplingParams

TIE_GAP = 1e-4


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    """Greedy settings with the top-2 logprobs that locate near-ties (logprobs do not change
    which token is picked)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, **kwargs)


def agreed_length(reference: CompletionOutput) -> int:
    """How many tokens of `reference` every batching must reproduce."""
    if reference.logprobs is None:
        return len(reference.token_ids)
    for position, row in enumerate(reference.logprobs):
        ranked = sorted(row.values(), key=lambda logprob: logprob.rank)
        if len(ranked) > 1 and ranked[0].logprob - ranked[1].logprob < TIE_GAP:
            return position
    return len(reference.token_ids)


def assert_same_greedy(
    token_ids: list[int] | None, text: str, reference: CompletionOutput, what: str = ""
) -> None:
    """A served greedy choice (its token ids, if the response had them, and its text) equals
    the offline output `reference`, up to a near-tie."""
    agreed = agreed_length(reference)
    if token_ids is None or agreed == len(reference.token_ids):
        assert text == reference.text, f"{what}: served {text!r}, offline {reference.text!r}"
    if token_ids is not None:
        assert token_ids[:agreed] == reference.token_ids[:agreed], (
            f"{what}: served {token_ids} ({text!r}), offline {reference.token_ids} "
            f"({reference.text!r}); they must agree on the first {agreed} tokens"
        )
        if agreed == len(reference.token_ids):
            assert token_ids == reference.token_ids, what


def equal_until_near_tie(
    token_ids: list[int], reference: CompletionOutput, near_tie: float, what: str = ""
) -> int:
    """Greedy tokens of a model run with different rounding (packed weights, a bf16 cache)
    equal the reference's until they part, and where they part the reference's own top two
    were within `near_tie` nats (its logprobs hold the top 2); returns how many agreed."""
    expected = reference.token_ids
    pairs = enumerate(zip(token_ids, expected, strict=True))
    diverged = next((i for i, (a, b) in pairs if a != b), None)
    if diverged is None:
        return len(expected)
    top = reference.logprobs[diverged]
    assert token_ids[diverged] in top, f"{what}: token {diverged} not the reference's top 2"
    margin = top[expected[diverged]].logprob - top[token_ids[diverged]].logprob
    assert margin <= near_tie, f"{what}: diverged at token {diverged}, reference margin {margin}"
    return diverged
