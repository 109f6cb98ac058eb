"""vLLM's sampling fields end to end, through the offline LLM: the stop-token and min_tokens
semantics on the real SmolLM2, and every numeric logprob against HF transformers' logits on a
tiny Llama checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import RequestOutputKind

from helpers import hf_logits

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a small village by the sea, there lived"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        "default", dtype="float32", max_num_batched_tokens=256, max_num_seqs=16, max_logprobs=-1
    )


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def run(llm: LLM, prompt, params: SamplingParams):
    if isinstance(prompt, list):
        return llm.chat(prompt, params, use_tqdm=False)[0].outputs[0]
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


# -- the two behaviour fixes, on the real model ----------------------------------------------


def test_a_stop_token_keeps_its_id_but_not_its_text(llm):
    full = run(llm, PROMPT, greedy(24, ignore_eos=True))
    ids = full.token_ids
    # a word-like token whose first occurrence is well inside the output
    position = next(i for i in range(6, len(ids)) if ids[i] not in ids[:i]
                    and llm.tokenizer.decode([ids[i]]).strip().isalpha())  # fmt: skip
    stop_id = ids[position]
    word = llm.tokenizer.decode([stop_id])
    out = run(llm, PROMPT, greedy(24, ignore_eos=True, stop_token_ids=[stop_id]))
    assert out.token_ids == ids[: position + 1]  # the id stays, as in vLLM
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.text == llm.tokenizer.decode(ids[:position])
    assert not out.text.endswith(word)
    kept = run(llm, PROMPT, greedy(24, ignore_eos=True, stop_token_ids=[stop_id],
                                   include_stop_str_in_output=True))  # fmt: skip
    assert kept.text == llm.tokenizer.decode(ids[: position + 1]) == out.text + word


def test_eos_text_is_left_out_even_when_special_tokens_are_shown(llm):
    out = run(llm, CHAT, greedy(64, skip_special_tokens=False))
    assert out.finish_reason == "stop" and out.token_ids[-1] == llm.tokenizer.eos_token_id
    assert "<|im_end|>" not in out.text and "Paris" in out.text
    kept = run(llm, CHAT, greedy(64, skip_special_tokens=False, include_stop_str_in_output=True))
    assert kept.text == out.text + "<|im_end|>"


def test_stop_strings_wait_for_min_tokens(llm):
    """A stop string may only end in text after the first min_tokens tokens'."""
    full = run(llm, PROMPT, greedy(40, ignore_eos=True))
    early = run(llm, PROMPT, greedy(40, ignore_eos=True, stop=["e"]))
    assert len(early.token_ids) < 15  # without min_tokens "e" comes early
    out = run(llm, PROMPT, greedy(40, ignore_eos=True, stop=["e"], min_tokens=15))
    floor = len(llm.tokenizer.decode(full.token_ids[:15]))
    cut = full.text.index("e", floor)
    assert out.finish_reason == "stop" and out.stop_reason == "e"
    assert len(out.token_ids) > 15
    assert out.text == full.text[:cut]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]


# -- the other fields, on the real model ------------------------------------------------------


def test_bad_words_are_never_generated(llm):
    plain = run(llm, CHAT, greedy(32))
    assert "Paris" in plain.text
    out = run(llm, CHAT, greedy(32, bad_words=["Paris"]))
    assert "Paris" not in out.text
    banned = llm.tokenizer.encode(" Paris", add_special_tokens=False)
    assert banned[0] not in out.token_ids


def test_allowed_token_ids_and_logit_bias(llm):
    allowed = llm.tokenizer.encode(" yes no maybe", add_special_tokens=False)
    out = run(llm, PROMPT, greedy(8, ignore_eos=True, allowed_token_ids=allowed))
    assert set(out.token_ids) <= set(allowed)
    plain = run(llm, PROMPT, greedy(8, ignore_eos=True))
    first = plain.token_ids[0]
    out = run(llm, PROMPT, greedy(8, ignore_eos=True, logit_bias={first: -100}))
    assert first not in out.token_ids
    boosted = allowed[0]
    out = run(llm, PROMPT, greedy(3, ignore_eos=True, logit_bias={boosted: 100}))
    assert out.token_ids == [boosted] * 3


