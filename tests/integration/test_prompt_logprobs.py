"""SamplingParams.prompt_logprobs end to end, with vLLM's semantics: one entry per prompt token
(None for the first), each the prompt token's logprob with its rank plus the top-k there, under
the raw model distribution. Checked against HF transformers' logits, and for independence from
how the prompt was computed: one step or chunks, batch mates, preemption mid-prompt, prefix
caching, n > 1, the output kinds, the row slicing that bounds the logits' memory."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core.outputs import EngineCoreOutput
from tandem.engine.output_processor import OutputKind
from tandem.request import Request
from tandem.worker import model_runner

from helpers import assert_same_until_tie, random_prompts

VOCAB = 320
TOP_K = 3
TOL = 1e-4
PROMPTS = random_prompts(6, VOCAB, 2, 70, seed=11)
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP_K)


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of HF's fp32 logits: row p scores prompt token p + 1."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches_hf(prompt_logprobs, prompt: list[int], reference: torch.Tensor, k: int):
    """The entry shape and values vLLM gives, against HF's distribution (ranks and top-k sets
    up to fp32 near-ties)."""
    assert len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[position], reference[position - 1], prompt[position]
        logprob = entry[token]
        assert logprob.logprob == pytest.approx(float(row[token]), abs=TOL)
        lowest = int((row > row[token] + TOL).sum()) + 1
        highest = int((row > row[token] - TOL).sum()) + 1
        assert lowest <= logprob.rank <= highest
        # The top k, plus the prompt token where it is not among them.
        assert len(entry) == k + (logprob.rank > k)
        by_rank = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in by_rank[:k]] == list(range(1, k + 1))
        top = [lp.logprob for lp in by_rank[:k]]
        assert top == pytest.approx(row.topk(k).values.tolist(), abs=TOL)
        for top_id, lp in entry.items():
            assert lp.logprob == pytest.approx(float(row[top_id]), abs=TOL)


def assert_same_prompt_logprobs(actual, expected) -> None:
    """Equal entries (same ids and ranks, logprobs within fp32 noise of another batching)."""
    assert len(actual) == len(expected)
    assert actual[0] is None and expected[0] is None
    for got, want in zip(actual[1:], expected[1:], strict=True):
        assert got.keys() == want.keys()
        for token, logprob in want.items():
            assert got[token].rank == logprob.rank
            assert got[token].logprob == pytest.approx(logprob.logprob, abs=TOL)


def generate(llm: LLM, prompts, params=PARAMS):
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def folder(tiny_llama):
    return tiny_llama[0]


@pytest.fixture(scope="module")
def reference(folder):
    """Each prompt computed in one step, caching off."""
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False)
    return generate(llm, PROMPTS)


def test_equal_hf_log_softmax_with_ranks_and_top_k(tiny_llama, reference):
    _, hf_model = tiny_llama
    for prompt, output in zip(PROMPTS, reference, strict=True):
        assert_matches_hf(output.prompt_logprobs, prompt, hf_prompt_logprobs(hf_model, prompt),
                          TOP_K)  # fmt: skip


def test_k_zero_gives_the_prompt_tokens_only_and_a_one_token_prompt_none(tiny_llama, folder):
    _, hf_model = tiny_llama
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    prompt = PROMPTS[1]
    short, full = generate(llm, [[7], prompt], params)
    assert short.prompt_logprobs == [None]
    assert [list(entry) for entry in full.prompt_logprobs[1:]] == [[t] for t in prompt[1:]]
    reference = hf_prompt_logprobs(hf_model, prompt)
    for position in range(1, len(prompt)):
        logprob = full.prompt_logprobs[position][prompt[position]]
        assert logprob.logprob == pytest.approx(float(reference[position - 1, prompt[position]]),
                                                abs=TOL)  # fmt: skip
    plain = generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None


@pytest.mark.parametrize(
    "variant",
    [
        dict(max_num_batched_tokens=16, max_num_seqs=4),  # chunks of 8 tokens
        dict(max_num_batched_tokens=16, max_num_seqs=4, max_num_partial_prefills=3),
        dict(max_num_batched_tokens=32, max_num_seqs=8, batching_policy="prefill-first"),
        dict(max_num_batched_tokens=2048, max_num_seqs=256, block_size=4),
    ],
    ids=lambda v: ",".join(map(str, v.values())),
)
def test_independent_of_chunking_and_batch_mates(folder, reference, variant):
    mates = random_prompts(5, VOCAB, 3, 50, seed=12)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    other_k = SamplingParams(temperature=0.8, seed=5, max_tokens=3, prompt_logprobs=1)
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, **variant)
    batch = [*PROMPTS[:3], *mates, *PROMPTS[3:]]
    params = [PARAMS] * 3 + [plain, other_k, plain, other_k, plain] + [PARAMS] * 3
    outputs = generate(llm, batch, params)
    ours = outputs[:3] + outputs[8:]
    for output, expected in zip(ours, reference, strict=True):
        assert_same_prompt_logprobs(output.prompt_logprobs, expected.prompt_logprobs)
        assert output.outputs[0].token_ids == expected.outputs[0].token_ids
    for index in (4, 6):  # k = 1: the top-1 of the k = 3 entries an alone run gives
        alone = generate(llm, [batch[index]], PARAMS)[0].prompt_logprobs
        trimmed = [None] + [
            {t: lp for t, lp in entry.items() if t == batch[index][p + 1] or lp.rank <= 1}
            for p, entry in enumerate(alone[1:])
        ]
        assert_same_prompt_logprobs(outputs[index].prompt_logprobs, trimmed)
    if variant["max_num_batched_tokens"] < max(map(len, PROMPTS)):
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in llm.step_stats) or \
            variant.get("batching_policy") == "prefill-first"  # fmt: skip


def test_requests_without_prompt_logprobs_are_unaffected(folder):
    prompts = random_prompts(6, VOCAB, 5, 60, seed=13)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    llm = LLM(
        folder, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=32, max_num_seqs=8
    )
    alone = generate(llm, prompts[:2], plain)
    mixed = generate(llm, prompts, [plain, plain] + [PARAMS] * 4)
    for output, expected in zip(mixed[:2], alone, strict=True):
        assert output.prompt_logprobs is None
        completion, reference = output.outputs[0], expected.outputs[0]
        assert_same_until_tie(completion.token_ids, reference.token_ids, reference.logprobs)


def test_preemption_mid_prompt_sends_each_position_once(folder, reference):
    """A cache too small for the batch: a request is preempted with its prompt partly scored;
    its recompute scores only the positions not sent yet."""
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=8,
              max_num_batched_tokens=16, max_num_seqs=8, max_num_partial_prefills=4,
              enable_prefix_caching=False)  # fmt: skip
    core = llm.engine.core
    long_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=3)
    for index, prompt in enumerate(PROMPTS):
        llm.engine.add_request(str(index), prompt, long_params)
    finished = {}
    preempted_mid_prompt = set()
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            if output.finished:
                finished[output.request_id] = output
        for request_id, request in core.scheduler.requests.items():
            sent = core.prompt_logprobs_sent.get(request_id, 0)
            if request.num_preemptions and 0 < sent < request.num_prompt_tokens - 1:
                preempted_mid_prompt.add(request_id)
    assert preempted_mid_prompt
    assert sum(o.metrics.num_preemptions for o in finished.values()) > 0
    for index, expected in enumerate(reference):
        assert_same_prompt_logprobs(finished[str(index)].prompt_logprobs, expected.prompt_logprobs)
    assert not core.prompt_logprobs_sent  # forgotten once finished
    assert core.kv_cache_manager.num_free_blocks == 8


def test_prefix_cache_hit_is_not_taken_and_the_result_complete(folder, reference):
    llm = LLM(
        folder, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=64, max_num_seqs=4
    )
    prompt = PROMPTS[0]
    assert len(prompt) > 35
    warm = generate(llm, [[*prompt[:33], 1, 2]], SamplingParams(max_tokens=1))[0]
    assert warm.prompt_logprobs is None
    again = generate(llm, [prompt], SamplingParams(max_tokens=1))[0]
    assert again.num_cached_tokens == 32  # the prefix is cached for plain requests
    kv = llm.engine.core.kv_cache_manager
    queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
    (output,) = generate(llm, [prompt])
    assert output.num_cached_tokens == 0
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (queries, hits)  # no lookup
    assert_same_prompt_logprobs(output.prompt_logprobs, reference[0].prompt_logprobs)
    assert output.outputs[0].token_ids == reference[0].outputs[0].token_ids


def test_n_sequences_share_one_list(folder, reference):
    llm = LLM(
        folder, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=16, max_num_seqs=4
    )
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, prompt_logprobs=TOP_K)
    (output,) = generate(llm, [PROMPTS[0]], params)
    assert len(output.outputs) == 3
    assert_same_prompt_logprobs(output.prompt_logprobs, reference[0].prompt_logprobs)
    # Only the first sequence computes them; the others take the prefix cache as usual.
    cached = [c.metrics.num_cached_tokens for c in output.outputs]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    assert not llm.engine.core.prompt_logprobs_sent


@pytest.mark.parametrize("kind", list(OutputKind))
def test_output_kinds(folder, reference, kind):
    """DELTA sends the list once, with the first output; CUMULATIVE with every output; FINAL_ONLY
    with the final one. Prompt chunks that only scored logprobs make no output."""
    llm = LLM(
        folder, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=16, max_num_seqs=4
    )
    engine = llm.engine
    engine.add_request("r", PROMPTS[2], PARAMS, output_kind=kind)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert all(o.outputs[0].token_ids for o in outputs)  # no output for a chunk alone
    carried = [o.prompt_logprobs is not None for o in outputs]
    expected = {
        OutputKind.DELTA: [True] + [False] * 3,
        OutputKind.CUMULATIVE: [True] * 4,
        OutputKind.FINAL_ONLY: [True],
    }[kind]
    assert carried == expected
    assert_same_prompt_logprobs(outputs[0].prompt_logprobs, reference[2].prompt_logprobs)


def test_core_sends_each_chunks_rows_once_in_msgpack_safe_outputs(folder):
    """The core's side: a prompt chunk that samples nothing still sends its rows (in an output
    without tokens), every position once, and the outputs cross a process boundary intact."""
    msgspec = pytest.importorskip("msgspec")
    llm = LLM(
        folder, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=16, max_num_seqs=4
    )
    core = llm.engine.core
    prompt = PROMPTS[2]
    core.add_request(Request("r", prompt, PARAMS))
    outputs = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
    chunks = [o for o in outputs if not o.new_token_ids]
    assert len(chunks) == len(prompt) // 8 and all(o.new_prompt_logprobs for o in chunks)
    rows = [row for o in outputs for row in o.new_prompt_logprobs or []]
    assert [prompt[p + 1] in row for p, row in enumerate(rows)] == [True] * (len(prompt) - 1)
    for output in outputs:
        encoded = msgspec.msgpack.encode(output)
        assert msgspec.msgpack.decode(encoded, type=EngineCoreOutput) == output


def test_logits_are_scored_in_slices_of_rows(folder, reference, monkeypatch):
    """A long chunk's logits are computed a few rows at a time (memory); same result."""
    monkeypatch.setattr(model_runner, "PROMPT_LOGITS_ROWS", 5)
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False)
    for output, expected in zip(generate(llm, PROMPTS), reference, strict=True):
        assert_same_prompt_logprobs(output.prompt_logprobs, expected.prompt_logprobs)


@pytest.mark.slow
def test_smollm2_equal_hf_with_decoded_tokens(smollm2_hf):
    llm = LLM("default", dtype="float32", max_num_batched_tokens=64, max_num_seqs=4)
    text = "The capital of France is Paris. The capital of Italy is Rome, and of Spain"
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    (output,) = llm.generate([text], params, use_tqdm=False)
    prompt = output.prompt_token_ids
    assert len(prompt) > 16  # several chunks of 32
    assert_matches_hf(output.prompt_logprobs, prompt, hf_prompt_logprobs(smollm2_hf, prompt), 2)
    tokenizer = llm.get_tokenizer()
    for entry in output.prompt_logprobs[1:]:
        for token, logprob in entry.items():
            assert logprob.decoded_token == tokenizer.decode([token])
    pairs = zip(output.prompt_logprobs[1:], prompt[1:], strict=True)
    assert "".join(entry[token].decoded_token for entry, token in pairs).strip() in text
