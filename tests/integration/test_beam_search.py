"""LLM.beam_search against a brute-force reference: the same search written directly over HF
transformers' full-vocabulary logprobs (a whole forward per beam, no cache, no batching)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from tandem import LLM, BeamSearchParams, SamplingParams
from tandem.beam_search import beam_search_score

from helpers import hf_logits, random_prompts

EOS = 2  # the tiny Llama's eos_token_id


def reference_beam_search(
    model, prompt: list[int], params: BeamSearchParams, eos: int | None
) -> list[tuple[list[int], float]]:
    """vLLM's algorithm with exact logprobs: each beam's top 2 * beam_width tokens extend it,
    EOS ends it, the beam_width best by score live on; finished and live beams ranked last."""

    def score(beam: tuple[list[int], float]) -> float:
        return beam_search_score(beam[0], beam[1], eos, params.length_penalty)

    beams, completed = [(list(prompt), 0.0)], []
    for _ in range(params.max_tokens):
        children = []
        for tokens, cum in beams:
            logprobs = torch.log_softmax(hf_logits(model, tokens)[-1].double(), dim=-1)
            top = logprobs.topk(2 * params.beam_width)
            for token, logprob in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                child = ([*tokens, token], cum + logprob)
                (completed if token == eos else children).append(child)
        beams = sorted(children, key=score, reverse=True)[: params.beam_width]
    return sorted(completed + beams, key=score, reverse=True)[: params.beam_width]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    folder, model = tiny_llama
    return LLM(folder, skip_tokenizer_init=True, dtype="float32"), model  # HF reference: fp32


@pytest.mark.parametrize(
    "params",
    [
        BeamSearchParams(beam_width=3, max_tokens=5),
        BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=0.5),
        BeamSearchParams(beam_width=4, max_tokens=4, ignore_eos=True, length_penalty=2.0),
    ],
    ids=["width3", "width2-lp0.5", "width4-ignore-eos-lp2"],
)
def test_beam_search_equals_brute_force_reference(tiny, params):
    llm, model = tiny
    prompts = random_prompts(3, 320, 3, 12, seed=11)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    eos = None if params.ignore_eos else EOS
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = reference_beam_search(model, prompt, params, eos)
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
        for sequence, (_, cum) in zip(output.sequences, expected, strict=True):
            assert sequence.tokens[: len(prompt)] == prompt  # tokens include the prompt
            assert sequence.cum_logprob == pytest.approx(cum, rel=1e-4, abs=1e-4)
            generated = sequence.tokens[len(prompt) :]
            assert len(sequence.logprobs) == len(generated)
            assert sum(row[t].logprob for t, row in zip(generated, sequence.logprobs,
                                                        strict=True)) == pytest.approx(
                sequence.cum_logprob, abs=1e-5)  # fmt: skip
            assert sequence.text is None  # no tokenizer
        scores = [beam_search_score(s.tokens, s.cum_logprob, eos, params.length_penalty)
                  for s in output.sequences]  # fmt: skip
        assert scores == sorted(scores, reverse=True)
    assert not llm.llm_engine.has_unfinished_requests()


def test_one_step_beams_are_the_top_tokens(tiny):
    llm, model = tiny
    prompt = [7, 8, 9, 10]
    params = BeamSearchParams(beam_width=5, max_tokens=1, ignore_eos=True)
    (output,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
    top = torch.log_softmax(hf_logits(model, prompt)[-1], dim=-1).topk(5)
    assert [s.tokens[-1] for s in output.sequences] == top.indices.tolist()
    for sequence, logprob in zip(output.sequences, top.values.tolist(), strict=True):
        assert sequence.cum_logprob == pytest.approx(logprob, abs=1e-4)
        assert sequence.finish_reason == "length"


def test_beam_width_is_bounded_by_max_logprobs(tiny):
    llm, _ = tiny
    with pytest.raises(ValueError, match="logprobs=22 is more than max_logprobs=20"):
        llm.beam_search([{"prompt_token_ids": [5, 6]}], BeamSearchParams(11, 3))
    with pytest.raises(ValueError, match="beam_width must be an int >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=3)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        llm.beam_search([{"prompt_token_ids": []}], BeamSearchParams(2, 3))
    assert not llm.llm_engine.has_unfinished_requests()


def test_beams_stop_at_max_model_len(tiny_llama):
    folder, _ = tiny_llama
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, max_model_len=12)
    params = BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True)
    (output,) = llm.beam_search([{"prompt_token_ids": list(range(3, 13))}], params)
    assert all(len(s.tokens) == 12 for s in output.sequences)


@pytest.mark.slow
def test_beam_search_text_on_smollm2():
    llm = LLM("default", dtype="float32", kv_cache_memory=256 << 20, max_model_len=1024)
    prompt = "The capital of France is"
    (output,) = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6))
    (greedy,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    best = output.sequences[0]
    assert best.text.startswith(prompt)  # vLLM's text: the prompt and the continuation
    assert best.text == llm.get_tokenizer().decode(best.tokens)
    assert "Paris" in best.text
    # The best beam is at least as likely as the greedy path of the same length.
    greedy_path = llm.generate(
        {"prompt_token_ids": greedy.prompt_token_ids},
        SamplingParams(temperature=0, max_tokens=6, logprobs=0), use_tqdm=False,
    )[0].outputs[0]  # fmt: skip
    if len(best.tokens) - len(greedy.prompt_token_ids) == len(greedy_path.token_ids):
        assert best.cum_logprob >= greedy_path.cumulative_logprob - 1e-4
    assert math.isfinite(best.cum_logprob)


def test_eos_ends_beams_as_the_reference_does(tiny_llama, tmp_path):
    """A copy of the tiny model whose EOS is a token the search meets: beams ending there are
    finished, and ranked with the live ones at the end."""
    folder, model = tiny_llama
    prompt = [21, 22, 23, 24]
    second_best = torch.log_softmax(hf_logits(model, prompt)[-1], dim=-1).topk(2).indices[1]
    eos = int(second_best)
    for file in folder.iterdir():
        shutil.copy(file, tmp_path / file.name)
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    llm = LLM(tmp_path, skip_tokenizer_init=True, dtype="float32")
    params = BeamSearchParams(beam_width=2, max_tokens=5, length_penalty=0.0)
    (output,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
    expected = reference_beam_search(model, prompt, params, eos)
    assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
    finished = [s for s in output.sequences if s.finish_reason == "stop"]
    assert finished and all(s.tokens[-1] == eos for s in finished)
