"""dtype="auto" on CPU with the probe's fast formats (bf16 dense weights for prefill, the GGUF's
Q4 weights packed for decode steps), forced here so every machine runs the same path: greedy
output equals the fp32 reference's up to near-ties."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.attention import cpu_kernel
from tandem.engine import cpu_formats as formats_module
from tandem.engine.cpu_formats import CpuFormats
from tandem.models.layers import Linear

from greedy_reference import equal_until_near_tie

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three uses of copper:",
]
MAX_TOKENS = 32
NEAR_TIE = 0.25  # nats between fp32's two most likely tokens


def test_auto_greedy_equals_fp32_up_to_near_ties(monkeypatch):
    chosen = CpuFormats("bfloat16", 8, {}, {})
    monkeypatch.setattr(formats_module, "cpu_formats", lambda config, packable: chosen)
    auto = LLM("default", kv_cache_memory=256 << 20)
    runner = auto.engine.core.runner
    assert runner.config.dtype == "bfloat16" and runner.config.packed_max_tokens == 8
    packed = [m for m in runner.model.modules() if isinstance(m, Linear) and m.packed]
    assert len(packed) == 4 * runner.model_config.num_hidden_layers
    reference = LLM("default", dtype="float32", kv_cache_memory=256 << 20)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    ours = auto.generate(PROMPTS, params, use_tqdm=False)
    theirs = reference.generate(PROMPTS, params, use_tqdm=False)
    num_agreed = sum(
        equal_until_near_tie(
            mine.outputs[0].token_ids, expected.outputs[0], NEAR_TIE, f"prompt {mine.prompt!r}"
        )
        for mine, expected in zip(ours, theirs, strict=True)
    )
    assert num_agreed >= len(PROMPTS) * MAX_TOKENS // 4


def test_a_lone_greedy_request_takes_its_tokens_from_the_lm_heads_argmax(monkeypatch):
    """A batch-1 greedy decode step asks the packed LM head's kernel for the argmax (no pass
    of the sampler's after the forward); a request whose logits something processes (here a
    repetition penalty) does not ask; the tokens are those of the sampler's pass. (One
    forward a step: several are the next test's.)"""
    chosen = CpuFormats("bfloat16", 8, {}, {})
    monkeypatch.setattr(formats_module, "cpu_formats", lambda config, packable: chosen)
    llm = LLM("default", kv_cache_memory=256 << 20, num_scheduler_steps=1)
    core = llm.engine.core
    model = core.runner.model
    assert model.lm_head_packed is not None
    asked, sampler_passes = [], []
    run, argmax_rows = core.runner.run, cpu_kernel.argmax_rows

    def spying_run(*args, **kwargs):
        output = run(*args, **kwargs)
        asked.append((args[5], output.argmax is not None))
        return output

    def counting_argmax_rows(logits):
        sampler_passes.append(logits.shape[0])
        return argmax_rows(logits)

    monkeypatch.setattr(core.runner, "run", spying_run)
    monkeypatch.setattr(cpu_kernel, "argmax_rows", counting_argmax_rows)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fused = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert asked[0] == (True, False)  # the prompt's step: logits of its last token only
    assert set(asked[1:]) == {(True, True)} and sampler_passes == [1]
    asked.clear()
    penalized = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                               repetition_penalty=1.3)  # fmt: skip
    llm.generate(PROMPTS[0], penalized, use_tqdm=False)
    assert asked and not any(argmax for argmax, _ in asked)
    monkeypatch.setattr(model, "compute_logits_and_argmax",
                        lambda hidden: (model.compute_logits(hidden), None))  # fmt: skip
    assert llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].token_ids == fused


