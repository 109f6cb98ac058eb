"""What changes a row's logits before a token is picked, in vLLM's order: a grammar's mask
(structured outputs), allowed_token_ids, bad_words, min_tokens (EOS and stop ids held off),
logit_bias, then the repetition, frequency and presence penalties. Greedy rows pick from the
result; random rows go on to temperature and the top-k/top-p/min-p cuts (sampler.py).

Each step is one batched tensor op over the rows that use it, with the per-row token lists
flattened by numpy; a step no row uses costs one pass over the params and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.attention import cpu_kernel

if TYPE_CHECKING:
    from tandem.sampling_params import SamplingParams
    from tandem.worker.sampler import SamplingInputs


def process_logits(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    """All of the above on float32 `logits` [rows, vocab], which may be changed in place."""
    if inputs.grammar_bitmasks is not None:
        _keep_grammar(logits, inputs.grammar_bitmasks)
    _keep_allowed(logits, inputs.params)
    _ban_bad_words(logits, inputs.params, inputs.output_token_ids)
    _block_tokens(logits, inputs.stop_token_ids_to_block)
    _add_logit_bias(logits, inputs.params)
    return apply_penalties(logits, inputs)


def _flat(
    rows: Sequence[int], lists: Sequence[Sequence[int]], vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """(row of each id, id) over the rows' lists, flattened in C; ids past the vocab dropped (the
    engine refuses them; they cannot index the logits either way)."""
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    ids = np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=int(lengths.sum()))
    row_of = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    inside = ids < vocab
    return row_of[inside], ids[inside]


def _inside(lists: Sequence[Sequence[int]], vocab: int) -> np.ndarray:
    """Which of the flattened ids `_flat` keeps."""
    count = sum(map(len, lists))
    return np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=count) < vocab


def _index(rows: np.ndarray, ids: np.ndarray, device: torch.device):
    return torch.from_numpy(rows).to(device), torch.from_numpy(ids).to(device)


def _keep_allowed(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """allowed_token_ids: every other token of the row gets -inf."""
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return
    vocab, device = logits.shape[1], logits.device
    row_of, ids = _flat(rows, [params[i].allowed_token_ids for i in rows], vocab)
    local = np.searchsorted(np.asarray(rows), row_of)  # row_of's position among `rows`
    banned = torch.ones(len(rows), vocab, dtype=torch.bool, device=device)
    banned[_index(local, ids, device)] = False
    index = torch.tensor(rows, device=device)
    logits[index] = logits[index].masked_fill_(banned, -math.inf)


def _keep_grammar(logits: torch.Tensor, bitmasks: Sequence[torch.Tensor | None]) -> None:
    """Structured outputs: each held row's tokens outside its grammar's bitmask get -inf, in
    place: on CPU by tandem's kernel (a word of 32 tokens at a time: 4x xgrammar's CPU kernel
    on the Zen 4), elsewhere by xgrammar's for the device (the bitmasks are xgrammar's, so it
    is there; a 32nd of the bytes of a boolean mask travel to the device)."""
    rows = [row for row, bitmask in enumerate(bitmasks) if bitmask is not None]
    if not rows:
        return
    held = torch.stack([bitmasks[row] for row in rows])
    if cpu_kernel.mask_rows(logits, rows, held):
        return
    import xgrammar

    words = torch.zeros(logits.shape[0], held.shape[1], dtype=torch.int32)
    words[rows] = held
    xgrammar.apply_token_bitmask_inplace(logits, words.to(logits.device), indices=rows)


def _ban_bad_words(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
) -> None:
    """bad_words, as vLLM applies them: a word's last token is banned when the output ends with
    the rest of the word (a one-token word always). All the rows' words are matched at once:
    each word's prefix, right-aligned, against its row's last output tokens."""
    rows = [i for i, p in enumerate(params) if p.bad_words_token_ids]
    if not rows:
        return
    words = [(row, seq) for row in rows for seq in params[row].bad_words_token_ids]
    width = max(len(seq) for _, seq in words) - 1  # longest prefix
    word_rows = np.fromiter((row for row, _ in words), dtype=np.int64, count=len(words))
    last = np.fromiter((seq[-1] for _, seq in words), dtype=np.int64, count=len(words))
    match = np.ones(len(words), dtype=bool)
    if width:
        # -1 marks "no token": before a short output, and before a short prefix (where any
        # token matches); a real prefix token never equals it.
        tails = np.full((len(params), width), -1, dtype=np.int64)
        prefixes = np.full((len(words), width), -1, dtype=np.int64)
        for row in rows:
            tail = output_token_ids[row][-width:]
            if tail:
                tails[row, width - len(tail) :] = tail
        for position, (_, seq) in enumerate(words):
            if len(seq) > 1:
                prefixes[position, width - len(seq) + 1 :] = seq[:-1]
        match = ((tails[word_rows] == prefixes) | (prefixes == -1)).all(axis=1)
    inside = match & (last < logits.shape[1])
    if inside.any():
        logits[_index(word_rows[inside], last[inside], logits.device)] = -math.inf


def _block_tokens(logits: torch.Tensor, block: Sequence[Sequence[int]]) -> None:
    """min_tokens: the row may not end yet, so its EOS and stop ids get -inf."""
    rows = [row for row, ids in enumerate(block) if ids]
    if rows:
        row_of, ids = _flat(rows, [block[row] for row in rows], logits.shape[1])
        logits[_index(row_of, ids, logits.device)] = -math.inf


def _add_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return
    biases = [params[i].logit_bias for i in rows]
    count = sum(map(len, biases))
    values = np.fromiter(chain.from_iterable(b.values() for b in biases), np.float32, count)
    row_of, ids = _flat(rows, biases, logits.shape[1])  # a dict iterates over its keys
    values = values[_inside(biases, logits.shape[1])]
    bias = torch.from_numpy(values).to(logits.device)
    logits.index_put_(_index(row_of, ids, logits.device), bias, accumulate=True)


def changes_logits(params: SamplingParams) -> bool:
    """Whether process_logits changes the request's row whatever its output so far (the
    min_tokens hold aside, which depends on it)."""
    return (
        params.allowed_token_ids is not None
        or params.structured_outputs is not None
        or bool(params.logit_bias)
        or bool(params.bad_words_token_ids)
        or _uses_penalties(params)
    )


def modifies_logits(inputs: SamplingInputs) -> bool:
    """Whether process_logits changes anything for this batch (otherwise it hands the tensor
    back untouched). Rows the caller knows are all plain_sampling change nothing but by
    min_tokens' blocked ids."""
    if any(inputs.stop_token_ids_to_block):
        return True
    return not inputs.all_plain and any(map(changes_logits, inputs.params))


