"""Turns the logits of one step into token ids, with vLLM's sampling semantics and order:
bans, bias and penalties (logits_processors.py), then argmax for greedy rows, or temperature,
min-p, top-k, top-p and a draw for the others; then logprobs, raw or processed as each row asks.

One call handles a whole batch: every filter is a tensor op over all rows with per-row
parameters, and a filter no row uses costs nothing. The only per-row Python is the draw for
seeded rows (each has its own torch.Generator, so its tokens do not depend on its batch mates)
and the building of the logprob dicts the API returns. The same logprob extraction serves
sampled tokens and prompt tokens (`token_logprobs`, `logprob_dicts`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.attention import cpu_kernel
from tandem.outputs import Logprob
from tandem.sampling_params import GREEDY_TEMPERATURE, SamplingParams, num_top_logprobs
from tandem.worker.logits_processors import (
    changes_logits,
    column,
    modifies_logits,
    process_logits,
)


@dataclass
class SamplingInputs:
    """Per-row state for one step, one entry per row of the logits, in batch order."""

    params: list[SamplingParams]
    prompt_token_ids: list[Sequence[int]]  # repetition penalty looks at prompt + output
    output_token_ids: list[Sequence[int]]  # all three penalties look at the output
    generators: list[torch.Generator | None]  # seeded rows, on the logits' device; else None
    # EOS and stop ids for rows still under min_tokens, empty otherwise; ids past the vocab
    # cannot be sampled anyway and are ignored.
    stop_token_ids_to_block: list[Sequence[int]]
    # (params carry the rest: allowed_token_ids, bad-word token ids, logit_bias, penalties)
    # Whether every row's params are argmax_only, and whether every row's are plain_sampling,
    # when the caller knows (each saves a pass over every row's attributes per step); None:
    # the sampler looks.
    all_argmax_only: bool | None = None
    all_plain: bool | None = None
    # Rows held to a grammar (structured outputs): their int32 bitmask of allowed tokens
    # (xgrammar's layout: bit i % 32 of word i // 32), None for the others; None: no such row.
    grammar_bitmasks: list[torch.Tensor | None] | None = None

    def __post_init__(self) -> None:
        lengths = {
            len(self.params),
            len(self.prompt_token_ids),
            len(self.output_token_ids),
            len(self.generators),
            len(self.stop_token_ids_to_block),
        }
        if len(lengths) != 1:
            raise ValueError(f"SamplingInputs fields must have one entry per row, got {lengths}")

    def select(self, rows: Sequence[int]) -> SamplingInputs:
        """The entries of `rows`, in that order."""
        return SamplingInputs(
            [self.params[i] for i in rows],
            [self.prompt_token_ids[i] for i in rows],
            [self.output_token_ids[i] for i in rows],
            [self.generators[i] for i in rows],
            [self.stop_token_ids_to_block[i] for i in rows],
            True if self.all_argmax_only else None,
            True if self.all_plain else None,
            None if self.grammar_bitmasks is None else [self.grammar_bitmasks[i] for i in rows],
        )


@dataclass
class SamplerOutput:
    """What one step sampled, in the row order of the logits."""

    token_ids: torch.Tensor  # [num_rows] int64, on the logits' device
    # Per row, when any row asked: the sampled token plus the top `params.logprobs` tokens (all
    # for -1), in that order (vLLM's shape), from the distribution its logprobs_mode names;
    # None for rows that did not ask.
    logprobs: list[dict[int, Logprob] | None] | None


# On CPU, rows are sampled in chunks of at most this many bytes of logits: a temporary under
# glibc's mmap threshold (32 MB, model_runner.keep_freed_memory_in_heap) comes back from the
# heap, while a bigger one (a float32 copy of 256 rows of a 49k vocabulary is 50 MB) is
# page-faulted in on every step: 3-6x the time of the pass itself.
SAMPLE_CHUNK_BYTES = 16 << 20


def sample(logits: torch.Tensor, inputs: SamplingInputs) -> SamplerOutput:
    """Sample one token per row of `logits` [num_rows, vocab]; the input is not modified."""
    if logits.dim() != 2 or logits.shape[0] != len(inputs.params):
        raise ValueError(
            f"logits must be [num_rows={len(inputs.params)}, vocab], got {tuple(logits.shape)}"
        )
    all_argmax_only = inputs.all_argmax_only
    if all_argmax_only is None:
        all_argmax_only = all(map(argmax_only, inputs.params))
    if all_argmax_only and not any(inputs.stop_token_ids_to_block):  # plain greedy rows
        tokens = cpu_kernel.argmax_rows(logits)
        return SamplerOutput(logits.argmax(dim=-1) if tokens is None else tokens, None)
    num_rows = logits.shape[0]
    rows = _kernel_rows(logits, inputs)
    if len(rows) == num_rows:
        return SamplerOutput(_sample_in_kernel(logits, inputs), None)
    if not rows:
        return _sample_in_torch(logits, inputs)
    # Each row's path depends on its own parameters only (and the two draw alike).
    chosen = set(rows)
    rest = [row for row in range(num_rows) if row not in chosen]
    in_kernel, in_torch = torch.tensor(rows), torch.tensor(rest)
    others = _sample_in_torch(logits[in_torch], inputs.select(rest))
    token_ids = torch.empty(num_rows, dtype=torch.long)
    token_ids[in_kernel] = _sample_in_kernel(logits[in_kernel], inputs.select(rows))
    token_ids[in_torch] = others.token_ids
    logprobs = None
    if others.logprobs is not None:
        logprobs = [None] * num_rows
        for row, row_logprobs in zip(rest, others.logprobs, strict=True):
            logprobs[row] = row_logprobs
    return SamplerOutput(token_ids, logprobs)


def _sample_in_torch(logits: torch.Tensor, inputs: SamplingInputs) -> SamplerOutput:
    """The sampler in torch ops, on any device; on CPU a few rows at a time."""
    num_rows = logits.shape[0]
    chunk_rows = max(1, SAMPLE_CHUNK_BYTES // (4 * logits.shape[1]))
    if logits.device.type != "cpu" or num_rows <= chunk_rows:
        return _sample_rows(logits, inputs)
    parts = [
        _sample_rows(logits[start : start + chunk_rows],
                     inputs.select(range(start, min(start + chunk_rows, num_rows))))
        for start in range(0, num_rows, chunk_rows)
    ]  # fmt: skip
    logprobs = None
    if any(part.logprobs is not None for part in parts):
        logprobs = [row for part in parts for row in part.logprobs or [None] * len(part.token_ids)]
    return SamplerOutput(torch.cat([part.token_ids for part in parts]), logprobs)


def _kernel_rows(logits: torch.Tensor, inputs: SamplingInputs) -> list[int]:
    """The rows the CPU kernel samples (attention/csrc/sample_rows.c): on CPU, with fp32
    logits and the kernel built, those whose logits nothing processes and that ask no
    logprobs."""
    if not cpu_kernel.takes_logits(logits):
        return []
    if inputs.all_plain and not any(inputs.stop_token_ids_to_block):
        return list(range(len(inputs.params)))
    return [
        row
        for row, (params, blocked) in enumerate(
            zip(inputs.params, inputs.stop_token_ids_to_block, strict=True)
        )
        if params.logprobs is None and not blocked and not changes_logits(params)
    ]


def _sample_in_kernel(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    """Rows sampled in one C call (the same cuts, and one uniform per row against the kept
    mass in vocabulary order, in a few passes over each row where the torch path makes a
    dozen over copies of the batch); _kernel_rows chose them."""
    params = inputs.params
    draws = [_draws(p) for p in params]
    generators = inputs.generators
    if any(generators):  # seeded rows that take the argmax draw nothing, as in the torch path
        generators = [g if d else None for g, d in zip(generators, draws, strict=True)]
    uniforms = row_uniforms(generators, logits.device)
    columns = kernel_columns(params, draws, logits.shape[1])
    tokens = cpu_kernel.sample_rows(logits, *columns, uniforms)
    assert tokens is not None  # _kernel_rows saw the kernel take these logits
    return tokens


def kernel_columns(
    params: Sequence[SamplingParams], draws: Sequence[bool], vocab: int
) -> tuple[list[float], list[int], list[float], list[float]]:
    """The rows' temperatures (0: the argmax; `draws`: each row's _draws), top-k (0: none),
    top-p and min-p as the C sampler takes them (csrc/sample_rows.c): a list each, one pass
    over the rows each (a tuple per row, transposed, cost twice as much a step)."""
    return (
        [p.temperature if d else 0.0 for p, d in zip(params, draws, strict=True)],
        [p.top_k if 0 < p.top_k < vocab else 0 for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
    )


@dataclass(frozen=True)
class BurstDraws:
    """The draws of a multi-step burst's plainly sampled rows, in the C sampler's terms: each
    row's parameters, and per step and row the uniform row_uniforms would have given it."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    uniforms: torch.Tensor  # [num_steps, rows] float32
    # The states of the generators drawn from (None: the global one) before the draws.
    states: list[tuple[torch.Generator | None, torch.Tensor]]

    def give_back(self, num_steps: int) -> None:
        """Leave every generator where `num_steps` single steps would have (a burst that a
        stop token ended after that many)."""
        for generator, state in self.states:
            if generator is None:
                torch.set_rng_state(state)
                torch.rand(num_steps, len(self.temperature))
            else:
                generator.set_state(state)
                torch.rand(num_steps, generator=generator)


