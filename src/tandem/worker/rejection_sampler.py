"""Verification of draft tokens: keep what the target model would have produced.

A request verifying k drafts has k + 1 rows of logits: at its last known token and at each
draft. Row j is processed as if the drafts before it were already output (penalties, bad words
and min_tokens see them), so each row is the distribution the target would sample from there.
- Greedy rows: a draft is accepted while it equals the row's argmax; the first row that
  disagrees (or the last row, when all agree) gives its argmax. Tokens equal non-speculative
  greedy decoding's.
- Random rows (speculative sampling, Leviathan et al. 2023, with a proposer that puts all its
  mass q on its guess): a draft d is accepted with probability min(1, p(d) / q(d)) = p(d); at
  the first rejection a token is drawn from norm(max(0, p - q)), p without d; when all are
  accepted a bonus token is drawn from the last row. Done here in the equivalent form: row j
  draws a token x from p_j exactly as the plain sampler would (one uniform, inverse CDF over
  the vocabulary); the draft is accepted iff x equals it (probability p(d)), and otherwise x
  is the emitted token (distributed as p without d). Each emitted token follows the target's
  distribution exactly, and a seeded request spends one uniform of its generator per emitted
  token, as without speculation: its generator is rewound past the rows it did not reach, so
  its text does not depend on how many drafts it verified, nor on its batch mates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.outputs import Logprob
from tandem.sampling_params import SamplingParams
from tandem.worker.logits_processors import process_logits
from tandem.worker.sampler import (
    SamplingInputs,
    _draws,
    _inverse_cdf_draw,
    _logprobs,
    filter_logits,
)


@dataclass
class VerifyOutput:
    """Per request, in batch order: the tokens to append (accepted drafts, then one token the
    target chose), and their logprob dicts where the request asked."""

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, Logprob]] | None] | None


def verify(
    logits: torch.Tensor, inputs: SamplingInputs, draft_token_ids: Sequence[Sequence[int]]
) -> VerifyOutput:
    """`logits` [sum of (1 + drafts), vocab]: each request's rows in order; `inputs` has one
    entry per request (its state before this step's tokens)."""
    counts = [1 + len(drafts) for drafts in draft_token_ids]
    if logits.dim() != 2 or logits.shape[0] != sum(counts):
        raise ValueError(
            f"logits must be [{sum(counts)} rows (1 + drafts per request), vocab], "
            f"got {tuple(logits.shape)}"
        )
    rows = _expand(inputs, draft_token_ids)
    device = logits.device
    work = process_logits(logits.to(torch.float32, copy=True), rows)
    # Per row: the draft it scores (-1 for a request's last row), and the token it emits if
    # the request's output stops there.
    next_draft = torch.tensor(
        [token for drafts in draft_token_ids for token in (*drafts, -1)], device=device
    )
    emitted = work.argmax(dim=-1)
    accepted = emitted == next_draft
    random_rows = [i for i, p in enumerate(rows.params) if _draws(p)]
    rewind = {i: g.get_state() for i, g in enumerate(inputs.generators) if g is not None}
    if random_rows:
        index = torch.tensor(random_rows, device=device)
        filtered = filter_logits(work[index], [rows.params[i] for i in random_rows])
        work[index] = filtered
        tokens = _inverse_cdf_draw(
            filtered.softmax(dim=-1), [rows.generators[i] for i in random_rows]
        )
        emitted[index] = tokens
        accepted[index] = tokens == next_draft[index]
    token_ids = []
    emitted_rows = []
    offset = 0
    for drafts, accepted_row, emitted_row in zip(
        draft_token_ids,
        _split(accepted.tolist(), counts),
        _split(emitted.tolist(), counts),
        strict=True,
    ):
        num_accepted = 0
        while num_accepted < len(drafts) and accepted_row[num_accepted]:
            num_accepted += 1
        token_ids.append([*drafts[:num_accepted], emitted_row[num_accepted]])
        emitted_rows.extend(range(offset, offset + num_accepted + 1))
        offset += len(drafts) + 1
    _rewind(inputs, rewind, token_ids)
    return VerifyOutput(token_ids, _emitted_logprobs(logits, work, rows, token_ids, emitted_rows))


def _rewind(
    inputs: SamplingInputs, states: dict[int, torch.Tensor], token_ids: list[list[int]]
) -> None:
    """Leave each seeded request's generator one uniform per emitted token past where it was
    (the draws of rows past its first rejection are taken back)."""
    for index, state in states.items():
        generator = inputs.generators[index]
        assert generator is not None
        if not _draws(inputs.params[index]):
            continue  # greedy: no draws
        generator.set_state(state)
        torch.rand(len(token_ids[index]), generator=generator, device=generator.device)


def _expand(inputs: SamplingInputs, draft_token_ids: Sequence[Sequence[int]]) -> SamplingInputs:
    """One entry per row: row j of a request sees its first j drafts as output."""
    params: list[SamplingParams] = []
    prompts, outputs, generators, blocked = [], [], [], []
    for i, drafts in enumerate(draft_token_ids):
        request_params = inputs.params[i]
        output = inputs.output_token_ids[i]
        min_tokens = request_params.min_tokens
        stops = inputs.stop_token_ids_to_block[i]  # non-empty while under min_tokens
        for j in range(len(drafts) + 1):
            params.append(request_params)
            prompts.append(inputs.prompt_token_ids[i])
            outputs.append([*output, *drafts[:j]] if j and _sees_output(request_params) else output)
            generators.append(inputs.generators[i])
            blocked.append(stops if len(output) + j < min_tokens else [])
    return SamplingInputs(params, prompts, outputs, generators, blocked)


def _sees_output(params: SamplingParams) -> bool:
    """Whether a row's processing reads the output so far (penalties, bad words)."""
    return bool(
        params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.bad_words_token_ids
    )


def _split(values: list, counts: list[int]) -> list[list]:
    parts, start = [], 0
    for count in counts:
        parts.append(values[start : start + count])
        start += count
    return parts


def _emitted_logprobs(
    raw: torch.Tensor,
    processed: torch.Tensor,
    rows: SamplingInputs,
    token_ids: list[list[int]],
    emitted_rows: list[int],
) -> list[list[dict[int, Logprob]] | None] | None:
    """Logprob dicts of every emitted token, from its row, for the requests that ask."""
    if all(p.logprobs is None for p in rows.params):
        return None
    index = torch.tensor(emitted_rows, device=raw.device)
    tokens = torch.tensor([t for tokens in token_ids for t in tokens], device=raw.device)
    params = [rows.params[i] for i in emitted_rows]
    dicts = _logprobs(raw[index], processed[index], tokens, params) or []
    result: list[list[dict[int, Logprob]] | None] = []
    start = 0
    for tokens_of_request in token_ids:
        part = dicts[start : start + len(tokens_of_request)]
        start += len(tokens_of_request)
        result.append(None if part[0] is None else part)  # type: ignore[arg-type]
    return result
