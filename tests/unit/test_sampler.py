"""The sampler against straightforward references: exact logits for the penalties, chi-square
goodness of fit for every random filter, and reproducibility of seeded rows across batches."""

from __future__ import annotations

import ctypes
import dataclasses
import math
import platform
from collections.abc import Sequence

import pytest
import torch

from tandem.attention import cpu_kernel
from tandem.sampling_params import SamplingParams, StructuredOutputsParams
from tandem.worker import sampler
from tandem.worker.logits_processors import apply_penalties, modifies_logits, process_logits
from tandem.worker.sampler import (
    LogprobsTensors,
    SamplingInputs,
    logprob_dicts,
    sample,
    token_logprobs,
)

from helpers import needs_cpu_kernels

# Distinct logits over a small vocab; sorted order 2, 7, 0, 4, 1, 6, 3, 5. Every truncation
# boundary used below is at least 0.03 away from its threshold, far above float32 error.
LOGITS = torch.tensor([1.2, 0.3, 2.0, -0.5, 0.9, -1.4, 0.1, 1.6])
NUM_DRAWS = 20_000


def make_inputs(
    params: list[SamplingParams],
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    block: Sequence[Sequence[int]] | None = None,
) -> SamplingInputs:
    n = len(params)
    return SamplingInputs(
        params=params,
        prompt_token_ids=list(prompts or [[]] * n),
        output_token_ids=list(outputs or [[]] * n),
        generators=list(generators or [None] * n),
        stop_token_ids_to_block=list(block or [[]] * n),
    )