def burst_draws(
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    num_steps: int,
    vocab: int,
) -> BurstDraws:
    """`num_steps` steps' draws at once, taking from the generators what that many steps of
    _sample_in_kernel would (a global number per row a step, and a seeded row's own one where
    it draws; torch's CPU generators give n numbers at once as n calls give one each), so
    seeded requests' tokens are those of one step at a time."""
    states: list[tuple[torch.Generator | None, torch.Tensor]] = [(None, torch.get_rng_state())]
    uniforms = torch.rand(num_steps, len(params))
    for row, (row_params, generator) in enumerate(zip(params, generators, strict=True)):
        if generator is not None and _draws(row_params):
            states.append((generator, generator.get_state()))
            uniforms[:, row] = torch.rand(num_steps, generator=generator)
    columns = kernel_columns(params, [_draws(p) for p in params], vocab)
    return BurstDraws(*columns, uniforms, states)


def _sample_rows(logits: torch.Tensor, inputs: SamplingInputs) -> SamplerOutput:
    """sample() over one chunk of rows."""
    params = inputs.params
    if logits.dtype != torch.float32 or modifies_logits(inputs):
        # Our own float32 copy: the steps below work in place, and raw logprobs need the input.
        work = process_logits(logits.to(torch.float32, copy=True), inputs)
        tokens = _pick_tokens(work, params, inputs.generators)
    else:  # nothing comes before temperature: applied out of place, it makes our copy
        temperatures = [p.temperature if _draws(p) else 1.0 for p in params]
        work = logits / column(temperatures, logits.device)
        tokens = _pick_tokens(work, params, inputs.generators, tempered=True)
    return SamplerOutput(tokens, _logprobs(logits, work, tokens, params))


