"""Structured outputs on the embedded model (fp32): every reply held to its grammar (a JSON
schema, any JSON, a regex, a choice, an EBNF grammar) ends complete and within it; a held
request changes nothing for its batch mates, nor do batching, preemption or async scheduling
change it; a grammar that cannot be compiled is refused with nothing left behind."""

from __future__ import annotations

import json
import re

import pytest

from tandem import LLM, SamplingParams
from tandem.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "languages", "employed"],
}
ASK_PERSON = [{"role": "user", "content": "Describe Ada Lovelace as a JSON object."}]
ASK_YES_NO = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
ASK_PHONE = [{"role": "user", "content": "Write a phone number."}]


def held(spec: StructuredOutputsParams, max_tokens: int = 120, **fields) -> SamplingParams:
    """Greedy unless `fields` say otherwise."""
    fields = {"temperature": 0, **fields}
    return SamplingParams(max_tokens=max_tokens, structured_outputs=spec, **fields)


def assert_person(text: str) -> None:
    value = json.loads(text)
    assert set(value) == set(PERSON["properties"])
    assert isinstance(value["name"], str) and isinstance(value["age"], int)
    assert isinstance(value["employed"], bool) and len(value["languages"]) <= 3
    assert all(isinstance(language, str) for language in value["languages"])


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("default", dtype="float32", kv_cache_memory=256 << 20, max_model_len=2048)


def test_each_kind_of_grammar_holds_the_reply(llm: LLM) -> None:
    def is_person(text: str) -> bool:
        assert_person(text)
        return True

    cases = [
        (ASK_PERSON, StructuredOutputsParams(json=PERSON), is_person),
        (ASK_PERSON, StructuredOutputsParams(json=json.dumps(PERSON), disable_any_whitespace=True),
         # no free whitespace: the separators are json.dumps's
         lambda text: is_person(text) and text == json.dumps(json.loads(text))),
        (ASK_YES_NO, StructuredOutputsParams(choice=["yes", "no"]),
         lambda text: text in ("yes", "no")),
        (ASK_PHONE, StructuredOutputsParams(regex=r"\+1-[0-9]{3}-[0-9]{4}"),
         lambda text: re.fullmatch(r"\+1-[0-9]{3}-[0-9]{4}", text) is not None),
        (ASK_YES_NO, StructuredOutputsParams(grammar='root ::= "The answer is " ("yes" | "no")'),
         lambda text: text in ("The answer is yes", "The answer is no")),
    ]  # fmt: skip
    outputs = llm.chat([c for c, _, _ in cases], [held(s) for _, s, _ in cases], use_tqdm=False)
    for (_, spec, check), output in zip(cases, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (spec, completion.text)
        assert check(completion.text), (spec, completion.text)


def test_any_json_object_parses(llm: LLM) -> None:
    ask = [{"role": "user", "content": "Give a JSON object with one key, 'color', and a value."}]
    (output,) = llm.chat(ask, held(StructuredOutputsParams(json_object=True), 200),
                         use_tqdm=False)  # fmt: skip
    assert output.outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(output.outputs[0].text), dict)


def test_a_held_request_changes_nothing_for_its_batch_mates(llm: LLM) -> None:
    """Each reply the same alone and in a batch of held and free requests; seeded random
    held rows the same too, and within the grammar."""
    free = SamplingParams(temperature=0, max_tokens=24)
    seeded = held(StructuredOutputsParams(json=PERSON), temperature=0.8, seed=5)
    greedy = held(StructuredOutputsParams(json=PERSON))
    alone = [llm.chat(ASK_PERSON, p, use_tqdm=False)[0].outputs[0].text
             for p in (free, seeded, greedy)]  # fmt: skip
    together = llm.chat([ASK_PERSON] * 3, [free, seeded, greedy], use_tqdm=False)
    assert [o.outputs[0].text for o in together] == alone
    assert_person(alone[1])
    assert_person(alone[2])


def test_preemption_and_async_scheduling_keep_the_reply(llm: LLM) -> None:
    """A matcher follows its request's tokens, not its steps: preempted and recomputed, or
    with async scheduling (which steps held requests one at a time), the same reply."""
    params = held(StructuredOutputsParams(json=PERSON))
    (expected,) = llm.chat(ASK_PERSON, params, use_tqdm=False)
    tight = LLM("default", dtype="float32", num_kv_blocks=16, max_model_len=2048)
    outputs = tight.chat([ASK_PERSON] * 3, params, use_tqdm=False)
    assert tight.llm_engine.core.num_preemptions > 0
    assert all(o.outputs[0].text == expected.outputs[0].text for o in outputs)
    overlapped = LLM("default", dtype="float32", async_scheduling=True, max_model_len=2048)
    (output,) = overlapped.chat(ASK_PERSON, params, use_tqdm=False)
    assert output.outputs[0].text == expected.outputs[0].text


def test_a_reply_that_runs_past_its_grammar_takes_eos_again(llm: LLM) -> None:
    """ignore_eos, or min_tokens not reached when the grammar is complete: EOS is all a
    complete grammar allows (min_tokens does not hold it off there), and it is taken again
    until the reply may end."""
    choice = StructuredOutputsParams(choice=["yes", "no"])
    eos = llm.tokenizer.eos_token_id
    for fields, finish in (({"ignore_eos": True, "max_tokens": 6}, "length"),
                           ({"min_tokens": 4, "max_tokens": 8}, "stop")):  # fmt: skip
        (output,) = llm.chat(ASK_YES_NO, held(choice, **fields), use_tqdm=False)
        completion = output.outputs[0]
        assert completion.text in ("yes", "no") and completion.finish_reason == finish
        first_eos = completion.token_ids.index(eos)
        assert set(completion.token_ids[first_eos:]) == {eos}
        assert len(completion.token_ids) == (6 if finish == "length" else 4)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutputsParams(json={"type": "object", "properties": 5}), "json cannot be"),
        (StructuredOutputsParams(regex="(unclosed"), "regex cannot be compiled"),
        (StructuredOutputsParams(grammar="root ::= undefined_rule"), "grammar cannot be"),
    ],
)
def test_a_grammar_that_cannot_compile_is_refused(llm: LLM, spec, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        llm.chat(ASK_PERSON, held(spec), use_tqdm=False)
    core = llm.llm_engine.core
    assert not core.has_unfinished_requests() and not len(core.structured)
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks


def test_speculative_decoding_refuses_held_requests() -> None:
    spec_llm = LLM("default", dtype="float32", max_model_len=2048,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})  # fmt: skip
    with pytest.raises(ValueError, match="speculative decoding is not supported yet"):
        spec_llm.chat(ASK_YES_NO, held(StructuredOutputsParams(choice=["yes", "no"])))