def reference_probs(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """The intended distribution, filter by filter in vLLM's order (min-p, top-k, top-p, each
    on what the one before left), in float64 and plain Python."""
    probs = (logits.double() / temperature).softmax(-1)
    if min_p > 0.0:
        probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    order = [i for i in probs.argsort(descending=True).tolist() if probs[i] > 0]
    keep = set(order)
    if 0 < top_k < len(order):
        keep = set(order[:top_k])
    probs = torch.tensor([p if i in keep else 0.0 for i, p in enumerate(probs.tolist())])
    probs /= probs.sum()
    if top_p < 1.0:
        mass, keep = 0.0, set()
        for i in order:
            if mass >= top_p:
                break
            keep.add(i)
            mass += float(probs[i])
        probs = torch.tensor([p if i in keep else 0.0 for i, p in enumerate(probs.tolist())])
        probs /= probs.sum()
    return probs


def chi_square_p_value(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson goodness of fit over the tokens with nonzero expected probability. The chi-square
    survival function with d degrees of freedom is the regularised upper incomplete gamma
    Q(d/2, x/2), which torch ships (so no scipy)."""
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    support = expected > 0
    expected_counts = expected[support] * counts.sum()
    statistic = ((counts[support] - expected_counts) ** 2 / expected_counts).sum()
    dof = torch.tensor(float(support.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


@pytest.mark.parametrize(
    ("dof", "critical"),
    # Upper-tail 0.001 critical values, NIST/SEMATECH e-Handbook of Statistical Methods,
    # section 1.3.6.7.4 "Critical Values of the Chi-Square Distribution".
    [(1, 10.828), (2, 13.816), (3, 16.266), (5, 20.515), (7, 24.322)],
)
def test_chi_square_p_value_matches_the_published_table(dof: int, critical: float) -> None:
    half_dof, half_x = torch.tensor([dof / 2, critical / 2], dtype=torch.float64)
    assert float(torch.special.gammaincc(half_dof, half_x)) == pytest.approx(0.001, rel=1e-3)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=0.8, top_k=1)] * 3
    out = sample(logits, make_inputs(params))
    assert out.token_ids.dtype == torch.int64
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_p=0.5, min_p=0.1, repetition_penalty=1.5)] * 3
    sample(logits, make_inputs(params, outputs=[[1, 2]] * 3, block=[[0]] * 3))
    assert torch.equal(logits, before)


def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], params: SamplingParams
) -> list[float]:
    out = list(logits)
    for token in set(prompt) | set(output):
        rep = params.repetition_penalty
        out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
    for token in set(output):
        out[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return out


def test_penalties_by_hand() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    inputs = make_inputs([params], prompts=[[0, 1]], outputs=[[2, 2]])
    # 2/2; -1*2; 0.5/2 - 0.5*2 - 0.25; untouched
    assert apply_penalties(logits, inputs).tolist() == [[1.0, -2.0, -1.0, 3.0]]


def test_penalties_and_greedy_match_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    vocab, changed = 12, 0
    for _ in range(25):
        logits = torch.randn(4, vocab, generator=gen) * 2
        params = [
            SamplingParams(temperature=0.0, repetition_penalty=1.8),
            SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=-0.5),
            SamplingParams(temperature=0.0),  # no penalty: must stay untouched
            SamplingParams(
                temperature=0.0,
                repetition_penalty=0.7,
                frequency_penalty=-0.3,
                presence_penalty=2.0,
            ),
        ]
        prompts = [torch.randint(vocab, (5,), generator=gen).tolist() for _ in params]
        outputs = [torch.randint(vocab, (7,), generator=gen).tolist() for _ in params]
        expected = torch.tensor(
            [
                reference_penalties(row, prompt, output, p)
                for row, prompt, output, p in zip(
                    logits.tolist(), prompts, outputs, params, strict=True
                )
            ]
        )
        inputs = make_inputs(params, prompts=prompts, outputs=outputs)
        torch.testing.assert_close(apply_penalties(logits.clone(), inputs), expected)
        tokens = sample(logits, inputs).token_ids
        assert tokens.tolist() == expected.argmax(-1).tolist()
        changed += int((tokens != logits.argmax(-1)).sum())
    assert changed > 10  # the penalties did move the argmax, so the check has teeth


CASES = {
    "temperature": (dict(temperature=0.6), False),
    "top_k beyond vocab is off": (dict(temperature=1.7, top_k=100), False),
    "top_k": (dict(top_k=3), False),
    "top_k on the sort path": (dict(top_k=3), True),
    "no top_p beside a top_p row": (dict(temperature=1.7), True),
    "top_p": (dict(top_p=0.7), False),
    "min_p": (dict(min_p=0.3), False),
    "all filters": (dict(temperature=0.8, top_k=6, top_p=0.75, min_p=0.4), False),
}


@pytest.fixture(params=["kernel", "torch"])
def sampler_path(request, monkeypatch) -> str:
    """On CPU the rows the C kernel takes (attention/csrc/sample_rows.c) draw there; "torch":
    every row through the torch ops (the path on GPUs and without a compiler)."""
    if request.param == "torch":
        monkeypatch.setattr(sampler, "_kernel_rows", lambda logits, inputs: [])
    elif cpu_kernel.load_library() is None:
        pytest.skip("the CPU kernels cannot be built here")
    return request.param


@pytest.mark.parametrize(("knobs", "top_p_mate"), CASES.values(), ids=CASES.keys())
def test_random_rows_follow_the_intended_distribution(
    knobs: dict, top_p_mate: bool, sampler_path: str
) -> None:
    """20k rows of the same logits in one call; a mate row with top_p forces the sort path."""
    torch.manual_seed(0)
    params = [SamplingParams(**knobs)] * NUM_DRAWS
    if top_p_mate:
        params = [*params, SamplingParams(top_p=0.5)]
    logits = LOGITS.expand(len(params), -1)
    tokens = sample(logits, make_inputs(params)).token_ids[:NUM_DRAWS]
    expected = reference_probs(LOGITS, **knobs)
    assert set(tokens.tolist()) == set(expected.nonzero().flatten().tolist())
    assert chi_square_p_value(tokens, expected) > 1e-3


def test_chi_square_rejects_the_untempered_distribution(sampler_path: str) -> None:
    """The goodness-of-fit check above has power: temperature 0.6 is not temperature 1."""
    torch.manual_seed(0)
    params = [SamplingParams(temperature=0.6)] * NUM_DRAWS
    tokens = sample(LOGITS.expand(NUM_DRAWS, -1), make_inputs(params)).token_ids
    assert chi_square_p_value(tokens, reference_probs(LOGITS)) < 1e-9


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(seed=123, temperature=0.9, top_p=0.95),
        SamplingParams(seed=123, top_k=10),
        SamplingParams(seed=123, min_p=0.05, repetition_penalty=1.3),
    ],
    ids=["top_p", "top_k", "min_p+penalty"],
)
def test_seeded_row_is_reproducible_across_batches(target: SamplingParams) -> None:
    vocab, steps = 64, 8
    gen = torch.Generator().manual_seed(7)
    step_logits = [torch.randn(vocab, generator=gen) * 0.5 for _ in range(steps)]
    mates = [
        SamplingParams(top_k=5),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(seed=999, top_p=0.5),
        SamplingParams(temperature=1.5, min_p=0.1),
    ]

    def run(batched: bool) -> list[int]:
        generator = torch.Generator().manual_seed(123)
        mate_generator = torch.Generator().manual_seed(999)
        output: list[int] = []
        for step, row_logits in enumerate(step_logits):
            torch.manual_seed(1000 * batched + step)  # the default generator must not matter
            rows: list[tuple[SamplingParams, torch.Generator | None]] = [(target, generator)]
            position = 0
            if batched:
                others = [
                    (p, mate_generator if p.seed is not None else None)
                    for p in mates[: 1 + step % len(mates)]
                ]
                position = step % (len(others) + 1)
                rows = [*others[:position], *rows, *others[position:]]
            params = [p for p, _ in rows]
            generators = [g for _, g in rows]
            logits = torch.randn(len(params), vocab, generator=gen)
            logits[position] = row_logits
            outputs = [list(output)] * len(params)
            inputs = make_inputs(params, outputs=outputs, generators=generators)
            output.append(int(sample(logits, inputs).token_ids[position]))
        return output

    alone = run(batched=False)
    assert run(batched=True) == alone
    assert len(set(alone)) > 1  # really random, not stuck on the argmax


def test_min_tokens_blocking_is_never_sampled() -> None:
    torch.manual_seed(0)
    vocab, rows = 10, 2000
    logits = torch.zeros(rows + 2, vocab)
    logits[:, 2], logits[:, 5] = 9.0, 8.0  # blocked ids are by far the most likely
    params = [SamplingParams(temperature=1.0)] * rows + [SamplingParams(temperature=0.0)] * 2
    block = [[2, 5, 99]] * (rows + 1) + [[]]  # 99 is past the vocab: ignored, not an error
    tokens = sample(logits, make_inputs(params, block=block)).token_ids
    assert not set(tokens[: rows + 1].tolist()) & {2, 5}
    assert len(set(tokens[:rows].tolist())) == vocab - 2  # the rest stays reachable
    assert tokens[-1] == 2  # the unblocked row is unaffected


def test_logprobs_come_from_the_raw_logits() -> None:
    torch.manual_seed(0)
    vocab = 30
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(3)) * 3
    raw = torch.log_softmax(logits, -1)
    raw_order = raw.argsort(-1, descending=True)
    params = [
        SamplingParams(temperature=0.5, logprobs=4),
        SamplingParams(logprobs=None),
        SamplingParams(temperature=0.0, logprobs=0),
        # Greedy with the 4 likeliest tokens blocked: the chosen one is rank 5, outside top-3.
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.2),
        SamplingParams(top_k=8, logprobs=vocab + 5),  # more than the vocab: all of it
    ]
    block: list[list[int]] = [[], [], [], raw_order[3, :4].tolist(), []]
    out = sample(logits, make_inputs(params, outputs=[[1, 2]] * 5, block=block))
    assert out.logprobs is not None and len(out.logprobs) == 5
    assert out.logprobs[1] is None
    tokens = out.token_ids.tolist()
    assert tokens[3] == int(raw_order[3, 4])
    for row, entry in enumerate(out.logprobs):
        if entry is None:
            continue
        chosen = tokens[row]
        n = min(params[row].logprobs or 0, vocab)
        top = raw_order[row, :n].tolist()
        assert next(iter(entry)) == chosen  # vLLM's order: the sampled token first
        assert set(entry) == {chosen, *top}
        assert entry[chosen].rank == 1 + int((raw[row] > raw[row, chosen]).sum())
        for token, logprob in entry.items():
            assert logprob.logprob == pytest.approx(float(raw[row, token]), abs=1e-5)
            assert logprob.decoded_token is None
        top_entries = [entry[t] for t in top]
        assert [lp.rank for lp in top_entries] == list(range(1, n + 1))
        assert [lp.logprob for lp in top_entries] == sorted(
            (lp.logprob for lp in top_entries), reverse=True
        )
    assert list(out.logprobs[2]) == [tokens[2]] and out.logprobs[2][tokens[2]].rank == 1
    assert len(out.logprobs[3]) == 4 and out.logprobs[3][tokens[3]].rank == 5
    assert len(out.logprobs[4]) == vocab


def test_logprob_token_ids_replace_the_top_n() -> None:
    """vLLM's logprob_token_ids: a row gives the sampled token, then the asked tokens in the
    order asked (repeats dropped), each with its logprob and rank, and no top-N; other rows
    keep their top-N; the processed modes read their own distribution."""
    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5)) * 3
    raw = torch.log_softmax(logits, -1)
    asked = [7, 31, 2, 7]
    params = [
        SamplingParams(temperature=0.0, logprobs=5, logprob_token_ids=asked),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(
            temperature=0.0, logprobs=0, logprob_token_ids=[3], logprobs_mode="raw_logits"
        ),
    ]
    out = sample(logits, make_inputs(params))
    assert out.logprobs is not None
    tokens = out.token_ids.tolist()
    first = out.logprobs[0]
    expected = list(dict.fromkeys([tokens[0], 7, 31, 2]))
    assert list(first) == expected
    for token, logprob in first.items():
        assert logprob.logprob == pytest.approx(float(raw[0, token]), abs=1e-5)
        assert logprob.rank == 1 + int((raw[0] > raw[0, token]).sum())
    second = out.logprobs[1]
    assert set(second) == {tokens[1], *raw[1].argsort(descending=True)[:2].tolist()}
    third = out.logprobs[2]
    assert list(third) == list(dict.fromkeys([tokens[2], 3]))
    assert third[3].logprob == pytest.approx(float(logits[2, 3]), abs=1e-5)
    assert third[3].rank == 1 + int((logits[2] > logits[2, 3]).sum())


def test_logprob_token_ids_are_checked() -> None:
    with pytest.raises(ValueError, match="logprob_token_ids gives the logprobs of those tokens"):
        SamplingParams(logprob_token_ids=[1])
    with pytest.raises(TypeError, match="logprob_token_ids"):
        SamplingParams(logprobs=1, logprob_token_ids=[1, "2"])
    assert SamplingParams(logprobs=1, logprob_token_ids=[]).logprob_token_ids is None
    with pytest.raises(ValueError, match=r"logprob_token_ids has token ids outside the vocab"):
        SamplingParams(logprobs=1, logprob_token_ids=[5, 100]).check_vocab(100)


def test_token_logprobs_of_given_targets_in_slices() -> None:
    """What prompt logprobs use: any target per row (not a sampled one), its rank, the top-N;
    rows scored in slices and concatenated give the same as all at once; each row's dict keeps
    only its own N."""
    logits = torch.randn(7, 12, generator=torch.Generator().manual_seed(1)) * 2
    targets = torch.tensor([0, 5, 11, 3, 3, 7, 1])
    raw = torch.log_softmax(logits, -1)
    whole = token_logprobs(logits, targets, 4)
    parts = LogprobsTensors.cat([token_logprobs(logits[a:b], targets[a:b], 4)
                                 for a, b in ((0, 3), (3, 6), (6, 7))])  # fmt: skip
    for field in ("token_ids", "token_logprobs", "ranks", "top_logprobs", "top_ids"):
        assert torch.equal(getattr(whole, field), getattr(parts, field))
    assert torch.allclose(whole.token_logprobs, raw.gather(-1, targets[:, None]).squeeze(-1))
    assert whole.ranks.tolist() == [int((raw[i] > raw[i, t]).sum()) + 1
                                    for i, t in enumerate(targets.tolist())]  # fmt: skip
    num_top = [0, 1, 2, 4, 4, 3, 0]
    rows = logprob_dicts(whole, num_top)
    for row, (entry, target, n) in enumerate(zip(rows, targets.tolist(), num_top, strict=True)):
        top = raw[row].topk(n).indices.tolist()
        assert next(iter(entry)) == target and set(entry) == {target, *top}
    assert token_logprobs(logits, targets, 50).top_ids.shape == (7, 12)  # capped at the vocab


def test_mixed_batch_keeps_each_rows_semantics() -> None:
    torch.manual_seed(0)
    pattern = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, top_k=1),  # greedy by top_k
        SamplingParams(temperature=0.0, presence_penalty=2.0),  # output [0]: argmax moves to 1
        SamplingParams(temperature=2.0, min_p=0.5),
    ]
    repeats = 3000
    params = pattern * repeats
    logits = torch.tensor([3.0, 2.8, 2.0, 0.0, -1.0, -2.0]).expand(len(params), -1)
    outputs = [[0] if p.presence_penalty else [] for p in params]
    tokens = sample(logits, make_inputs(params, outputs=outputs)).token_ids.view(repeats, -1)
    assert tokens[:, 0].eq(0).all() and tokens[:, 2].eq(0).all()
    assert tokens[:, 3].eq(1).all()
    top_k = reference_probs(logits[0], top_k=2)
    assert chi_square_p_value(tokens[:, 1], top_k) > 1e-3
    min_p = reference_probs(logits[0], temperature=2.0, min_p=0.5)
    assert set(tokens[:, 4].tolist()) == {0, 1, 2}
    assert chi_square_p_value(tokens[:, 4], min_p) > 1e-3


def test_mismatched_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingInputs([SamplingParams()], [[]], [[]], [], [[]])
    with pytest.raises(ValueError, match="num_rows=1"):
        sample(torch.zeros(2, 5), make_inputs([SamplingParams()]))


# -- allowed_token_ids, bad_words, logit_bias, logprobs modes ----------------------------------


def processed_values(
    logits: torch.Tensor, params: list[SamplingParams], **inputs: object
) -> torch.Tensor:
    """What each row picked from, read back through logprobs_mode="processed_logits" with
    logprobs=-1 (every token's value)."""
    params = [dataclasses.replace(p, logprobs=-1, logprobs_mode="processed_logits") for p in params]
    out = sample(logits, make_inputs(params, **inputs))
    rows = torch.full_like(logits, math.nan)
    for row, entry in enumerate(out.logprobs):
        for token, logprob in entry.items():
            rows[row, token] = logprob.logprob
    return rows


def test_allowed_token_ids_keep_only_those() -> None:
    torch.manual_seed(0)
    allowed = [1, 3, 6]
    params = [SamplingParams(allowed_token_ids=allowed)] * NUM_DRAWS + [
        SamplingParams(temperature=0.0, allowed_token_ids=allowed),
        SamplingParams(temperature=0.0),
    ]
    tokens = sample(LOGITS.expand(len(params), -1), make_inputs(params)).token_ids
    masked = torch.full_like(LOGITS, -math.inf)
    masked[allowed] = LOGITS[allowed]
    assert chi_square_p_value(tokens[:NUM_DRAWS], masked.softmax(-1)) > 1e-3
    assert set(tokens[:NUM_DRAWS].tolist()) == set(allowed)
    assert tokens[-2] == 1 and tokens[-1] == 2  # best allowed; the unrestricted row untouched
    values = processed_values(LOGITS.expand(2, -1), params[-2:])
    assert torch.equal(values[0], masked) and torch.equal(values[1], LOGITS)


def test_logit_bias_is_added_to_the_logits() -> None:
    bias = {5: 4.0, 2: -3.0, 0: 0.25}
    params = [SamplingParams(temperature=0.0, logit_bias=bias), SamplingParams(temperature=0.0)]
    values = processed_values(LOGITS.expand(2, -1), params)
    expected = LOGITS.clone()
    for token, amount in bias.items():
        expected[token] += amount
    torch.testing.assert_close(values[0], expected)
    assert torch.equal(values[1], LOGITS)
    tokens = sample(LOGITS.expand(2, -1), make_inputs(params)).token_ids.tolist()
    assert tokens == [5, 2]  # -1.4 + 4 beats the rest; the other row keeps its argmax


def test_logit_bias_moves_the_distribution() -> None:
    torch.manual_seed(1)
    params = [SamplingParams(temperature=0.8, logit_bias={3: 2.5, 7: -1.0})] * NUM_DRAWS
    tokens = sample(LOGITS.expand(NUM_DRAWS, -1), make_inputs(params)).token_ids
    biased = LOGITS.clone()
    biased[3] += 2.5
    biased[7] -= 1.0
    assert chi_square_p_value(tokens, reference_probs(biased, temperature=0.8)) > 1e-3


def reference_bad_words(
    logits: list[float], words: list[list[int]], output: list[int]
) -> list[float]:
    """vLLM's rule, word by word: ban the last token when the output ends with the rest."""
    out = list(logits)
    for word in words:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            out[word[-1]] = -math.inf
    return out


def test_bad_words_match_the_reference() -> None:
    gen = torch.Generator().manual_seed(4)
    vocab, banned_some = 6, 0
    for trial in range(60):
        params, outputs, expected = [], [], []
        logits = torch.randn(5, vocab, generator=gen)
        for row in range(5):
            output = torch.randint(vocab, (int(torch.randint(0, 5, (1,), generator=gen)),),
                                   generator=gen).tolist()  # fmt: skip
            words = [torch.randint(vocab, (int(torch.randint(1, 4, (1,), generator=gen)),),
                                   generator=gen).tolist() for _ in range(row % 3)]  # fmt: skip
            if output and row == 4:  # one word certain to match
                words.append([*output[-2:], (output[-1] + 1) % vocab])
            bad = ["w"] * len(words) or None
            params.append(SamplingParams(temperature=0.0, bad_words=bad,
                                         _bad_words_token_ids=words or None))  # fmt: skip
            outputs.append(output)
            expected.append(reference_bad_words(logits[row].tolist(), words, output))
        values = processed_values(logits, params, outputs=outputs)
        assert torch.equal(values, torch.tensor(expected)), trial
        banned_some += int(values.isinf().sum())
    assert banned_some > 50


def test_logprobs_minus_one_gives_the_whole_vocabulary() -> None:
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0.0, logprobs=-1), SamplingParams(logprobs=2)]
    out = sample(logits, make_inputs(params))
    assert len(out.logprobs[0]) == 40 and len(out.logprobs[1]) <= 3
    raw = torch.log_softmax(logits[0], -1)
    ranks = {token: lp.rank for token, lp in out.logprobs[0].items()}
    assert sorted(ranks.values()) == list(range(1, 41))
    for token, logprob in out.logprobs[0].items():
        assert logprob.logprob == pytest.approx(float(raw[token]), abs=1e-6)
        assert logprob.rank == 1 + int((raw > raw[token]).sum())


def test_each_logprobs_mode_reads_its_own_distribution() -> None:
    """One batch, one row per mode: raw values ignore penalties and temperature; processed
    values are what the token was drawn from (penalty, temperature, top-k cut)."""
    vocab = 16
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(6)).expand(4, -1)
    knobs = dict(temperature=0.5, top_k=4, repetition_penalty=1.5, logprobs=-1, seed=3)
    modes = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
    params = [SamplingParams(**knobs, logprobs_mode=mode) for mode in modes]
    prompts = [[1, 2]] * 4
    out = sample(logits, make_inputs(params, prompts=prompts))
    penalised = torch.tensor(reference_penalties(logits[0].tolist(), [1, 2], [], params[0]))
    tempered = penalised / 0.5
    kth = tempered.topk(4).values[-1]
    processed = tempered.masked_fill(tempered < kth, -math.inf)
    expected = {
        "raw_logprobs": torch.log_softmax(logits[0], -1),
        "raw_logits": logits[0],
        "processed_logprobs": torch.log_softmax(processed, -1),
        "processed_logits": processed,
    }
    for row, mode in enumerate(modes):
        entry = out.logprobs[row]
        values = torch.tensor([entry[t].logprob for t in range(vocab)])
        torch.testing.assert_close(values, expected[mode], msg=mode)
        chosen = int(out.token_ids[row])
        assert entry[chosen].rank == 1 + int((expected[mode] > expected[mode][chosen]).sum())
        assert torch.isfinite(processed[chosen])  # drawn from what the cut left