def argmax_only(params: SamplingParams) -> bool:
    """Greedy with nothing to change the logits or to report: the token is the argmax (one
    pass over the row's attributes, where the general path makes one per feature)."""
    return params.temperature < GREEDY_TEMPERATURE and plain_sampling(params)


def plain_sampling(params: SamplingParams) -> bool:
    """Sampled from the raw logits with nothing to report: the C sampler's row (min_tokens
    aside, which blocks stop ids until reached), and multi-step scheduling's."""
    return params.logprobs is None and not changes_logits(params)


def _wants_processed(params: SamplingParams) -> bool:
    return params.logprobs is not None and params.logprobs_mode.startswith("processed")


def _draws(params: SamplingParams) -> bool:
    """Rows that go through temperature and the cuts: the random ones, and top_k=1 rows that
    want processed logprobs (vLLM samples those too; the draw can only pick the top token)."""
    if params.temperature < GREEDY_TEMPERATURE:
        return False
    return params.top_k != 1 or _wants_processed(params)


def _pick_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    tempered: bool = False,
) -> torch.Tensor:
    """Argmax for greedy rows, a random draw for the rest. Afterwards `logits` holds what each
    row picked from (the processed logits): as given for greedy rows, and after temperature and
    the cuts for drawn rows (those are written back only when a row wants them as logprobs).
    `tempered`: the drawn rows are divided by their temperature already."""
    random_rows = [i for i, p in enumerate(params) if _draws(p)]
    keep_filtered = any(_wants_processed(params[i]) for i in random_rows)
    if len(random_rows) == len(params):
        return _sample_random(logits, params, generators, keep_filtered, tempered)
    tokens = logits.argmax(dim=-1)
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        drawn = logits[index]
        tokens[index] = _sample_random(
            drawn,
            [params[i] for i in random_rows],
            [generators[i] for i in random_rows],
            keep_filtered,
            tempered,
        )
        if keep_filtered:
            logits[index] = drawn
    return tokens


