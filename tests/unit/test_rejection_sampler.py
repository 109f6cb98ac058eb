"""Verification of drafts: greedy keeps exactly the target's argmax tokens, sampling keeps the
target's distribution (checked by chi-square over many draws), each row is processed with
the drafts before it as output, and seeds reproduce."""

import pytest
import torch

from tandem.sampling_params import SamplingParams
from tandem.worker.rejection_sampler import verify
from tandem.worker.sampler import SamplingInputs, filter_logits, sample

# Chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails
# about once in a thousand seeds, and the seed is fixed.
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def inputs(params: list[SamplingParams], outputs=None, generators=None, blocked=None):
    count = len(params)
    return SamplingInputs(
        params=params,
        prompt_token_ids=[[1]] * count,
        output_token_ids=outputs or [[] for _ in range(count)],
        generators=generators or [None] * count,
        stop_token_ids_to_block=blocked or [[] for _ in range(count)],
    )


def greedy_rows(*argmaxes: int, vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    for row, token in enumerate(argmaxes):
        logits[row, token] = 5.0
    return logits


def test_greedy_accepts_drafts_while_they_equal_the_argmax():
    logits = torch.cat([greedy_rows(3, 4, 6), greedy_rows(1, 2), greedy_rows(5, 5, 7)])
    params = [SamplingParams(temperature=0.0)] * 3
    out = verify(logits, inputs(params), [[3, 5], [1], [5, 5]])
    # Request 0: 3 accepted, 5 rejected (the target says 4). Request 1: all accepted, then the
    # bonus. Request 2: all accepted, bonus 7.
    assert out.token_ids == [[3, 4], [1, 2], [5, 5, 7]]
    assert out.logprobs is None


def test_greedy_first_draft_rejected_emits_the_target_token():
    out = verify(greedy_rows(2, 6), inputs([SamplingParams(temperature=0.0)]), [[0]])
    assert out.token_ids == [[2]]


def test_logits_rows_must_match_the_drafts():
    with pytest.raises(ValueError, match="3 rows"):
        verify(greedy_rows(1, 2), inputs([SamplingParams(temperature=0.0)]), [[1, 2]])


def test_each_row_sees_the_drafts_before_it_as_output():
    """Frequency penalty: the second row counts the first draft, as if it were sampled; the
    oracle is the plain sampler run position by position."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.6], [0.0, 0.0, 0.0, 1.0, 0.6]])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    out = verify(logits, inputs([params], outputs=[[7]]), [[3]])
    first = sample(logits[:1], inputs([params], outputs=[[7]])).token_ids.item()
    second = sample(logits[1:], inputs([params], outputs=[[7, 3]])).token_ids.item()
    assert (first, second) == (3, 4)
    assert out.token_ids == [[3, 4]]


def test_min_tokens_holds_off_eos_drafts():
    eos = 0
    logits = greedy_rows(eos, eos, eos)
    params = SamplingParams(temperature=0.0, min_tokens=2)
    # One output so far: row 0 is the second output (blocked), row 1 the third (free).
    out = verify(logits, inputs([params], outputs=[[5]], blocked=[[eos]]), [[eos, eos]])
    assert out.token_ids[0][0] != eos
    params = SamplingParams(temperature=0.0, min_tokens=3)
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0], [2.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    out = verify(logits, inputs([params], outputs=[[5]], blocked=[[eos]]), [[1, eos]])
    # Row 1 is the third output: EOS still blocked there, so the target says 1, not EOS.
    assert out.token_ids == [[1, 1]]


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    support = expected > 0
    assert counts[~support].sum() == 0, "a token the target rules out was emitted"
    statistic = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
    return float(statistic), int(support.sum()) - 1


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4, top_p=0.9)],
    ids=["plain", "cut"],
)
def test_sampled_tokens_follow_the_target_distribution(params):
    """Many identical requests verify the same two drafts: the first emitted token must follow
    the target's first row, and, given the first draft was accepted, the second token its
    second row, and so on: the same law as sampling without drafts."""
    torch.manual_seed(0)
    num_requests = 20_000
    target = torch.tensor(
        [[1.0, 0.2, 2.0, -1.0, 0.5, 0.0], [0.3, 1.5, 0.1, 1.0, -0.5, 0.2],
         [0.0, 0.4, 0.9, 1.2, 0.1, 1.1]]
    )  # fmt: skip
    drafts = [2, 3]  # likely under row 0, plausible under row 1
    logits = target.repeat(num_requests, 1)
    out = verify(logits, inputs([params] * num_requests), [drafts] * num_requests)
    probs = filter_logits(target.clone(), [params] * 3).softmax(dim=-1)
    emitted = [torch.tensor(tokens) for tokens in out.token_ids]
    for position in range(3):
        # Requests whose drafts before this position were all accepted.
        reached = [t for t in emitted if len(t) > position and t[:position].tolist()
                   == drafts[:position]]  # fmt: skip
        tokens = torch.stack([t[position] for t in reached])
        statistic, degrees = chi_square(tokens, probs[position])
        assert statistic < CHI2_CRITICAL[degrees], (position, statistic, degrees)
    # Acceptance of the first draft happens with its target probability.
    accepted = sum(len(t) > 1 for t in emitted) / num_requests
    assert abs(accepted - probs[0, 2].item()) < 0.02


def test_seeded_requests_reproduce_whatever_their_batch_mates():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=7)

    def run(extra_requests: int) -> list[int]:
        generator = torch.Generator().manual_seed(7)
        others = torch.randn(extra_requests * 2, 50)
        out = verify(
            torch.cat([others, logits]),
            inputs(
                [SamplingParams(temperature=1.0)] * extra_requests + [params],
                generators=[None] * extra_requests + [generator],
            ),
            [[5]] * extra_requests + [[int(logits[0].argmax()), 9]],
        )
        return out.token_ids[-1]

    assert run(0) == run(3) == run(1)


def test_logprobs_of_every_emitted_token():
    logits = torch.cat([greedy_rows(3, 4, 6), greedy_rows(1, 2)])
    params = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.0)]
    out = verify(logits, inputs(params), [[3, 5], [1]])
    assert out.token_ids == [[3, 4], [1, 2]]
    first, second = out.logprobs
    assert second is None
    assert [list(row) for row in first] == [[3], [4]]
    expected = torch.log_softmax(logits[1], dim=-1)[4].item()
    assert first[1][4].logprob == pytest.approx(expected)
    assert first[1][4].rank == 1


def test_a_seeded_request_spends_one_uniform_per_emitted_token():
    """As without speculation: the generator ends as far along as if the emitted tokens had
    been sampled one per step, however many drafts were verified."""
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    generator = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=1.0, seed=5)
    out = verify(logits, inputs([params], generators=[generator]), [[1, 2, 3]])
    reference = torch.Generator().manual_seed(5)
    torch.rand(len(out.token_ids[0]), generator=reference)
    assert torch.equal(generator.get_state(), reference.get_state())
    # And the first token is the one plain sampling draws with that seed.
    plain = sample(logits[:1], inputs([params], generators=[torch.Generator().manual_seed(5)]))
    assert out.token_ids[0][0] == plain.token_ids.item()