def test_processed_logprobs_of_greedy_rows_skip_temperature() -> None:
    """As vLLM: a greedy row picks from the biased, penalised logits, with no temperature."""
    params = [SamplingParams(temperature=0.0, top_k=3, presence_penalty=1.0, logit_bias={1: 1.0},
                             logprobs=-1, logprobs_mode="processed_logprobs")]  # fmt: skip
    out = sample(LOGITS[None], make_inputs(params, outputs=[[2]]))
    expected = LOGITS.clone()
    expected[1] += 1.0
    expected[2] -= 1.0
    values = torch.tensor([out.logprobs[0][t].logprob for t in range(len(LOGITS))])
    torch.testing.assert_close(values, torch.log_softmax(expected, -1))


def test_top_p_weighs_what_min_p_left() -> None:
    """vLLM's order: min-p first, then top-p over the renormalised rest. min_p=0.3 keeps the
    logits >= 2.0 + ln 0.3 = 0.80: tokens 2, 7, 0, 4, with shares 0.41, 0.27, 0.18, 0.14;
    top_p=0.8 then drops token 4 (0.86 of the mass comes before it). Over the full
    distribution only 0.73 comes before token 4, so the other order would keep it."""
    torch.manual_seed(2)
    knobs = dict(min_p=0.3, top_p=0.8)
    params = [SamplingParams(**knobs)] * NUM_DRAWS
    tokens = sample(LOGITS.expand(NUM_DRAWS, -1), make_inputs(params)).token_ids
    expected = reference_probs(LOGITS, **knobs)
    assert set(expected.nonzero().flatten().tolist()) == {2, 7, 0}
    assert set(tokens.tolist()) == {2, 7, 0}
    assert chi_square_p_value(tokens, expected) > 1e-3