def test_detokenize_false_gives_ids_only(llm):
    with_text = run(llm, PROMPT, greedy(8, ignore_eos=True, logprobs=1))
    out = run(llm, PROMPT, greedy(8, ignore_eos=True, logprobs=1, detokenize=False))
    assert out.text == "" and out.token_ids == with_text.token_ids
    assert all(lp.decoded_token is None for row in out.logprobs for lp in row.values())
    assert all(lp.decoded_token is not None for row in with_text.logprobs for lp in row.values())
    with pytest.raises(ValueError, match="need detokenize=True"):
        greedy(8, stop=["x"], detokenize=False)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = llm.tokenizer.encode(PROMPT)
    (out,) = llm.generate([PROMPT], greedy(6, ignore_eos=True, truncate_prompt_tokens=5),
                          use_tqdm=False)  # fmt: skip
    (reference,) = llm.generate([{"prompt_token_ids": ids[-5:]}], greedy(6, ignore_eos=True),
                                use_tqdm=False)  # fmt: skip
    assert out.prompt_token_ids == ids[-5:]
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids


def test_logprobs_minus_one_cover_the_vocabulary(llm):
    out = run(llm, PROMPT, greedy(2, ignore_eos=True, logprobs=-1))
    vocab = llm.engine.core.runner.model_config.vocab_size
    for token, row in zip(out.token_ids, out.logprobs, strict=True):
        assert len(row) == vocab and row[token].rank == 1
        assert math.fsum(math.exp(lp.logprob) for lp in row.values()) == pytest.approx(1, abs=1e-4)
        assert all(lp.decoded_token is not None for lp in row.values())


def test_output_kinds_through_the_engine(llm):
    """With output_kind=None the engine yields what SamplingParams.output_kind says; an explicit
    output_kind overrides it, as the offline LLM's FINAL_ONLY does: LLM.generate returns whole
    final outputs whatever the params say."""
    engine: LLMEngine = llm.engine
    ids = llm.tokenizer.encode(PROMPT)
    expected = run(llm, PROMPT, greedy(5, ignore_eos=True))
    for kind in RequestOutputKind:
        out = run(llm, PROMPT, greedy(5, ignore_eos=True, output_kind=kind))
        assert (out.token_ids, out.text) == (expected.token_ids, expected.text)
    for kind, override, count in [
        (RequestOutputKind.DELTA, None, 5),
        (RequestOutputKind.CUMULATIVE, None, 5),
        (RequestOutputKind.FINAL_ONLY, None, 1),
        (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY, 1),
    ]:
        params = greedy(5, ignore_eos=True, output_kind=kind)
        engine.add_request(f"kind-{kind.name}-{override}", ids, params, output_kind=override)
        outputs = []
        while engine.has_unfinished_requests():
            outputs.extend(engine.step())
        assert len(outputs) == count
        final = outputs[-1].outputs[0]
        if kind is RequestOutputKind.DELTA and override is None:
            assert [t for o in outputs for t in o.outputs[0].token_ids] == expected.token_ids
            assert "".join(o.outputs[0].text for o in outputs) == expected.text
        else:
            assert (final.token_ids, final.text) == (expected.token_ids, expected.text)


# -- numbers against HF's logits (tiny Llama, token ids only) ---------------------------------

PROMPT_IDS = [5, 77, 12, 190, 3, 41, 250, 9]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    folder, hf_model = tiny_llama
    return LLM(folder, dtype="float32", skip_tokenizer_init=True, max_logprobs=-1), hf_model


def generate_ids(llm: LLM, params: SamplingParams):
    return llm.generate([{"prompt_token_ids": PROMPT_IDS}], params, use_tqdm=False)[0]