def _sample_random(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    keep_filtered: bool = True,
    tempered: bool = False,
) -> torch.Tensor:
    """Temperature (unless `tempered`), then min-p, top-k and top-p in vLLM's order (top-p
    weighs what min-p and top-k left), then one draw per row. Each cut raises a per-row logit
    floor, and a cut no row uses costs nothing. A row whose kept set lies within its top
    candidates draws among them (no pass over the vocabulary), the others over the whole row;
    either way the inverse CDF runs in vocabulary order, so a seeded row picks the same token
    wherever it draws (and wherever the C kernel draws it, csrc/sample_rows.c), up to float
    rounding where its uniform falls at an interval's edge.
    `keep_filtered`: leave `logits` filtered (processed logprobs need them), and draw every row
    over the whole row."""
    cut = _cut_floor(logits, params, tempered)
    if cut is None:
        return _inverse_cdf_draw(logits.softmax(dim=-1), generators)
    floor, candidates = cut
    # Every token at or above the floor is a candidate when the floor is above the last one.
    within = (floor > candidates.values[:, -1:]).squeeze(-1)
    if keep_filtered or not bool(within.any()):
        return _draw_above(logits, floor, generators)
    tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    rows = within.nonzero().squeeze(-1)
    indices, order = candidates.indices[rows].sort(dim=-1)  # vocabulary order
    picks = _draw_above(
        candidates.values[rows].gather(-1, order), floor[rows],
        [generators[i] for i in rows.tolist()],
    )  # fmt: skip
    tokens[rows] = indices.gather(-1, picks.unsqueeze(-1)).squeeze(-1)
    rest = (~within).nonzero().squeeze(-1)
    if len(rest):
        tokens[rest] = _draw_above(
            logits[rest], floor[rest], [generators[i] for i in rest.tolist()]
        )
    return tokens


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p on `logits` in place, cut tokens at -inf: what a
    random row draws from (its softmax is the distribution speculative decoding matches)."""
    cut = _cut_floor(logits, params)
    if cut is not None:
        logits.masked_fill_(logits < cut[0], -math.inf)
    return logits


def _cut_floor(
    logits: torch.Tensor, params: list[SamplingParams], tempered: bool = False
) -> tuple[torch.Tensor, torch.return_types.topk] | None:
    """Temperature in place (unless `tempered`), then min-p, top-k and top-p as one per-row
    logit floor with the row's top candidates it was found among; None when no row cuts.
    Min-p's floor (a token's probability under min_p times the largest: its logit under the
    largest plus log min_p) comes from the candidates' first, so it costs no pass over the
    row."""
    device, vocab = logits.device, logits.shape[1]
    temperatures = [p.temperature for p in params]
    if not tempered and any(t != 1.0 for t in temperatures):
        logits.div_(column(temperatures, device))
    min_p = [p.min_p for p in params]
    wants_min_p = any(m > 0.0 for m in min_p)
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]  # 0: off
    k = torch.tensor(top_k, device=device).unsqueeze(-1) if any(top_k) else None
    wants_top_p = any(p.top_p < 1.0 for p in params)
    if k is None and not wants_top_p and not wants_min_p:
        return None
    num_candidates = min(vocab, max(TOP_P_CANDIDATES, max(top_k)))
    candidates = logits.topk(num_candidates, dim=-1)  # descending
    min_floor = None
    if wants_min_p:  # log(0) = -inf: rows without min-p keep everything
        min_floor = candidates.values[:, :1] + column(min_p, device).log()
    if wants_top_p:
        # Off rows get p = inf: float rounding in the cumsum must not drop their tail.
        top_p = column([p.top_p if p.top_p < 1.0 else math.inf for p in params], device)
        floor = _top_k_top_p_floor(logits, candidates.values.clone(), k, top_p, min_floor)
    elif k is None:
        floor = min_floor
    else:
        floor = _kth_largest(candidates.values, k)
        if min_floor is not None:
            floor = torch.maximum(floor, min_floor)
    return floor, candidates


def _draw_above(
    logits: torch.Tensor, floor: torch.Tensor, generators: list[torch.Generator | None]
) -> torch.Tensor:
    """One draw per row among the logits at or above its floor (the rest are set to -inf in
    place); the index is into `logits`' columns."""
    logits.masked_fill_(logits < floor, -math.inf)
    return _inverse_cdf_draw(logits.softmax(dim=-1), generators)