def test_rows_without_the_new_knobs_are_left_alone() -> None:
    """A batch that uses none of allowed_token_ids, bad_words, logit_bias, min_tokens or the
    penalties: process_logits hands back the same tensor, unchanged."""
    logits = torch.randn(3, 10)
    before = logits.clone()
    inputs = make_inputs([SamplingParams(), SamplingParams(temperature=0.0)] * 1 + [
        SamplingParams(top_k=2)], outputs=[[1, 2]] * 3)  # fmt: skip
    assert process_logits(logits, inputs) is logits
    assert torch.equal(logits, before)


# -- top-k / top-p without a full sort: the sort-based floor is the oracle ----------------


def _kept(logits: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    return logits >= floor


def _candidate_floor(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
    num_candidates = max(sampler.TOP_P_CANDIDATES, 0 if k is None else int(k.max()))
    top = logits.topk(min(logits.shape[1], num_candidates), dim=-1).values
    return sampler._top_k_top_p_floor(logits.clone(), top, k, p)


def _adversarial_rows(vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Flat, peaked, heavy-tailed, tied, partly -inf, and rows whose mass is spread over far
    more tokens than the candidates."""
    flat = torch.zeros(vocab)
    peaked = torch.randn(vocab, generator=generator) * 8
    heavy = torch.randn(vocab, generator=generator) * 0.5
    ties = torch.randint(0, 4, (vocab,), generator=generator).float()
    masked = torch.randn(vocab, generator=generator) * 2
    masked[torch.rand(vocab, generator=generator) < 0.7] = -math.inf
    one_left = torch.full((vocab,), -math.inf)
    one_left[7] = 0.0
    return torch.stack([flat, peaked, heavy, ties, masked, one_left])


@pytest.mark.parametrize("top_p", [0.01, 0.3, 0.5, 0.9, 0.999, 0.9999999, 1.0])
@pytest.mark.parametrize("top_k", [0, 1, 5, 50, 300])
def test_candidate_top_p_keeps_the_sorted_set(top_p, top_k):
    generator = torch.Generator().manual_seed(top_k * 1000 + int(top_p * 1e6))
    logits = _adversarial_rows(4096, generator)
    rows = logits.shape[0]
    k = torch.full((rows, 1), top_k) if top_k else None
    p = torch.full((rows, 1), top_p if top_p < 1.0 else math.inf)
    fast = _candidate_floor(logits, k, p)
    oracle = sampler._top_k_top_p_floor_sorted(logits.clone(), k, p)
    for row in range(rows):
        kept, expected = _kept(logits[row], fast[row]), _kept(logits[row], oracle[row])
        if not torch.equal(kept, expected):
            # only a token whose preceding mass is p up to float rounding may differ
            probs = logits[row].softmax(-1).double()
            order = probs.argsort(descending=True)
            mass_before = probs[order].cumsum(0) - probs[order]
            differing = (kept != expected).nonzero().squeeze(-1)
            position = {int(t): i for i, t in enumerate(order.tolist())}
            for token in differing.tolist():
                assert abs(float(mass_before[position[token]]) - top_p) < 1e-5, (row, token)


def test_mixed_rows_on_and_off_and_rows_past_the_candidates():
    """Top-p off (inf) on some rows, on others a p whose set needs far more than the
    candidates (a flat row of 4,096 tokens at p = 0.9 keeps ~3,687)."""
    logits = torch.stack([torch.zeros(4096), torch.randn(4096) * 6, torch.zeros(4096)])
    p = torch.tensor([[0.9], [0.5], [math.inf]])
    k = torch.tensor([[0], [20], [3]])
    fast = _candidate_floor(logits, k, p)
    oracle = sampler._top_k_top_p_floor_sorted(logits.clone(), k, p)
    assert torch.equal(_kept(logits, fast), _kept(logits, oracle))
    assert int(_kept(logits, fast)[0].sum()) == 4096  # flat row: ties at the floor stay
    assert int(_kept(logits, fast)[2].sum()) == 4096  # top-k of 3 in a flat row keeps ties


def test_draws_among_candidates_match_the_filtered_distribution():
    """Rows whose kept set lies within the candidates draw among them: the frequencies follow
    the filtered, renormalized probabilities (and a row past the candidates in the same batch
    still draws over the whole row)."""
    generator = torch.Generator().manual_seed(5)
    peaked = torch.randn(1000, generator=generator) * 4
    flat = torch.zeros(1000)
    params = [SamplingParams(temperature=1.0, top_p=0.8, top_k=20),
              SamplingParams(temperature=1.0, top_p=0.9)]  # fmt: skip
    draws = 20000
    logits = torch.stack([peaked, flat]).repeat(draws, 1)
    tokens = sampler._sample_random(logits.clone(), params * draws, [None] * 2 * draws, False)
    floor = _candidate_floor(
        torch.stack([peaked, flat]), torch.tensor([[20], [0]]), torch.tensor([[0.8], [0.9]])
    )
    expected = torch.stack([peaked, flat]).masked_fill(torch.stack([peaked, flat]) < floor,
                                                       -math.inf).softmax(-1)  # fmt: skip
    counts = torch.bincount(tokens[0::2], minlength=1000).double() / draws
    assert set(tokens[0::2].tolist()) <= set((expected[0] > 0).nonzero().squeeze(-1).tolist())
    assert (counts - expected[0].double()).abs().max() < 0.015
    assert len(set(tokens[1::2].tolist())) > 600  # the flat row keeps ~900 tokens


@pytest.mark.parametrize("min_p", [0.001, 0.05, 0.5])
@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (0, 0.9), (50, 1.0), (50, 0.5), (0, 0.5)])
def test_min_p_from_the_candidates_keeps_the_reference_set(min_p, top_k, top_p):
    """Min-p's floor comes from the candidates (no pass over the row), and top-p weighs what
    it left within the candidates, or over the whole row where its set reaches past them (the
    flat row keeps all 4,096 tokens): the kept set is the float64 reference's, up to a token
    whose preceding mass is p within float rounding, or one tied with the last kept (a floor
    keeps ties, as the sort-based floor does; the reference breaks them by position)."""
    generator = torch.Generator().manual_seed(int(min_p * 1000) + top_k)
    logits = _adversarial_rows(4096, generator)
    params = [SamplingParams(min_p=min_p, top_k=top_k, top_p=top_p)] * len(logits)
    kept = sampler.filter_logits(logits.clone(), params) > -math.inf
    for row in range(len(logits)):
        expected = reference_probs(logits[row], top_k=top_k, top_p=top_p, min_p=min_p) > 0
        differing = (kept[row] != expected).nonzero().squeeze(-1).tolist()
        if not differing:
            continue
        probs = reference_probs(logits[row], top_k=top_k, min_p=min_p)  # what top-p weighs
        order = probs.argsort(descending=True)
        mass_before = probs[order].cumsum(0) - probs[order]
        position = {int(t): i for i, t in enumerate(order.tolist())}
        last_kept = logits[row][expected].min()
        for token in differing:
            tied = bool(logits[row][token] == last_kept)
            assert tied or abs(float(mass_before[position[token]]) - top_p) < 1e-5, (row, token)
    assert bool(kept[0].all())  # the flat row: min-p's set is the whole row, and all tie


def test_rows_sampled_in_chunks_equal_one_pass(monkeypatch):
    """On CPU a large batch is sampled a few rows at a time (its temporaries stay under the
    mmap threshold): greedy rows, seeded rows, penalties and logprobs come out as in one pass."""
    vocab = 500
    logits = torch.randn(10, vocab, generator=torch.Generator().manual_seed(4)) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.8, seed=1),
        SamplingParams(temperature=1.0, min_p=0.1, seed=2, logprobs=1),
        SamplingParams(temperature=0.7, top_k=20, seed=3, repetition_penalty=1.2),
        SamplingParams(temperature=0.0),
    ] * 2

    def run() -> tuple[list[int], list]:
        generators = [
            None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params
        ]
        inputs = make_inputs(params, outputs=[[1, 2, 3]] * 10, generators=generators)
        out = sample(logits, inputs)
        return out.token_ids.tolist(), out.logprobs

    whole = run()
    monkeypatch.setattr(sampler, "SAMPLE_CHUNK_BYTES", 4 * vocab * 3)  # 3 rows a chunk
    assert run() == whole


# -- the CPU kernel's draw: the sort-based floor and an inverse CDF are the oracle -----------

KERNEL_MIXES = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.0, 50, 1.0, 0.0), (1.3, 0, 1.0, 0.05),
    (0.8, 100, 0.95, 0.02), (1.0, 5, 0.5, 0.0), (1.0, 0, 0.999, 0.0),
    (1.0, 300, 0.9999999, 0.001), (2.0, 1, 0.3, 0.0), (0.5, 0, 0.01, 0.5),
]  # fmt: skip


@needs_cpu_kernels
@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), KERNEL_MIXES)
def test_kernel_draws_the_sorted_sets_inverse_cdf(temperature, top_k, top_p, min_p):
    """On flat, peaked, heavy-tailed, tied, partly -inf and one-token rows: at the middle of
    each kept token's interval of the kept mass (vocabulary order), the kernel draws exactly
    that token, so its kept set and weights are the sort-based floor's. Rows where some token's
    preceding mass is p within float rounding are only checked to draw kept tokens."""
    generator = torch.Generator().manual_seed(top_k * 7 + int(top_p * 1000))
    logits = _adversarial_rows(2048, generator)
    scaled = logits / temperature
    rows = len(logits)
    k = torch.full((rows, 1), top_k) if top_k else None
    p = torch.full((rows, 1), top_p if top_p < 1.0 else math.inf)
    min_floor = scaled.max(-1, keepdim=True).values + math.log(min_p) if min_p else None
    floor = sampler._top_k_top_p_floor_sorted(scaled.clone(), k, p, min_floor)
    checked = 0
    for row in range(rows):
        kept = (scaled[row] >= floor[row]) & (scaled[row] > -math.inf)
        weights = (scaled[row].double() - scaled[row].max()).exp() * kept
        cdf = weights.cumsum(0) / weights.sum()
        tokens = kept.nonzero().squeeze(-1)
        before = torch.cat([torch.zeros(1, dtype=torch.float64), cdf[tokens][:-1]])
        wide = (cdf[tokens] - before) > 1e-4
        middles = ((before + cdf[tokens]) / 2)[wide]
        if len(middles) == 0:
            continue
        drawn = cpu_kernel.sample_rows(
            logits[row].expand(len(middles), -1).contiguous(), [temperature] * len(middles),
            [top_k] * len(middles), [top_p] * len(middles), [min_p] * len(middles),
            middles.float(),
        )  # fmt: skip
        assert drawn is not None
        if top_p < 1.0:  # what top-p weighs: min-p's and top-k's set
            left_set = scaled[row] > -math.inf
            if min_floor is not None:
                left_set &= scaled[row] >= min_floor[row]
            if k is not None:
                left_set &= scaled[row] >= scaled[row].topk(top_k).values[-1]
            left = (scaled[row].double() - scaled[row].max()).exp() * left_set
            ordered = (left / left.sum()).sort(descending=True).values
            mass_before = ordered.cumsum(0) - ordered
            if bool(((mass_before - top_p).abs() < 1e-5).any()):
                assert bool(kept[drawn].all()), row
                continue
        assert drawn.tolist() == tokens[wide].tolist(), row
        checked += 1
    assert checked >= 1  # the exact comparison ran


@needs_cpu_kernels
def test_kernel_argmax_is_torchs_first_argmax():
    """Greedy batches take the kernel's argmax on CPU: torch's answer, ties to the first index
    (rows of one value, of a repeated maximum, of -inf but one, and lengths off the vector
    width)."""
    for vocab in (1, 15, 16, 17, 1000):
        logits = argmax_rows_to_check(vocab)
        assert cpu_kernel.argmax_rows(logits).tolist() == logits.argmax(-1).tolist()


def argmax_rows_to_check(vocab: int) -> torch.Tensor:
    """Rows of one value, of a repeated maximum, of -inf but one, and with the only maximum
    last (past every whole vector) or at the first lane of a later vector."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randint(-3, 3, (11, vocab), generator=generator).float()
    logits[0] = 0.0
    logits[1] = -math.inf
    logits[1, vocab // 2] = 1.0
    logits[2, vocab - 1] = 5.0
    logits[3, min(8, vocab - 1)] = 5.0  # the second vector's first lane: AVX2
    logits[4, min(16, vocab - 1)] = 5.0  # and AVX-512
    return logits


@needs_cpu_kernels
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction-set levels")
@pytest.mark.parametrize("march", ["haswell", "x86-64"])  # AVX2; SSE2 only
def test_the_sampling_kernel_built_for_older_x86_draws_the_same_tokens(older_x86_kernels, march):
    """Without AVX-512 the kernel's max and candidate passes run as plain loops: the same
    tokens as the native build, for every mix, on ordinary rows."""
    library = older_x86_kernels(march)
    library.sample_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    *[ctypes.c_void_p] * 7, ctypes.c_int]  # fmt: skip
    library.sample_rows.restype = None
    library.argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_int]  # fmt: skip
    library.argmax_rows.restype = None
    for argmax_vocab in (15, 16, 17, 1000):
        greedy = argmax_rows_to_check(argmax_vocab)
        argmax = torch.empty(greedy.shape[0], dtype=torch.int64)
        library.argmax_rows(greedy.data_ptr(), greedy.shape[0], argmax_vocab, argmax.data_ptr(), 1)
        assert argmax.tolist() == greedy.argmax(-1).tolist(), (march, argmax_vocab)
    rows, vocab = 64, 3001
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(8)) * 3
    uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(9))
    for temperature, top_k, top_p, min_p in KERNEL_MIXES:
        columns = [torch.full((rows,), temperature), torch.full((rows,), top_k),
                   torch.full((rows,), top_p), torch.full((rows,), min_p)]  # fmt: skip
        tokens = torch.empty(rows, dtype=torch.int64)
        scratch = torch.empty(2 * vocab * cpu_kernel.SAMPLING_CANDIDATE_BYTES, dtype=torch.uint8)
        library.sample_rows(
            logits.data_ptr(), rows, vocab, *(c.data_ptr() for c in columns),
            uniforms.data_ptr(), tokens.data_ptr(), scratch.data_ptr(), 1,
        )  # fmt: skip
        native = cpu_kernel.sample_rows(
            logits, [temperature] * rows, [top_k] * rows, [top_p] * rows, [min_p] * rows, uniforms
        )
        assert tokens.tolist() == native.tolist(), (temperature, top_k, top_p, min_p)