def reads_output_tokens(params: SamplingParams) -> bool:
    """Whether sampling the request looks at its output so far (penalties, bad words, a
    grammar)."""
    return (
        _uses_penalties(params)
        or bool(params.bad_words_token_ids)
        or params.structured_outputs is not None
    )


def _uses_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def apply_penalties(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    """Repetition (HF: divide positive logits, multiply negative ones, for tokens seen in the
    prompt or output), then frequency (minus penalty x output count) and presence (minus penalty
    if in the output), only on the rows that set one. May work in place on `logits`."""
    rows = [i for i, p in enumerate(inputs.params) if _uses_penalties(p)]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    params = [inputs.params[i] for i in rows]
    index = None if len(rows) == len(inputs.params) else torch.tensor(rows, device=device)
    penalised = logits if index is None else logits[index]
    output_counts = _token_counts([inputs.output_token_ids[i] for i in rows], vocab, device)
    output_seen = output_counts > 0
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = [inputs.prompt_token_ids[i] for i in rows]
        seen = output_seen | (_token_counts(prompts, vocab, device, accumulate=False) > 0)
        penalty = column([p.repetition_penalty for p in params], device)
        scaled = torch.where(penalised > 0, penalised / penalty, penalised * penalty)
        penalised = torch.where(seen, scaled, penalised)
    if any(p.frequency_penalty != 0.0 for p in params):
        penalised -= output_counts.mul_(column([p.frequency_penalty for p in params], device))
    if any(p.presence_penalty != 0.0 for p in params):
        penalised -= output_seen * column([p.presence_penalty for p in params], device)
    if index is None:
        return penalised
    logits[index] = penalised
    return logits


def _token_counts(
    seqs: Sequence[Sequence[int]], vocab: int, device: torch.device, accumulate: bool = True
) -> torch.Tensor:
    """[len(seqs), vocab] float counts of each id (or 1 where present, without accumulate, which
    is cheaper), in one scatter over the flattened ids. np.fromiter reads Python ints about ten
    times faster than torch.tensor, which matters for long prompts under repetition penalty."""
    row_of, ids = _flat(range(len(seqs)), seqs, vocab)
    counts = torch.zeros(len(seqs), vocab, device=device)
    ones = torch.ones(len(ids), device=device)
    return counts.index_put_(_index(row_of, ids, device), ones, accumulate=accumulate)


def column(values: list[float], device: torch.device) -> torch.Tensor:
    """Per-row parameters as a [rows, 1] tensor that broadcasts over the vocab."""
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(-1)
