"""`LLM` as a vLLM user drives it: the constructor's knobs with vLLM's meaning, priority
scheduling, prompt shapes, input validation that leaves nothing behind, get_metrics and chat.
The tiny random Llama where only the plumbing matters; the real SmolLM2 where text does."""

from __future__ import annotations

import json
import math

import pytest

from tandem import LLM, SamplingParams, TextPrompt, TokensPrompt
from tandem.engine.llm_engine import LLMEngine
from tandem.metrics_reader import Counter, Gauge, Histogram

from helpers import assert_same_until_tie, random_prompts


@pytest.fixture(scope="module")
def folder(tiny_llama):
    return tiny_llama[0]


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    """A word-level tokenizer for the tiny model's 320 ids ("w3" is id 3), in a folder of its
    own (no config.json): what LLM(tokenizer=...) points at."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 320)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    path = tmp_path_factory.mktemp("word-tokenizer")
    fast.save_pretrained(path)
    return path


def assert_engine_empty(llm: LLM) -> None:
    assert not llm.llm_engine.has_unfinished_requests()
    assert not llm.llm_engine.core.has_unfinished_requests()
    kv = llm.llm_engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_llm_engine_and_separate_tokenizer(folder, tokenizer_folder):
    llm = LLM(folder, dtype="float32", tokenizer=tokenizer_folder)
    assert isinstance(llm.llm_engine, LLMEngine) and llm.engine is llm.llm_engine
    (text,) = llm.generate("w5 w6 w7", GREEDY, use_tqdm=False)
    (tokens,) = llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), GREEDY, use_tqdm=False)
    assert text.prompt_token_ids == [5, 6, 7]
    assert text.outputs[0].token_ids == tokens.outputs[0].token_ids
    assert text.outputs[0].text.split() == [f"w{t}" for t in tokens.outputs[0].token_ids]


def test_refused_and_unknown_arguments_fail_before_loading(folder):
    with pytest.raises(ValueError, match="trust_remote_code"):
        LLM(folder, dtype="float32", trust_remote_code=True)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        LLM(folder, dtype="float32", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization='gptq' is not supported"):
        LLM(folder, dtype="float32", quantization="gptq")
    with pytest.raises(TypeError, match="coming-from-vllm"):
        LLM(folder, dtype="float32", speculative_model="draft")


def test_global_seed_repeats_unseeded_sampling(folder):
    def sample(seed: int | None) -> list[list[int]]:
        llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, seed=seed)
        prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 320, 4, 12, seed=5)]
        params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_max_logprobs_refuses_and_leaves_nothing(folder):
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, max_logprobs=3)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    too_many = SamplingParams(max_tokens=2, logprobs=4)
    with pytest.raises(ValueError, match="logprobs=4 is more than max_logprobs=3"):
        llm.generate(prompts, [GREEDY, too_many], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs=5 is more than max_logprobs=3"):
        llm.generate(prompts, SamplingParams(prompt_logprobs=5), use_tqdm=False)
    assert_engine_empty(llm)
    assert not llm.step_stats  # nothing ran
    (ok,) = llm.generate(prompts[:1], SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)
    assert all(len(row) <= 4 for row in ok.outputs[0].logprobs)


def test_engine_wide_logprobs_mode(folder):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    prompt = {"prompt_token_ids": [11, 12, 13]}
    (raw,) = LLM(folder, dtype="float32", skip_tokenizer_init=True).generate(
        prompt, params, use_tqdm=False
    )
    logits_llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, logprobs_mode="raw_logits")
    (logits,) = logits_llm.generate(prompt, params, use_tqdm=False)
    assert logits.outputs[0].token_ids == raw.outputs[0].token_ids
    for row_lp, row_logit in zip(raw.outputs[0].logprobs, logits.outputs[0].logprobs, strict=True):
        # A logit minus its logprob is the row's log-sum-exp: the same for every candidate.
        offsets = {round(row_logit[t].logprob - row_lp[t].logprob, 3) for t in row_lp}
        assert len(offsets) == 1 and next(iter(offsets)) != 0
    explicit = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3,
                              logprobs_mode="raw_logprobs")  # fmt: skip
    (own,) = logits_llm.generate(prompt, explicit, use_tqdm=False)
    first = own.outputs[0].logprobs[0]
    assert all(math.isclose(first[t].logprob, raw.outputs[0].logprobs[0][t].logprob,
                            abs_tol=1e-5) for t in first)  # fmt: skip


def test_without_chunked_prefill_prompts_run_whole(folder):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 320, 100, 100, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    knobs = dict(skip_tokenizer_init=True, max_num_batched_tokens=256, max_num_seqs=8)
    chunked = LLM(folder, dtype="float32", **knobs)
    reference = chunked.generate(prompts, params, use_tqdm=False)
    assert chunked.step_stats[0].num_prefill_tokens == 256  # 100 + 100 + a chunk of 56
    whole = LLM(folder, dtype="float32", enable_chunked_prefill=False, **knobs)
    outputs = whole.generate(prompts, params, use_tqdm=False)
    assert [s.num_prefill_tokens for s in whole.step_stats][:2] == [200, 100]
    for output, expected in zip(outputs, reference, strict=True):
        completion = expected.outputs[0]
        assert_same_until_tie(output.outputs[0].token_ids, completion.token_ids,
                              completion.logprobs)  # fmt: skip


def test_priority_orders_admission(folder):
    llm = LLM(
        folder,
        dtype="float32",
        skip_tokenizer_init=True,
        scheduling_policy="priority",
        max_num_seqs=1,
    )
    prompts = [{"prompt_token_ids": [3 + i, 50, 60]} for i in range(4)]
    outputs = llm.generate(prompts, GREEDY, priority=[2, 0, 1, 0], use_tqdm=False)
    started = [o.metrics.first_scheduled_time for o in outputs]
    assert sorted(range(4), key=started.__getitem__) == [1, 3, 2, 0]  # FCFS among equals
    assert_engine_empty(llm)


def test_priority_decides_who_is_preempted(folder):
    """Four requests outgrow a 16-block cache together. By priority the first one (value 5)
    is the victim; FCFS would take the newest."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 320, 30, 30, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    knobs = dict(skip_tokenizer_init=True, num_kv_blocks=16, enable_prefix_caching=False)
    by_priority = LLM(folder, dtype="float32", scheduling_policy="priority", **knobs)
    outputs = by_priority.generate(prompts, params, priority=[5, 0, 0, 0], use_tqdm=False)
    assert [o.metrics.num_preemptions > 0 for o in outputs] == [True, False, False, False]
    fcfs = LLM(folder, dtype="float32", **knobs).generate(prompts, params, use_tqdm=False)
    assert [o.metrics.num_preemptions > 0 for o in fcfs] == [False, False, False, True]
    for output, expected in zip(outputs, fcfs, strict=True):
        completion = expected.outputs[0]
        assert_same_until_tie(output.outputs[0].token_ids, completion.token_ids,
                              completion.logprobs)  # fmt: skip