@needs_cpu_kernels
@pytest.mark.parametrize(
    "knobs",
    [dict(top_p=0.9), dict(top_k=20, temperature=0.7), dict(min_p=0.05, top_p=0.95),
     dict(temperature=1.3)],
)  # fmt: skip
def test_a_seeded_row_draws_the_same_tokens_with_logprobs_on_or_off(knobs):
    """Asking for logprobs sends a row through the torch ops instead of the C kernel: both
    draw in vocabulary order at the row's uniform, so the tokens are the same."""
    vocab = 2000
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(11)) * 3

    def tokens(logprobs: int | None) -> list[int]:
        params = SamplingParams(seed=5, logprobs=logprobs, **knobs)
        generator = torch.Generator().manual_seed(5)
        return [
            int(sample(row[None], make_inputs([params], generators=[generator])).token_ids[0])
            for row in logits
        ]

    assert sampler._kernel_rows(logits[:1], make_inputs([SamplingParams(**knobs)])) == [0]
    assert tokens(None) == tokens(1)


@needs_cpu_kernels
def test_the_callers_all_plain_hint_changes_no_row_and_no_token():
    """`all_plain` (the engine core knows no unfinished request needs more than the C
    sampler) skips the per-row look; the rows and the seeded draws are those the look gives,
    and a row under min_tokens (stop ids blocked) still goes the torch way."""
    vocab = 500
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * 3
    params = [
        SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, top_k=40, seed=2), SamplingParams(top_p=0.7, seed=3),
        SamplingParams(min_p=0.1, seed=4), SamplingParams(temperature=0.5, top_k=1, seed=5),
    ]  # fmt: skip

    def run(all_plain: bool | None, block: list[list[int]] | None = None):
        generators = [torch.Generator().manual_seed(p.seed or 0) for p in params]
        inputs = dataclasses.replace(
            make_inputs(params, generators=generators, block=block), all_plain=all_plain
        )
        return sampler._kernel_rows(logits, inputs), sample(logits, inputs).token_ids.tolist()

    assert run(True) == run(None) and run(True)[0] == list(range(len(params)))
    blocked = [[], [], [7], [], [], []]
    assert run(True, blocked) == run(None, blocked) and 2 not in run(True, blocked)[0]
    assert make_inputs(params).select([0, 2]).all_plain is None
    selected = dataclasses.replace(make_inputs(params), all_plain=True).select([0, 2])
    assert selected.all_plain is True
    # The torch path (a GPU's) takes the hint too: no pass to find what processes the logits.
    assert not modifies_logits(selected)
    assert modifies_logits(dataclasses.replace(selected, stop_token_ids_to_block=[[7], []]))
    torch_tokens = [sampler._sample_in_torch(logits, dataclasses.replace(
        make_inputs(params, generators=[torch.Generator().manual_seed(p.seed or 0)
                                        for p in params]), all_plain=hint)).token_ids.tolist()
        for hint in (True, None)]  # fmt: skip
    assert torch_tokens[0] == torch_tokens[1]