def step_logits(hf_model, output_ids: list[int]) -> torch.Tensor:
    """HF's logits at every position that produced an output token."""
    logits = hf_logits(hf_model, PROMPT_IDS + output_ids)
    return logits[len(PROMPT_IDS) - 1 : len(PROMPT_IDS) - 1 + len(output_ids)]


def values(row: dict, vocab: int) -> torch.Tensor:
    return torch.tensor([row[t].logprob for t in range(vocab)])


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(actual))
    scale = float(expected[finite].abs().max())
    torch.testing.assert_close(actual[finite], expected[finite], atol=1e-4 * scale, rtol=0)


def test_raw_logits_mode_returns_hfs_logits(tiny):
    llm, hf_model = tiny
    out = generate_ids(llm, greedy(6, ignore_eos=True, logprobs=-1, logprobs_mode="raw_logits"))
    completion = out.outputs[0]
    reference = step_logits(hf_model, completion.token_ids)
    vocab = reference.shape[1]
    for position, row in enumerate(completion.logprobs):
        close(values(row, vocab), reference[position])
        assert len(row) == vocab


def test_processed_logits_add_the_bias_and_the_penalty(tiny):
    """Greedy: what was picked from is HF's logits + logit_bias - presence penalty on the output
    so far; the picked token is its argmax."""
    llm, hf_model = tiny
    bias = {7: 3.0, 100: -2.0, 5: 1.5}
    params = greedy(6, ignore_eos=True, logprobs=-1, logprobs_mode="processed_logits",
                    logit_bias=bias, presence_penalty=0.8)  # fmt: skip
    completion = generate_ids(llm, params).outputs[0]
    reference = step_logits(hf_model, completion.token_ids)
    for position, row in enumerate(completion.logprobs):
        expected = reference[position].clone()
        for token, amount in bias.items():
            expected[token] += amount
        for token in set(completion.token_ids[:position]):
            expected[token] -= 0.8
        close(values(row, expected.shape[0]), expected)
        assert completion.token_ids[position] == int(expected.argmax())


def test_processed_logprobs_are_what_the_draw_used(tiny):
    """Random sampling: log_softmax of HF's logits / temperature after the top-k cut, -inf
    outside it; the drawn token is inside."""
    llm, hf_model = tiny
    params = SamplingParams(temperature=0.7, top_k=5, seed=11, max_tokens=6, ignore_eos=True,
                            logprobs=-1, logprobs_mode="processed_logprobs")  # fmt: skip
    completion = generate_ids(llm, params).outputs[0]
    reference = step_logits(hf_model, completion.token_ids) / 0.7
    for position, row in enumerate(completion.logprobs):
        scaled = reference[position]
        kth = scaled.topk(5).values[-1]
        expected = torch.log_softmax(scaled.masked_fill(scaled < kth, -math.inf), -1)
        close(values(row, scaled.shape[0]), expected)
        assert math.isfinite(row[completion.token_ids[position]].logprob)


def test_allowed_token_ids_pick_hfs_best_allowed(tiny):
    llm, hf_model = tiny
    allowed = [3, 40, 41, 299, 150]
    completion = generate_ids(llm, greedy(6, ignore_eos=True, allowed_token_ids=allowed))
    completion = completion.outputs[0]
    reference = step_logits(hf_model, completion.token_ids)
    for position, token in enumerate(completion.token_ids):
        assert token == allowed[int(reference[position, allowed].argmax())]


def test_prompt_logprobs_minus_one_are_hfs_log_softmax(tiny):
    llm, hf_model = tiny
    out = generate_ids(llm, greedy(1, prompt_logprobs=-1))
    reference = torch.log_softmax(hf_logits(hf_model, PROMPT_IDS), -1)
    assert out.prompt_logprobs[0] is None
    for position in range(1, len(PROMPT_IDS)):
        row = out.prompt_logprobs[position]
        assert len(row) == reference.shape[1]
        close(values(row, reference.shape[1]), reference[position - 1])