def _kth_largest(descending: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Each row's k-th largest logit [rows, 1], from values sorted descending; -inf (keep all)
    where k is 0. Keeping every logit >= it keeps ties at the boundary, as HF and vLLM do."""
    kth = descending.gather(-1, (k - 1).clamp(min=0))
    return kth.masked_fill_(k == 0, -math.inf)


# Top-p's kept set lies among this many of a row's most likely tokens in all but flat
# distributions; rows whose set reaches past them are sorted whole.
TOP_P_CANDIDATES = 128


def _top_k_top_p_floor(
    logits: torch.Tensor,
    top: torch.Tensor,
    k: torch.Tensor | None,
    p: torch.Tensor,
    min_floor: torch.Tensor | None = None,
) -> torch.Tensor:
    """Min-p, top-k and top-p as one per-row floor, without sorting the vocabulary: the top-p
    cut is looked for among the row's top candidates (a topk, ~10x cheaper than a sort on
    CPU), each candidate's probability taken against what min-p (`min_floor`, a logit floor
    per row) and top-k leave: within the candidates when their floor is above the last one (no
    pass over the row), against the whole row otherwise; only rows whose kept mass lies beyond
    the candidates fall back to the full sort. The kept set is the sort's, up to float rounding
    of the running mass right at p. `top`: the row's largest logits, descending (at least
    TOP_P_CANDIDATES and k of them); it is overwritten."""
    num_candidates = top.shape[1]
    floor_before = min_floor  # what min-p and top-k leave: the logits at or above it
    kth = None
    if k is not None:
        kth = _kth_largest(top, k)
        floor_before = kth if floor_before is None else torch.maximum(floor_before, kth)
    top_p_on = ~torch.isinf(p)
    if floor_before is None:
        whole_row = top_p_on
    else:
        top.masked_fill_(top < floor_before, -math.inf)
        whole_row = top_p_on & (floor_before <= top[:, -1:])  # the set reaches past the top
        if k is not None:
            whole_row &= k == 0  # the top-k set is the candidates at or above the kth
    normalizer = top.logsumexp(dim=-1, keepdim=True)
    if bool(whole_row.all()):  # no copy of the rows (the common case of top-p alone)
        if min_floor is not None:
            logits = logits.masked_fill(logits < min_floor, -math.inf)
        normalizer = logits.logsumexp(dim=-1, keepdim=True)
    elif whole_row.any():
        rows = whole_row.squeeze(-1).nonzero().squeeze(-1)
        full = logits[rows]
        if min_floor is not None:
            full.masked_fill_(full < min_floor[rows], -math.inf)
        normalizer[rows] = full.logsumexp(dim=-1, keepdim=True)
    mass = top.sub(normalizer).exp_().cumsum_(dim=-1)
    below = (mass < p).sum(dim=-1, keepdim=True)
    floor = top.gather(-1, below.clamp(max=num_candidates - 1))
    floor.masked_fill_(~top_p_on, -math.inf)
    beyond = ((below == num_candidates) & top_p_on).squeeze(-1)
    if beyond.any():
        rows = beyond.nonzero().squeeze(-1)
        floor[rows] = _top_k_top_p_floor_sorted(
            logits[rows],
            None if k is None else k[rows],
            p[rows],
            None if min_floor is None else min_floor[rows],
        )
    return floor if floor_before is None else torch.maximum(floor, floor_before)


def _top_k_top_p_floor_sorted(
    logits: torch.Tensor,
    k: torch.Tensor | None,
    p: torch.Tensor,
    min_floor: torch.Tensor | None = None,
) -> torch.Tensor:
    """One descending sort serves every filter. Top-p keeps a token while the mass of the more
    likely tokens (after min-p and top-k) is still below p: the smallest set reaching p, never
    empty. The result is a floor in the original order, so nothing is scattered back."""
    sorted_logits = logits.sort(dim=-1, descending=True).values
    floor_before = min_floor
    if k is not None:
        kth = _kth_largest(sorted_logits, k)
        floor_before = kth if floor_before is None else torch.maximum(floor_before, kth)
    if floor_before is not None:
        sorted_logits.masked_fill_(sorted_logits < floor_before, -math.inf)
    mass = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    # Token j stays iff mass[j - 1] < p, and token 0 always: a prefix, as mass never decreases.
    kept = (mass < p).sum(dim=-1, keepdim=True).add_(1).clamp_(max=logits.shape[1])
    floor = sorted_logits.gather(-1, kept - 1)
    return floor if floor_before is None else torch.maximum(floor, floor_before)


def _inverse_cdf_draw(
    probs: torch.Tensor, generators: list[torch.Generator | None]
) -> torch.Tensor:
    """One uniform u per row against the row's running mass: the first token whose cumulative
    probability exceeds u times the total picks token i with probability probs[i], and a token
    of probability 0 (filtered) is never picked. One random number per row instead of one per
    vocabulary entry (an exponential race costs a draw, a log and a divide per entry). Each
    seeded row draws its u from its own generator, so it advances the same way whatever its
    position or batch mates."""
    u = row_uniforms(generators, probs.device).unsqueeze(-1)
    cdf = probs.cumsum_(dim=-1)
    target = u.mul_(cdf[:, -1:])
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1).squeeze(-1)


def row_uniforms(
    generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """One uniform in [0, 1) per row, a seeded row's from its own generator (one number per
    draw, so it advances the same way whatever its position or batch mates)."""
    u = torch.rand(len(generators), device=device)
    for row, generator in enumerate(generators):
        if generator is not None:
            u[row] = torch.rand(1, generator=generator, device=device)
    return u


@dataclass
class LogprobsTensors:
    """Logprobs of one target token per row and the row's top-N, still on the device."""

    token_ids: torch.Tensor  # [rows] int64: the target (sampled, or the next prompt token)
    token_logprobs: torch.Tensor  # [rows] float32
    ranks: torch.Tensor  # [rows] int32: 1 + how many tokens are more likely than the target
    top_logprobs: torch.Tensor  # [rows, N] float32, descending
    top_ids: torch.Tensor  # [rows, N] int64

    @classmethod
    def cat(cls, parts: Sequence[LogprobsTensors]) -> LogprobsTensors:
        if len(parts) == 1:
            return parts[0]
        return cls(
            torch.cat([p.token_ids for p in parts]),
            torch.cat([p.token_logprobs for p in parts]),
            torch.cat([p.ranks for p in parts]),
            torch.cat([p.top_logprobs for p in parts]),
            torch.cat([p.top_ids for p in parts]),
        )


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """For each row of `logits` [rows, vocab]: the logprob and rank of its target token under
    the raw distribution (log_softmax in float32), and its `num_top` most likely tokens."""
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), target_ids, num_top)