def test_priority_needs_the_priority_policy(folder):
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True)
    prompts = [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8]}]
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        llm.generate(prompts, GREEDY, priority=[0, 1], use_tqdm=False)
    llm.generate(prompts, GREEDY, priority=[0, 0], use_tqdm=False)  # all 0: fine under fcfs
    priority_llm = LLM(
        folder, dtype="float32", skip_tokenizer_init=True, scheduling_policy="priority"
    )
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        priority_llm.generate(prompts, GREEDY, priority=[1], use_tqdm=False)
    assert_engine_empty(llm)
    assert_engine_empty(priority_llm)


def test_prompt_shapes(folder, tokenizer_folder):
    llm = LLM(folder, dtype="float32", tokenizer=tokenizer_folder)
    shapes = [
        "w5 w6",
        TextPrompt(prompt="w5 w6"),
        {"prompt": "w5 w6", "cache_salt": "tenant-a"},
        TokensPrompt(prompt_token_ids=[5, 6], prompt="w5 w6"),
        {"prompt_token_ids": (5, 6)},
    ]
    outputs = llm.generate(shapes, GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert [o.prompt for o in outputs] == ["w5 w6"] * 4 + [None]
    with pytest.raises(ValueError, match="'multi_modal_data' is not supported"):
        llm.generate([{"prompt": "w5", "multi_modal_data": {"image": None}}], GREEDY)
    with pytest.raises(ValueError, match="unknown prompt key 'prompt_ids'"):
        llm.generate([{"prompt_ids": [5]}], GREEDY)


def test_bad_prompts_are_refused_before_anything_runs(folder, tokenizer_folder):
    llm = LLM(folder, dtype="float32", tokenizer=tokenizer_folder)  # max_model_len: the model's 256
    good = {"prompt_token_ids": [5, 6, 7]}
    cases = [
        ({"prompt_token_ids": []}, "prompt 1 is empty: give at least one token"),
        ("", "prompt 1 is empty"),
        ({"prompt_token_ids": [5, 320]}, r"token id 320 is outside the vocabulary.*\[0, 320\)"),
        ({"prompt_token_ids": [5, -1]}, "token id -1 is outside the vocabulary"),
        ({"prompt_token_ids": [5, "6"]}, "token id '6' is outside the vocabulary"),
        ({"prompt_token_ids": [5] * 257}, "prompt 1 is 257 tokens long, more than max_model_len"),
        (42, "a prompt must be a string"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([good, bad], GREEDY, use_tqdm=False)
        assert_engine_empty(llm)
    assert not llm.step_stats  # the good prompt never ran either
    truncated = SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=100)
    (output,) = llm.generate({"prompt_token_ids": list(range(3, 303))}, truncated)
    assert output.prompt_token_ids == list(range(203, 303))


def test_get_metrics(folder):
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        LLM(folder, dtype="float32", skip_tokenizer_init=True).get_metrics()
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, disable_log_stats=False)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 320, 5, 20, seed=6)]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    metrics = {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}
    prompt_tokens = metrics[("tandem:prompt_tokens", None)]
    assert isinstance(prompt_tokens, Counter)
    assert prompt_tokens.value == sum(len(o.prompt_token_ids) for o in outputs)
    assert metrics[("tandem:generation_tokens", None)].value == 3 * GREEDY.max_tokens
    assert metrics[("tandem:request_success", "length")].value == 3
    assert metrics[("tandem:request_success", "stop")].value == 0
    running = metrics[("tandem:num_requests_running", None)]
    assert isinstance(running, Gauge) and running.value == 0
    ttft = metrics[("tandem:time_to_first_token_seconds", None)]
    assert isinstance(ttft, Histogram) and ttft.count == 3 and ttft.buckets["+Inf"] == 3
    steps = metrics[("tandem:iteration_tokens_total", None)]
    assert steps.count == len(llm.step_stats)
    assert steps.sum == sum(s.num_prefill_tokens + s.num_decode_tokens for s in llm.step_stats)