@needs_cpu_kernels
def test_the_kernel_draws_from_extreme_logits_without_hanging():
    """Huge scaled logits (a temperature of 1e-5), +inf, NaN and all -inf rows: a token comes
    back from each (where the threshold cannot step lower, the candidates are the whole row)."""
    vocab = 300
    rows = torch.randn(5, vocab, generator=torch.Generator().manual_seed(2)) * 500
    rows[1, 7] = math.inf
    rows[2, 3] = math.nan
    rows[3] = -math.inf
    rows[4, :] = 1e30
    for top_k, top_p in ((50, 1.0), (0, 0.9), (5, 0.5)):
        drawn = cpu_kernel.sample_rows(
            rows, [1e-5] * 5, [top_k] * 5, [top_p] * 5, [0.0] * 5, torch.full((5,), 0.5)
        )
        assert drawn is not None and bool(((drawn >= 0) & (drawn < vocab)).all())
        assert int(drawn[0]) == int(rows[0].argmax())  # at T = 1e-5 the max takes it all
        assert int(drawn[1]) == 7


@needs_cpu_kernels
def test_a_nan_after_the_max_does_not_hide_it():
    """The row max skips NaN, as the kernel's scalar loop does, in every vector lane: a NaN in
    the max's lane of a later vector (16 and 8 tokens on) must not reset that lane's max."""
    logits = torch.full((3, 1000), -5.0)
    logits[:, 40] = 9.0
    for row, nan_at in enumerate((56, 48, 999)):
        logits[row, nan_at] = math.nan
    assert cpu_kernel.argmax_rows(logits).tolist() == [40, 40, 40]
    drawn = cpu_kernel.sample_rows(
        logits, [1e-3] * 3, [5] * 3, [1.0] * 3, [0.0] * 3, torch.full((3,), 0.5)
    )
    assert drawn.tolist() == [40, 40, 40]