def gather_logprobs(
    values: torch.Tensor, target_ids: torch.Tensor, num_top: int
) -> LogprobsTensors:
    """The target's value and rank in each row of `values` [rows, vocab] (logprobs, or logits
    in the logits modes: the order is the same), and the row's `num_top` largest."""
    chosen = values.gather(-1, target_ids.unsqueeze(-1))
    ranks = (values > chosen).sum(dim=-1, dtype=torch.int32).add_(1)  # int32: 2x faster on CPU
    top_values, top_ids = values.topk(min(num_top, values.shape[1]), dim=-1)
    return LogprobsTensors(target_ids, chosen.squeeze(-1), ranks, top_values, top_ids)


def logprob_dicts(tensors: LogprobsTensors, num_top: Sequence[int]) -> list[dict[int, Logprob]]:
    """vLLM's per-position dicts: the target token with its rank, then the row's top `num_top`
    (fewer than the tensors hold where rows asked for different counts). One host transfer per
    tensor, then plain Python."""
    result = []
    for token, logprob, rank, ids, values, n in zip(
        tensors.token_ids.tolist(),
        tensors.token_logprobs.tolist(),
        tensors.ranks.tolist(),
        tensors.top_ids.tolist(),
        tensors.top_logprobs.tolist(),
        num_top,
        strict=True,
    ):
        entry = {token: Logprob(logprob, rank)}
        for position, (top_id, value) in enumerate(zip(ids[:n], values[:n], strict=True), start=1):
            entry.setdefault(top_id, Logprob(value, position))
        result.append(entry)
    return result