def test_multi_step_scheduling_gives_one_forward_a_steps_tokens(monkeypatch):
    """The default on a CPU whose decode steps run fused: greedy requests decode in bursts of
    forwards, alone or together; their tokens, finish and stop reasons are those of one
    forward a step (lone requests, then batches whose requests end at different steps),
    whether max_tokens, EOS or a stop token id ends them, and every block comes back."""
    chosen = CpuFormats("bfloat16", 8, {}, {})
    monkeypatch.setattr(formats_module, "cpu_formats", lambda config, packable: chosen)
    bursts = LLM("default", kv_cache_memory=256 << 20)
    single = LLM("default", kv_cache_memory=256 << 20, num_scheduler_steps=1)
    core = bursts.engine.core
    assert core.scheduler.config.num_scheduler_steps == 8
    assert single.engine.core.scheduler.config.num_scheduler_steps == 1
    forty = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = single.generate(PROMPTS[0], forty, use_tqdm=False)[0].outputs[0].token_ids
    cases = [
        SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=200),  # EOS ends it
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[reference[21]]),
    ]

    def outcome(llm, prompts, params):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                for o in outputs]  # fmt: skip

    reasons = set()
    for params in cases:
        for prompt in PROMPTS[:2]:
            ours = outcome(bursts, prompt, params)
            assert ours == outcome(single, prompt, params)
            reasons.add(ours[0][1:])
    assert {("length", None), ("stop", None), ("stop", reference[21])} <= reasons
    uneven = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 9, 30)]
    assert outcome(bursts, PROMPTS[:3], uneven) == outcome(single, PROMPTS[:3], uneven)
    eos = SamplingParams(temperature=0, max_tokens=120)  # requests ending at EOS mid-burst
    assert outcome(bursts, PROMPTS, eos) == outcome(single, PROMPTS, eos)
    stats = list(core.step_stats)
    assert any(s.num_steps > 1 and s.num_seqs == 1 for s in stats)
    assert any(s.num_steps > 1 and s.num_seqs > 1 for s in stats)
    assert sum(s.num_decode_tokens for s in stats) == core.num_decode_tokens
    assert core.kv_cache_manager.usage == 0.0


def test_speculation_and_bursts_share_a_lone_request(monkeypatch):
    """n-gram speculation with multi-step scheduling: a lone greedy request's steps verify
    drafts where the proposer found some and run bursts where it found none; the tokens are
    those of plain decoding one forward a step."""
    chosen = CpuFormats("bfloat16", 8, {}, {})
    monkeypatch.setattr(formats_module, "cpu_formats", lambda config, packable: chosen)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
             "prompt_lookup_max": 3, "adaptive": False}  # fmt: skip
    both = LLM("default", kv_cache_memory=256 << 20, speculative_config=ngram)
    plain = LLM("default", kv_cache_memory=256 << 20, num_scheduler_steps=1)
    copy = ("Repeat this list exactly: red apple, green pear, yellow banana, red apple, green "
            "pear, yellow banana, red apple, green pear.")  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for prompt in (copy, PROMPTS[1]):
        ours = both.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert ours == plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    stats = list(both.engine.core.step_stats)
    assert any(s.num_draft_tokens for s in stats) and any(s.num_steps > 1 for s in stats)
    assert not any(s.num_draft_tokens and s.num_steps > 1 for s in stats)
    assert both.engine.core.kv_cache_manager.usage == 0.0


def test_sampled_requests_burst_with_the_tokens_of_one_forward_a_step(monkeypatch):
    """Randomly sampled requests (seeded, or drawing from the global generator), alone and
    together, decode in bursts whose C sampler draws what the sampler draws one step at a
    time, and leave the generators where one forward a step does, bursts that EOS ends early
    too."""
    chosen = CpuFormats("bfloat16", 8, {}, {})
    monkeypatch.setattr(formats_module, "cpu_formats", lambda config, packable: chosen)
    bursts = LLM("default", kv_cache_memory=256 << 20)
    single = LLM("default", kv_cache_memory=256 << 20, num_scheduler_steps=1)
    cases = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=48, seed=7, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, min_p=0.05, max_tokens=48, seed=5),
        SamplingParams(temperature=0.7, max_tokens=48, ignore_eos=True),
    ]
    for params in cases:
        outputs = []
        for llm in (bursts, single):
            torch.manual_seed(11)  # the unseeded request's numbers
            output = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
            outputs.append((output.token_ids, output.finish_reason, torch.rand(1)))
        (ours, reason, after), (theirs, their_reason, their_after) = outputs
        assert (ours, reason) == (theirs, their_reason) and torch.equal(after, their_after)
    # Together, with a greedy one: bursts of several rows, some ended by a row's EOS.
    mixed = [*cases, SamplingParams(temperature=0, max_tokens=40)]
    outputs = []
    for llm in (bursts, single):
        torch.manual_seed(11)
        generated = llm.generate(PROMPTS, mixed, use_tqdm=False)
        outputs.append(([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in generated],
                        torch.rand(1)))  # fmt: skip
    (ours, after), (theirs, their_after) = outputs
    assert ours == theirs and torch.equal(after, their_after)
    stats = list(bursts.engine.core.step_stats)
    assert any(s.num_steps > 1 and s.num_seqs > 1 for s in stats)
