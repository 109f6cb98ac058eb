"""The fused CPU decode step (worker/cpu_decode.py, csrc/decode_forward.c): a step whose every
token is a decode token (one of a request's few new tokens) runs all the layers in one C call,
and gives the layer-by-layer forward's hidden states and cache contents (within fp32 rounding
in an fp32 model; in a bf16 one, within bf16 rounding: the fused residual stream stays
fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.attention import cpu_kernel
from tandem.attention.metadata import build_batch, forward_context
from tandem.sampling_params import SamplingParams
from tandem.worker.model_runner import ModelRunner, RunnerConfig
from tandem.worker.sampler import SamplingInputs, burst_draws, sample

from helpers import Slice, needs_cpu_kernels, relative_error, torch_threads, write_gguf
from hf_models import make_hf_model

pytestmark = needs_cpu_kernels

SMALL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
QTYPES = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_1",
          "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q8_0",
          "output.": "Q8_0"}  # fmt: skip
BLOCK_SIZE = 16
MAX_TOKENS = 8
# 18 requests' contexts: a decode step of theirs is split over 2 threads (csrc split_step).
MANY_CONTEXTS = [5, 9, 16, 20, 33, 3, 12, 7, 40, 2, 11, 6, 25, 4, 8, 14, 10, 1]


def packed_runner(
    tmp_path, dtype: str, config_class="LlamaConfig", arch="llama", extra=None, **overrides
):
    path = tmp_path / f"{arch}.gguf"
    if not path.exists():
        write_gguf(path, make_hf_model(config_class, {**SMALL, **(extra or {})}), arch, QTYPES)
    config = dict(model=path, dtype=dtype, packed_max_tokens=MAX_TOKENS, num_kv_blocks=48,
                  block_size=BLOCK_SIZE, attention_backend="cpu")  # fmt: skip
    return ModelRunner(RunnerConfig(**{**config, **overrides}))


def prefilled(runner: ModelRunner, context_lens: list[int], seed: int) -> list[Slice]:
    """Requests whose contexts are in the cache (prefilled layer by layer), over shuffled
    blocks."""
    rng = random.Random(seed)
    pool = list(range(runner.num_kv_blocks))
    rng.shuffle(pool)
    requests = []
    for length in context_lens:
        tokens = [rng.randrange(3, 200) for _ in range(length + 16)]
        blocks = [pool.pop() for _ in range(-(-len(tokens) // BLOCK_SIZE))]
        requests.append(Slice(tokens, 0, length, blocks))
    batch = build_batch(requests, BLOCK_SIZE, runner.device)
    with torch.inference_mode(), forward_context(batch.attn_metadata):
        runner.model(batch.input_ids, batch.positions)
    return requests


def layer_by_layer(runner: ModelRunner, batch) -> torch.Tensor:
    with torch.inference_mode(), forward_context(batch.attn_metadata):
        return runner.model(batch.input_ids, batch.positions)


@pytest.mark.parametrize("int8_min_tokens", [0, 4], ids=["fp32-activations", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "arch,config_class,extra,num_verified",
    [
        ("llama", "LlamaConfig", {}, 3),
        ("qwen2", "Qwen2Config", {}, 3),  # qkv bias
        # QKV and O biases, heads of 64 (the kernel's compiled size); 12 tokens: two passes
        # of the packed matmul's 8 rows.
        ("llama", "LlamaConfig", {"attention_bias": True, "head_dim": 64}, 9),
    ],
    ids=["llama", "qwen2", "llama-biases-64"],
)
def test_fused_step_equals_the_layer_by_layer_forward(
    tmp_path, dtype, arch, config_class, extra, num_verified, int8_min_tokens
):
    """int8: both quantize the same activations (up to the paths' rounding)."""
    runner = packed_runner(tmp_path, dtype, config_class, arch, extra, packed_max_tokens=16,
                           packed_int8_min_tokens=int8_min_tokens)  # fmt: skip
    assert runner.cpu_decode is not None
    requests = prefilled(runner, [5, 16, 33, 70], seed=1)
    # Three decode tokens, and a request verifying drafts (num_verified query tokens).
    step = [Slice(r.token_ids, r.num_new_tokens, 1, r.block_ids) for r in requests[:3]]
    last = requests[3]
    step.append(Slice(last.token_ids, last.num_new_tokens, num_verified, last.block_ids))
    batch = build_batch(step, BLOCK_SIZE, runner.device)
    assert runner.cpu_decode.fits(batch)
    before = [cache.clone() for cache in runner.kv_caches]
    with torch.inference_mode():
        fused = runner.hidden_states(batch)
    fused_caches = [cache.clone() for cache in runner.kv_caches]
    for cache, saved in zip(runner.kv_caches, before, strict=True):
        cache.copy_(saved)
    expected = layer_by_layer(runner, batch)
    assert fused.dtype == expected.dtype
    assert fused.shape == expected.shape == (3 + num_verified, 128)
    # int8: the two paths' fp32 roundings (SiLU in C against torch's) can flip an activation's
    # code, moving an output by about d_x·w.
    tolerance = (2e-3 if int8_min_tokens else 1e-5) if dtype == "float32" else 3e-2
    assert relative_error(fused, expected) <= tolerance
    for got, want in zip(fused_caches, runner.kv_caches, strict=True):
        assert relative_error(got, want) <= tolerance
    # Exactly the step's slots were written, all of them.
    slots = set(batch.attn_metadata.slot_mapping.tolist())
    for got, saved in zip(fused_caches, before, strict=True):
        changed = (got != saved).flatten(3).any(-1)  # [keys | values, blocks, positions]
        assert set(torch.nonzero(changed.any(0).flatten()).flatten().tolist()) == slots


@pytest.mark.parametrize("int8_min_tokens", [0, 1], ids=["fp32-activations", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_split_over_the_threads_by_request_equals_it_on_one(
    tmp_path, dtype, int8_min_tokens
):
    """From 8 tokens a thread, the layers run as one part of the requests per thread
    (csrc/decode_forward.c's split_step; with int8 activations not where they take AVX2's
    wide kernel, as from 16 rows), a request verifying drafts within one part: every
    hidden row and cache entry as the step on one thread writes it, bit for bit with int8
    activations (a row's products do not depend on the rows beside it). The fp32-activation
    kernel takes rows in passes of 4 or 8 whose sums differ in rounding from a part's last,
    shorter pass, as they do wherever a request sits in a batch."""
    runner = packed_runner(tmp_path, dtype, packed_max_tokens=32,
                           packed_int8_min_tokens=int8_min_tokens)  # fmt: skip
    requests = prefilled(runner, MANY_CONTEXTS, seed=3)
    step = [Slice(r.token_ids, r.num_new_tokens, 1, r.block_ids) for r in requests]
    # Tokens 8-10 verify drafts: an even split (at 10) falls within them; the parts are
    # tokens 0-10 and 11-19.
    verifying = requests[8]
    step[8] = Slice(verifying.token_ids, verifying.num_new_tokens, 3, verifying.block_ids)
    batch = build_batch(step, BLOCK_SIZE, runner.device)
    assert runner.cpu_decode.fits(batch) and batch.input_ids.shape[0] == 20
    before = [cache.clone() for cache in runner.kv_caches]
    results = []
    for num_threads in (1, 2):
        restored(runner, before)
        with torch_threads(num_threads), torch.inference_mode():
            hidden = runner.hidden_states(batch)
        results.append((hidden, [cache.clone() for cache in runner.kv_caches]))
    (one, one_caches), (split, split_caches) = results
    if int8_min_tokens:
        assert torch.equal(split, one)
        assert all(torch.equal(s, o) for s, o in zip(split_caches, one_caches, strict=True))
    else:
        tolerance = 1e-6 if dtype == "float32" else 8e-3  # bf16: an entry's last bit or two
        assert relative_error(split, one) <= tolerance
        for got, want in zip(split_caches, one_caches, strict=True):
            assert relative_error(got, want) <= tolerance


@pytest.mark.parametrize("int8_min_tokens", [0, 1], ids=["fp32-activations", "int8"])
def test_greedy_decoding_matches_layer_by_layer(tmp_path, int8_min_tokens):
    """Eight decode steps of three requests, fed their own argmax: the same tokens."""
    runner = packed_runner(tmp_path, "float32", packed_int8_min_tokens=int8_min_tokens)
    requests = prefilled(runner, [7, 20, 41], seed=2)

    def decode(use_fused: bool) -> list[list[int]]:
        tokens = [list(r.token_ids[: r.num_new_tokens]) for r in requests]
        for _ in range(MAX_TOKENS):
            step = [
                Slice(row, len(row) - 1, 1, request.block_ids)
                for row, request in zip(tokens, requests, strict=True)
            ]
            batch = build_batch(step, BLOCK_SIZE, runner.device)
            assert runner.cpu_decode.fits(batch)
            with torch.inference_mode():
                hidden = (runner.hidden_states(batch) if use_fused
                          else layer_by_layer(runner, batch))  # fmt: skip
                logits = runner.model.compute_logits(hidden)
            for row, new in zip(tokens, logits.argmax(-1).tolist(), strict=True):
                row.append(new)
        return tokens

    assert decode(True) == decode(False)


def test_outside_inference_mode(tmp_path):
    """hidden_states is public: with autograd on (the model's parameters require grad) the
    fused step still runs, and gives what it gives in inference mode."""
    runner = packed_runner(tmp_path, "float32")
    requests = prefilled(runner, [9, 25], seed=4)
    step = [Slice(r.token_ids, r.num_new_tokens, 1, r.block_ids) for r in requests]
    batch = build_batch(step, BLOCK_SIZE, runner.device)
    assert runner.cpu_decode.fits(batch)
    with torch.inference_mode():
        expected = runner.hidden_states(batch)
    assert torch.equal(runner.hidden_states(batch), expected)  # the same slots rewritten


@pytest.mark.parametrize("contexts", [[9, 25], MANY_CONTEXTS], ids=["two", "split"])
def test_a_token_outside_the_vocabulary_is_refused_before_any_layer_runs(tmp_path, contexts):
    """The C step reads the embedding row itself: an id past the table is an error that says
    so, not a read out of bounds, and no cache slot is written (also where the step's layers
    run as one part per thread, the bad id in the last part)."""
    runner = packed_runner(tmp_path, "float32", packed_max_tokens=32)
    requests = prefilled(runner, contexts, seed=5)
    vocab_size = runner.model.config.vocab_size
    bad = requests[-1]
    tokens = list(bad.token_ids)
    tokens[bad.num_new_tokens] = vocab_size
    step = [Slice(r.token_ids, r.num_new_tokens, 1, r.block_ids) for r in requests[:-1]]
    step.append(Slice(tokens, bad.num_new_tokens, 1, bad.block_ids))
    batch = build_batch(step, BLOCK_SIZE, runner.device)
    assert runner.cpu_decode.fits(batch)
    before = [cache.clone() for cache in runner.kv_caches]
    with (
        torch_threads(2),
        torch.inference_mode(),
        pytest.raises(ValueError, match="outside the model's tables"),
    ):
        runner.hidden_states(batch)
    assert all(torch.equal(c, b) for c, b in zip(runner.kv_caches, before, strict=True))


def test_steps_it_does_not_take(tmp_path):
    runner = packed_runner(tmp_path, "float32")
    fused = runner.cpu_decode
    assert fused is not None
    requests = prefilled(runner, [10, 30], seed=3)
    prefill = build_batch([Slice(list(range(40)), 0, 40, [0, 1, 2])], BLOCK_SIZE, runner.device)
    assert not fused.fits(prefill)  # a prompt
    too_many = [Slice(r.token_ids, r.num_new_tokens, 5, r.block_ids) for r in requests]
    assert not fused.fits(build_batch(too_many, BLOCK_SIZE, runner.device))  # 10 > 8 tokens
    one = [Slice(r.token_ids, r.num_new_tokens, 1, r.block_ids) for r in requests]
    assert fused.fits(build_batch(one, BLOCK_SIZE, runner.device))
    runner.model.model.layers[0].self_attn.kv_cache = torch.zeros_like(runner.kv_caches[0])
    assert not fused.fits(build_batch(one, BLOCK_SIZE, runner.device))  # caches re-bound


@pytest.mark.parametrize(
    "overrides", [{"attention_backend": "torch"}, {"packed_max_tokens": 0}], ids=str
)
def test_not_built_without_packed_weights_or_the_cpu_attention_backend(tmp_path, overrides):
    assert packed_runner(tmp_path, "float32", **overrides).cpu_decode is None


@pytest.mark.parametrize("int8_min_tokens", [0, 1], ids=["fp32-activations", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_lone_greedy_row_takes_its_argmax_from_the_lm_head(
    tmp_path, monkeypatch, int8_min_tokens, dtype
):
    """forward(argmax=True) on a batch-1 decode: the packed LM head's argmax pass, in the same C
    call as the layers, gives the same logits as the head after the layers (in a bf16 model,
    over the final row rounded to bf16 as the layers hand it over) and argmax_rows' token;
    with two rows the sampler's own pass stays."""
    runner = packed_runner(tmp_path, dtype, packed_int8_min_tokens=int8_min_tokens)
    assert runner.model.lm_head_packed is not None
    requests = prefilled(runner, [5, 40], seed=2)
    step = [Slice(r.token_ids, r.num_new_tokens, 1, r.block_ids) for r in requests]
    single = build_batch(step[:1], BLOCK_SIZE, runner.device)
    with torch.inference_mode():
        plain = runner.forward(single)
        separate_head = runner.model.compute_logits_and_argmax(runner.hidden_states(single))

        def no_head_call(hidden):
            raise AssertionError("the fused step runs the head itself")

        monkeypatch.setattr(runner.model, "compute_logits_and_argmax", no_head_call)
        fused = runner.forward(single, argmax=True)
        monkeypatch.undo()
        both = runner.forward(build_batch(step, BLOCK_SIZE, runner.device), argmax=True)
    assert plain.argmax is None and fused.argmax is not None and both.argmax is None
    assert torch.equal(fused.logits, plain.logits)
    assert torch.equal(fused.logits, separate_head[0])
    assert fused.argmax.tolist() == separate_head[1].tolist()
    assert fused.argmax.tolist() == cpu_kernel.argmax_rows(plain.logits).tolist()


GREEDY = SamplingParams(temperature=0)


def single_steps(runner, requests, params, seeds, num_steps) -> list[list[int]]:
    """`num_steps` steps of the requests (one new token each), one forward each, sampled as
    the engine samples them: a lone greedy row by the fused step's argmax, the others by the
    sampler over the logits; each request's tokens."""
    generators = [None if seed is None else torch.Generator().manual_seed(seed) for seed in seeds]
    tokens = [list(r.token_ids[: r.num_new_tokens + 1]) for r in requests]
    for _ in range(num_steps):
        step = [Slice(row, len(row) - 1, 1, r.block_ids)
                for row, r in zip(tokens, requests, strict=True)]  # fmt: skip
        batch = build_batch(step, BLOCK_SIZE, runner.device)
        if len(requests) == 1 and params[0].temperature == 0:
            new = runner.forward(batch, argmax=True).argmax
        else:
            inputs = SamplingInputs(params, [[]] * len(params), [[]] * len(params), generators,
                                    [[]] * len(params))  # fmt: skip
            new = sample(runner.forward(batch).logits, inputs).token_ids
        for row, token in zip(tokens, new.tolist(), strict=True):
            row.append(token)
    return [row[r.num_new_tokens + 1 :] for row, r in zip(tokens, requests, strict=True)]


def burst(runner, requests, params, seeds, num_steps, stops=None) -> list[list[int]]:
    """The same requests' steps as one decode_steps call."""
    generators = [None if seed is None else torch.Generator().manual_seed(seed) for seed in seeds]
    first = [Slice(r.token_ids, r.num_new_tokens, 1, r.block_ids) for r in requests]
    draws = None
    if any(p.temperature > 0 for p in params):
        draws = burst_draws(params, generators, num_steps, runner.model_config.vocab_size)
    stops = stops or [frozenset()] * len(requests)
    return runner.decode_steps(first, num_steps, stops, draws)


def restored(runner, caches) -> None:
    for cache, saved in zip(runner.kv_caches, caches, strict=True):
        cache.copy_(saved)


@pytest.mark.parametrize("int8_min_tokens", [0, 1], ids=["fp32-activations", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("contexts", [[13], [13, 30, 5]], ids=["one", "three"])
def test_decode_steps_are_the_single_steps_in_one_call(tmp_path, dtype, int8_min_tokens, contexts):
    """Multi-step scheduling's call, greedy: the tokens, and the cache they leave, of as many
    single steps (each request's steps cross a block boundary); a request's stop id ends the
    burst for all after the step where it came."""
    runner = packed_runner(tmp_path, dtype, packed_int8_min_tokens=int8_min_tokens)
    assert runner.max_burst_rows >= 3
    requests = prefilled(runner, contexts, seed=6)
    params, seeds = [GREEDY] * len(requests), [None] * len(requests)
    before = [cache.clone() for cache in runner.kv_caches]
    expected = single_steps(runner, requests, params, seeds, 6)
    after = [cache.clone() for cache in runner.kv_caches]
    restored(runner, before)
    assert burst(runner, requests, params, seeds, 6) == expected
    assert all(torch.equal(c, a) for c, a in zip(runner.kv_caches, after, strict=True))
    stop = expected[-1][2]
    cut = expected[-1].index(stop) + 1
    stops = [frozenset()] * (len(requests) - 1) + [frozenset({stop, -5})]
    assert burst(runner, requests, params, seeds, 6, stops) == [row[:cut] for row in expected]


def test_decode_steps_refuse_a_position_past_the_requests_blocks(tmp_path):
    runner = packed_runner(tmp_path, "float32")
    (request,) = prefilled(runner, [15], seed=7)
    first = [Slice(request.token_ids, 15, 1, request.block_ids[:1])]  # positions 0..15
    assert len(runner.decode_steps(first, 1, [frozenset()])[0]) == 1
    with pytest.raises(ValueError, match="past the request's blocks"):
        runner.decode_steps(first, 2, [frozenset()])


def test_decode_steps_need_the_fused_step_and_its_packed_head(tmp_path):
    runner = packed_runner(tmp_path, "float32", attention_backend="torch")
    assert runner.max_burst_rows == 0
    (request,) = prefilled(runner, [5], seed=8)
    with pytest.raises(ValueError, match="fused decode path"):
        runner.decode_steps([Slice(request.token_ids, 5, 1, request.block_ids)], 2,
                            [frozenset()])  # fmt: skip


SAMPLED = {
    "top-p": SamplingParams(temperature=0.9, top_p=0.8),
    "top-k-min-p": SamplingParams(temperature=1.2, top_k=5, min_p=0.02),
    "top-k-1": SamplingParams(temperature=0.8, top_k=1),  # draws nothing, takes the top token
}


@pytest.mark.parametrize(
    "rows",
    [
        [("top-p", 4)],
        [("top-k-min-p", 9)],
        [("top-p", None)],  # unseeded: the global generator's numbers
        [("top-k-1", None)],
        [("top-p", 4), (None, None), ("top-k-min-p", None), ("top-k-1", 2)],
    ],
    ids=["top-p", "top-k-min-p", "unseeded", "top-k-1", "mixed-batch"],
)
def test_sampled_decode_steps_are_the_sampler_step_by_step(tmp_path, rows):
    """Randomly sampled requests (with a greedy one in the mixed batch): the C sampler draws
    each step from the head's logits at burst_draws' uniforms, the tokens the sampler gives
    step by step from the same seeds, and leaves the global generator where it does."""
    runner = packed_runner(tmp_path, "float32")
    params = [GREEDY if name is None else SAMPLED[name] for name, _ in rows]
    seeds = [seed for _, seed in rows]
    requests = prefilled(runner, [11, 27, 4, 18][: len(rows)], seed=10)
    before = [cache.clone() for cache in runner.kv_caches]
    torch.manual_seed(21)
    expected = single_steps(runner, requests, params, seeds, 6)
    global_after = torch.rand(1)
    restored(runner, before)
    torch.manual_seed(21)
    assert burst(runner, requests, params, seeds, 6) == expected
    assert torch.equal(torch.rand(1), global_after)


def test_a_burst_that_ends_early_gives_its_draws_back():
    """BurstDraws.give_back: the generators end where that many single steps leave them."""
    params = [SAMPLED["top-p"], SAMPLED["top-k-1"], SAMPLED["top-p"]]
    generators = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4), None]
    torch.manual_seed(5)
    draws = burst_draws(params, generators, 6, 1000)
    draws.give_back(2)
    ends = [torch.rand(1, generator=g) for g in generators[:2]] + [torch.rand(1)]
    generators = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4), None]
    torch.manual_seed(5)
    torch.rand(2, 3)  # two steps' global numbers, one per row
    torch.rand(2, generator=generators[0])  # the seeded row that draws; top-k 1 does not
    expected = [torch.rand(1, generator=g) for g in generators[:2]] + [torch.rand(1)]
    assert all(torch.equal(a, b) for a, b in zip(ends, expected, strict=True))