def test_generation_config_defaults(folder, tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 3})
    )
    prompt = {"prompt_token_ids": [5, 6, 7]}
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, generation_config=tmp_path)
    assert llm.get_default_sampling_params().max_tokens == 3
    assert len(llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids) <= 3
    explicit = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)  # not merged
    assert len(llm.generate(prompt, explicit, use_tqdm=False)[0].outputs[0].token_ids) == 5
    plain = LLM(folder, dtype="float32", skip_tokenizer_init=True, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


# -- the real SmolLM2 --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol():
    return LLM("default", dtype="float32", kv_cache_memory=256 << 20, max_model_len=2048)


@pytest.mark.slow
def test_chat_continue_final_message_and_template_kwargs(smol):
    conversation = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    params = SamplingParams(temperature=0, max_tokens=8)
    (out,) = smol.chat(conversation, params, add_generation_prompt=False,
                       continue_final_message=True, use_tqdm=False)  # fmt: skip
    assert out.prompt.endswith("The capital of France is")
    assert "Paris" in out.outputs[0].text
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        smol.chat(conversation, params, continue_final_message=True)
    template = "{{ prefix }}{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                          {"type": "text", "text": "there"}]}]  # fmt: skip
    (out,) = smol.chat(parts, params, chat_template=template,
                       chat_template_kwargs={"prefix": "Q: "}, use_tqdm=False)  # fmt: skip
    assert out.prompt == "Q: Hi\nthere|"
    with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
        smol.chat(parts, params, chat_template_kwargs={"tokenize": True})
    assert_engine_empty(smol)


@pytest.mark.slow
def test_chat_passes_tools_and_history_calls_to_the_template(smol):
    """As vLLM's chat: `tools` reach the template, and each history call's JSON arguments
    arrive as an object (a template writes them with tojson, not as an escaped string)."""
    template = (
        "{% for t in tools %}{{ t.function.name }};{% endfor %}"
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.arguments | tojson }}{% endfor %}|{% endfor %}"
    )
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    conversation = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "c1"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    params = SamplingParams(temperature=0, max_tokens=1)
    (out,) = smol.chat(conversation, params, chat_template=template, tools=tools,
                       use_tqdm=False)  # fmt: skip
    assert out.prompt == 'get_weather;|{"city": "Paris"}||'
    call["function"]["arguments"] = "{not json"
    with pytest.raises(ValueError, match="must be a JSON object"):
        smol.chat(conversation, params, chat_template=template, tools=tools)
    assert_engine_empty(smol)


@pytest.mark.slow
def test_smollm2_input_validation(smol):
    good = "The capital of France is"
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        smol.generate([good, ""], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"outside the vocabulary.*\[0, 49152\)"):
        smol.generate({"prompt_token_ids": [1, 49152]}, use_tqdm=False)
    with pytest.raises(ValueError, match="more than max_model_len=2048"):
        smol.generate(good * 600, use_tqdm=False)
    assert_engine_empty(smol)
    (out,) = smol.generate(good, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert "Paris" in out.outputs[0].text
