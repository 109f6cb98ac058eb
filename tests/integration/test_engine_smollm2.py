"""The engine on the embedded SmolLM2: HF-equal greedy output for 16 concurrent chat prompts,
stop strings, chat template, text prompts."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams

from helpers import assert_hf_greedy

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Why do cats purr?",
    "Translate 'good morning' into Spanish.",
    "What does a CPU do? Answer in one sentence, please, and keep it short and simple.",
    "List two fruits that are red.",
    "Who wrote Romeo and Juliet?",
    "Describe the color blue to someone who cannot see, in a few words.",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet goldfish.",
    "How many legs does a spider have?",
    "What is photosynthesis? Explain it briefly for a ten year old child who likes plants.",
    "Say hello in French.",
]


@pytest.fixture(scope="module")
def llm():
    return LLM("default", dtype="float32", max_num_batched_tokens=256, max_num_seqs=16)


def test_sixteen_concurrent_chats_equal_hf_greedy(llm, smollm2_hf):
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    lengths = {len(o.prompt_token_ids) for o in outputs}
    assert len(lengths) > 5  # mixed prompt lengths
    assert max(s.num_seqs for s in llm.step_stats) == 16  # all ran concurrently
    for output in outputs:
        assert_hf_greedy(smollm2_hf, output.prompt_token_ids, output.outputs[0].token_ids, 24)
    assert "Paris" in outputs[0].outputs[0].text


def test_eos_ends_chat_answer(llm):
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)  # fmt: skip
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    assert completion.token_ids[-1] == llm.tokenizer.eos_token_id
    assert "<|im_end|>" not in completion.text and "Paris" in completion.text


def test_stop_strings_cut_text(llm):
    prompt = "Count from one to ten in words: one, two, three,"
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (full,) = llm.generate([prompt], greedy, use_tqdm=False)
    text = full.outputs[0].text
    assert "six" in text
    stop = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["six"])
    (cut,) = llm.generate([prompt], stop, use_tqdm=False)
    assert cut.outputs[0].text == text[: text.index("six")]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == "six"
    keep = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["six"],
                          include_stop_str_in_output=True)  # fmt: skip
    (kept,) = llm.generate([prompt], keep, use_tqdm=False)
    assert kept.outputs[0].text == text[: text.index("six") + 3]


def test_min_tokens_holds_back_eos(llm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=30)
    (out,) = llm.chat(question, params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert len(tokens) >= 30
    assert llm.tokenizer.eos_token_id not in tokens[:30]