def _logprobs(
    raw_logits: torch.Tensor,
    processed: torch.Tensor,
    tokens: torch.Tensor,
    params: list[SamplingParams],
) -> list[dict[int, Logprob] | None] | None:
    """Each asking row's logprobs: the sampled token with its rank, then the top-N, from the
    raw logits (before anything changed them; vLLM's default) or the processed ones, as
    log-probabilities or as the logits themselves (logprobs_mode)."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    device, vocab = raw_logits.device, raw_logits.shape[1]
    modes = [params[i].logprobs_mode for i in rows]
    sources = {"raw": raw_logits, "processed": processed}
    if len(set(modes)) == 1:
        values = _logprob_values(sources, modes[0], torch.tensor(rows, device=device))
    else:
        values = torch.empty(len(rows), vocab, dtype=torch.float32, device=device)
        for mode in set(modes):
            positions = [j for j, m in enumerate(modes) if m == mode]
            index = torch.tensor([rows[j] for j in positions], device=device)
            values[torch.tensor(positions, device=device)] = _logprob_values(sources, mode, index)
    asked = [params[i].logprob_token_ids for i in rows]
    num_top = [
        0 if ids else num_top_logprobs(params[i].logprobs, vocab)
        for i, ids in zip(rows, asked, strict=True)
    ]
    index = torch.tensor(rows, device=device)
    tensors = gather_logprobs(values, tokens[index], max(num_top))
    result: list[dict[int, Logprob] | None] = [None] * len(params)
    dicts = logprob_dicts(tensors, num_top)
    for position, (row, entry, ids) in enumerate(zip(rows, dicts, asked, strict=True)):
        if ids:  # logprob_token_ids: each asked token's value and rank, in the order asked
            targets = torch.tensor(ids, device=device)
            asked_tensors = gather_logprobs(values[position].expand(len(ids), -1), targets, 0)
            logprobs = asked_tensors.token_logprobs.tolist()
            ranks = asked_tensors.ranks.tolist()
            for token_id, logprob, rank in zip(ids, logprobs, ranks, strict=True):
                entry.setdefault(token_id, Logprob(logprob, rank))
        result[row] = entry
    return result


def _logprob_values(
    sources: dict[str, torch.Tensor], mode: str, index: torch.Tensor
) -> torch.Tensor:
    """The rows `index` of the source `mode` names, as float32 logprobs or logits."""
    source, _, kind = mode.partition("_")
    values = sources[source][index].float()
    return torch.log_softmax(values, dim=-1) if kind == "logprobs" else values