# -- structured outputs: a grammar's bitmask -----------------------------------------------------


def test_a_grammar_bitmask_keeps_its_tokens_and_nothing_else() -> None:
    """xgrammar's layout (bit i % 32 of int32 word i // 32), the sign bit included; rows
    without a bitmask, and the input, untouched; every row samples within its mask."""
    vocab = 70  # three words, the last one partly past the vocab
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=generator)
    allowed = [{0, 31, 32, 63, 69}, None, {5}]
    bitmasks = []
    for tokens in allowed:
        if tokens is None:
            bitmasks.append(None)
            continue
        words = [0, 0, 0]
        for token in tokens:
            words[token // 32] |= 1 << (token % 32)
        # as int32, the way xgrammar stores them (bit 31 makes a word negative)
        bitmasks.append(torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                                     dtype=torch.int32))  # fmt: skip
    grammar = StructuredOutputsParams(regex="a")  # what marks a row as held, as the engine's
    params = [SamplingParams(temperature=0, structured_outputs=grammar),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, seed=1, structured_outputs=grammar)]  # fmt: skip
    inputs = dataclasses.replace(make_inputs(params), grammar_bitmasks=bitmasks)
    processed = process_logits(logits.clone(), inputs)
    for row, tokens in enumerate(allowed):
        finite = set(torch.isfinite(processed[row]).nonzero().flatten().tolist())
        assert finite == (set(range(vocab)) if tokens is None else tokens)
    assert torch.equal(processed[1], logits[1])
    for _ in range(20):
        tokens = sampler.sample(logits, inputs).token_ids.tolist()
        assert tokens[0] in allowed[0] and tokens[2] == 5
        assert tokens[1] == int(logits[1].argmax())
    assert inputs.select([2, 0]).grammar_bitmasks == [bitmasks[2], bitmasks[0]]


@needs_cpu_kernels
def test_the_cpu_grammar_mask_is_xgrammars() -> None:
    """csrc/sample_rows.c's mask_rows against xgrammar's own kernel: bitmasks of whole words
    set or clear (a grammar's usual) and of mixed bits, a vocabulary that ends inside a word,
    rows of the batch left out."""
    xgrammar = pytest.importorskip("xgrammar")
    vocab, words = 1000, 32  # the last word holds 8 tokens
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=generator)
    held = [1, 2, 4]
    kind = torch.randint(0, 3, (len(held), words), generator=generator)
    mixed = torch.randint(-(2**31), 2**31 - 1, (len(held), words), generator=generator,
                          dtype=torch.int32)  # fmt: skip
    bitmask = torch.where(kind == 0, -1, torch.where(kind == 1, 0, mixed)).to(torch.int32)
    ours = logits.clone()
    assert cpu_kernel.mask_rows(ours, held, bitmask)
    theirs = logits.clone()
    every_row = torch.full((6, words), -1, dtype=torch.int32)
    every_row[held] = bitmask
    xgrammar.apply_token_bitmask_inplace(theirs, every_row, indices=held)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[0, 3, 5]], logits[[0, 3, 5]])
