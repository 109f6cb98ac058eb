"""The OpenAI-compatible API as clients use it: the official `openai` package (and httpx for
tandem's own endpoints) against a real `tandem serve` process. Every greedy answer must equal the
offline `LLM`'s for the same request (greedy_reference.py says how exactly)."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

import tandem
from tandem.sampling_params import SamplingParams

from greedy_reference import assert_same_greedy, greedy
from server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]

PROMPT = "The capital of France is"
OTHER_PROMPT = "def fibonacci(n):"
COUNTING = "1, 2, 3, 4,"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
SHORT_CHAT = [{"role": "user", "content": "Say hi."}]  # answered in ~24 tokens, then EOS
MODEL = "default"
N = 16  # tokens per greedy request (unless a test needs more)


@pytest.fixture(scope="module")
def client(default_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=default_server.base_url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(default_server: ServerProcess) -> httpx.Client:
    with httpx.Client(base_url=default_server.url, timeout=120) as http:
        yield http


_offline_outputs: dict[tuple[str, str], object] = {}


def offline(llm, prompt, *params: SamplingParams):
    """The offline output for one prompt (a text, token ids, or a conversation) under each of
    `params`, from one batched run; remembered, since several tests ask for the same."""
    missing = [p for p in params if (repr(prompt), repr(p)) not in _offline_outputs]
    if missing:
        if isinstance(prompt, list) and isinstance(prompt[0], dict):
            outputs = llm.chat([prompt] * len(missing), missing, use_tqdm=False)
        else:
            one = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
            outputs = llm.generate([one] * len(missing), missing, use_tqdm=False)
        for p, output in zip(missing, outputs, strict=True):
            _offline_outputs[repr(prompt), repr(p)] = output
    found = [_offline_outputs[repr(prompt), repr(p)] for p in params]
    return found[0] if len(found) == 1 else found


def token_ids_of(choice) -> list[int] | None:
    return (choice.model_extra or {}).get("token_ids")


# -- completions and chat, greedy = offline --------------------------------------------------


def test_completion_equals_offline_greedy(client, offline_llm):
    reference = offline(offline_llm, PROMPT, greedy(N))
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert response.object == "text_completion" and response.model == MODEL
    assert response.id.startswith("cmpl-")
    [choice] = response.choices
    assert choice.index == 0
    assert_same_greedy(token_ids_of(choice), choice.text, reference.outputs[0], "completion")
    assert choice.finish_reason == reference.outputs[0].finish_reason
    usage = response.usage
    assert usage.prompt_tokens == len(reference.prompt_token_ids)
    assert usage.completion_tokens == len(token_ids_of(choice))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_equals_offline_greedy(client, offline_llm):
    reference = offline(offline_llm, CHAT, greedy(N))
    response = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=N, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    [choice] = response.choices
    assert choice.message.role == "assistant"
    assert_same_greedy(token_ids_of(choice), choice.message.content, reference.outputs[0], "chat")
    assert choice.finish_reason == reference.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert response.usage.completion_tokens == len(token_ids_of(choice))


def test_completion_stream_with_usage(client, offline_llm):
    reference = offline(offline_llm, PROMPT, greedy(N))
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
        )
    )  # fmt: skip
    *body, last = chunks
    assert last.choices == [] and last.usage is not None, last
    assert body and all(chunk.usage is None and len(chunk.choices) == 1 for chunk in body)
    assert len({chunk.id for chunk in chunks}) == 1
    text = "".join(chunk.choices[0].text for chunk in body)
    token_ids = [t for chunk in body for t in token_ids_of(chunk.choices[0]) or []]
    assert_same_greedy(token_ids, text, reference.outputs[0], "streamed completion")
    finish_reasons = [chunk.choices[0].finish_reason for chunk in body]
    assert finish_reasons[-1] == reference.outputs[0].finish_reason
    assert all(reason is None for reason in finish_reasons[:-1])
    assert last.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert last.usage.completion_tokens == len(token_ids)


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream(client, offline_llm, include_usage):
    reference = offline(offline_llm, CHAT, greedy(N))
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=N, temperature=0, stream=True,
            extra_body={"return_token_ids": True}, **options,
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    if include_usage:
        *chunks, last = chunks
        assert last.choices == [] and last.usage.completion_tokens > 0
        assert last.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert all(chunk.usage is None and len(chunk.choices) == 1 for chunk in chunks)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    token_ids = [t for chunk in chunks for t in token_ids_of(chunk.choices[0]) or []]
    assert_same_greedy(token_ids, text, reference.outputs[0], "streamed chat")
    assert chunks[-1].choices[0].finish_reason == reference.outputs[0].finish_reason
    if include_usage:
        assert last.usage.completion_tokens == len(token_ids)


# -- prompts: text, token ids, batches of either; n > 1 ------------------------------------


def test_prompt_shapes_and_batches(client, offline_llm):
    tokenizer = offline_llm.get_tokenizer()
    ids, other_ids = tokenizer(PROMPT).input_ids, tokenizer(OTHER_PROMPT).input_ids
    first = offline(offline_llm, PROMPT, greedy(N)).outputs[0]
    second = offline(offline_llm, OTHER_PROMPT, greedy(N)).outputs[0]
    for prompt in ([PROMPT, OTHER_PROMPT], [ids, other_ids], ids):
        response = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=N, temperature=0,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        expected = [first] if prompt is ids else [first, second]
        assert [choice.index for choice in response.choices] == list(range(len(expected)))
        for choice, reference in zip(response.choices, expected, strict=True):
            assert_same_greedy(token_ids_of(choice), choice.text, reference, f"prompt {prompt}")
        prompt_tokens = len(ids) + (0 if prompt is ids else len(other_ids))
        assert response.usage.prompt_tokens == prompt_tokens


def test_batch_stream_with_n(client, offline_llm):
    """Two prompts, n=2, streamed: choice index = prompt index * n + sequence index, each choice
    its own greedy text and one finish_reason."""
    first = offline(offline_llm, PROMPT, greedy(N)).outputs[0]
    second = offline(offline_llm, OTHER_PROMPT, greedy(N)).outputs[0]
    stream = client.completions.create(
        model=MODEL, prompt=[PROMPT, OTHER_PROMPT], n=2, max_tokens=N, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    texts: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    finishes: dict[int, list[str]] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            tokens.setdefault(choice.index, []).extend(token_ids_of(choice) or [])
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert sorted(texts) == [0, 1, 2, 3]
    for index, reference in enumerate([first, first, second, second]):
        assert_same_greedy(tokens[index], texts[index], reference, f"choice {index}")
        assert finishes[index] == [reference.finish_reason]
    assert usage.completion_tokens == sum(len(t) for t in tokens.values())


def test_n_choices(client, offline_llm):
    reference = offline(offline_llm, PROMPT, greedy(N)).outputs[0]
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, n=3, max_tokens=N, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    for choice in response.choices:
        assert_same_greedy(token_ids_of(choice), choice.text, reference, f"n=3 #{choice.index}")
    assert response.usage.completion_tokens == sum(
        len(token_ids_of(choice)) for choice in response.choices
    )
    # streamed chat: each choice its own text and exactly one finish_reason
    reference = offline(offline_llm, CHAT, greedy(N)).outputs[0]
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, n=3, max_tokens=N, temperature=0, stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert texts == {index: reference.text for index in range(3)}
    assert finishes == {index: [reference.finish_reason] for index in range(3)}
    # Sampled: the choices are drawn independently, so four stories cannot all be equal.
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], n=4,
        max_tokens=16, temperature=1.0,
    )  # fmt: skip
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    assert len({choice.message.content for choice in response.choices}) > 1


# -- logprobs and echo ------------------------------------------------------------------------


def _top2(row) -> list:
    return sorted(row.values(), key=lambda logprob: logprob.rank)[:2]


def test_completion_logprobs(client, offline_llm):
    reference = offline(offline_llm, PROMPT, greedy(N)).outputs[0]
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=2
    )
    choice = response.choices[0]
    assert choice.text == reference.text
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(reference.token_ids)
    assert "".join(logprobs.tokens) == choice.text
    offset = 0
    for position, row in enumerate(reference.logprobs):
        chosen = row[reference.token_ids[position]]
        assert logprobs.tokens[position] == chosen.decoded_token
        assert logprobs.token_logprobs[position] == pytest.approx(chosen.logprob, abs=1e-3)
        top = logprobs.top_logprobs[position]
        expected = {lp.decoded_token: lp.logprob for lp in _top2(row)}
        assert top.keys() == expected.keys()
        for token, value in expected.items():
            assert top[token] == pytest.approx(value, abs=1e-3)
        assert logprobs.text_offset[position] == offset
        offset += len(logprobs.tokens[position])


def test_chat_logprobs(client, offline_llm):
    reference = offline(offline_llm, CHAT, greedy(N)).outputs[0]
    response = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=N, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = response.choices[0]
    content = choice.logprobs.content
    assert len(content) == len(reference.token_ids) == response.usage.completion_tokens
    # the tokens spell the answer (and the EOS that ended it, which the text leaves out)
    assert "".join(entry.token for entry in content).startswith(choice.message.content)
    for entry, token_id, row in zip(content, reference.token_ids, reference.logprobs, strict=True):
        assert entry.token == row[token_id].decoded_token
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(row[token_id].logprob, abs=1e-3)
        assert [top.token for top in entry.top_logprobs] == [lp.decoded_token for lp in _top2(row)]
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    # logprobs without top_logprobs: the sampled tokens' only
    response = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 4 and all(entry.top_logprobs == [] for entry in content)
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert response.choices[0].logprobs is None


def test_echo(client, offline_llm):
    reference = offline(offline_llm, PROMPT, greedy(N))
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, echo=True
    )
    assert response.choices[0].text == PROMPT + reference.outputs[0].text
    # with logprobs, the prompt's tokens come first; the first has no logprob
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, echo=True, logprobs=1
    )
    logprobs = response.choices[0].logprobs
    num_prompt = len(reference.prompt_token_ids)
    assert len(logprobs.tokens) == num_prompt + N
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    # the first prompt token has no logprob, but its text (as in vLLM and OpenAI)
    first_text = offline_llm.get_tokenizer().decode([reference.prompt_token_ids[0]])
    assert logprobs.tokens[0] == first_text != ""
    assert all(isinstance(value, float) for value in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens[num_prompt:]) == reference.outputs[0].text
    # streamed: the prompt arrives once, in front of the first piece
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, echo=True, stream=True
    )
    pieces = [chunk.choices[0].text for chunk in stream]
    assert pieces[0].startswith(PROMPT)
    assert "".join(pieces) == PROMPT + reference.outputs[0].text


def test_logprob_tokens_as_token_ids(client, offline_llm):
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:{id}" (so a
    client knows the exact token even where several decode to the same text); the text
    itself is unchanged."""
    reference = offline(offline_llm, PROMPT, greedy(N)).outputs[0]
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.text == reference.text
    names = [f"token_id:{token_id}" for token_id in reference.token_ids]
    assert choice.logprobs.tokens == names
    for top, row in zip(choice.logprobs.top_logprobs, reference.logprobs, strict=True):
        assert set(top) == {f"token_id:{token_id}" for token_id, lp in row.items() if lp.rank <= 2}
    chat_reference = offline(offline_llm, CHAT, greedy(N)).outputs[0]
    response = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=N, temperature=0, logprobs=True, top_logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    content = response.choices[0].logprobs.content
    expected = [f"token_id:{token_id}" for token_id in chat_reference.token_ids]
    assert [entry.token for entry in content] == expected
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)


def test_logprob_token_ids_score_fixed_tokens(client, offline_llm):
    """vLLM's logprob_token_ids: at every generated token, the logprobs of the asked tokens
    (whatever their rank) in place of the top-N, as the offline engine gives them."""
    tokenizer = offline_llm.get_tokenizer()
    asked = [tokenizer.encode(word, add_special_tokens=False)[0] for word in (" Paris", " London")]
    params = greedy(4, logprob_token_ids=asked)
    reference = offline(offline_llm, PROMPT, params).outputs[0]
    names = {token_id: tokenizer.decode([token_id]) for token_id in asked}
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
        extra_body={"logprob_token_ids": asked},
    )  # fmt: skip
    for top, row, token_id in zip(
        response.choices[0].logprobs.top_logprobs, reference.logprobs, reference.token_ids,
        strict=True,
    ):  # fmt: skip
        expected = {names[t]: row[t].logprob for t in asked}
        expected.setdefault(row[token_id].decoded_token, row[token_id].logprob)
        assert top.keys() == expected.keys()
        for name, value in expected.items():
            assert top[name] == pytest.approx(value, abs=1e-3)
    response = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
        extra_body={"logprob_token_ids": asked},
    )  # fmt: skip
    [chat_reference] = offline_llm.chat([CHAT], greedy(3, logprob_token_ids=asked), use_tqdm=False)
    rows = chat_reference.outputs[0].logprobs
    for entry, row in zip(response.choices[0].logprobs.content, rows, strict=True):
        by_rank = sorted(asked, key=lambda t: row[t].rank)
        assert [top.token for top in entry.top_logprobs] == [names[t] for t in by_rank]
        assert [top.logprob for top in entry.top_logprobs] == pytest.approx(
            [row[t].logprob for t in by_rank], abs=1e-3
        )


def test_truncation_side_right_keeps_the_first_prompt_tokens(client, offline_llm):
    prompt = list(range(1000, 1020))
    reference = offline(offline_llm, prompt[:5], greedy(4)).outputs[0]
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
        extra_body={"truncate_prompt_tokens": 5, "truncation_side": "right",
                    "return_token_ids": True},
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.model_extra["prompt_token_ids"] == prompt[:5]
    assert response.usage.prompt_tokens == 5
    assert_same_greedy(token_ids_of(choice), choice.text, reference, "truncated on the right")


def test_chat_echo_returns_the_continued_message_whole(client, offline_llm):
    """vLLM's chat echo: continuing an assistant message, the reply starts with it."""
    start = "The capital of France is"
    conversation = [*CHAT, {"role": "assistant", "content": start}]
    [reference] = offline_llm.chat(
        [conversation], greedy(N), add_generation_prompt=False, continue_final_message=True,
        use_tqdm=False,
    )  # fmt: skip
    settings = dict(
        model=MODEL, messages=conversation, max_tokens=N, temperature=0,
        extra_body={"echo": True, "add_generation_prompt": False,
                    "continue_final_message": True},
    )  # fmt: skip
    message = client.chat.completions.create(**settings).choices[0].message
    assert message.role == "assistant"
    assert message.content == start + reference.outputs[0].text
    chunks = list(client.chat.completions.create(**settings, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content == start  # the echo, before any new text
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == start + reference.outputs[0].text


def _beam_text(tokenizer, beam, num_prompt: int) -> str:
    generated = beam.tokens[num_prompt:]
    if beam.finish_reason == "stop":
        generated = generated[:-1]  # the EOS that ended it is not text
    return tokenizer.decode(generated, skip_special_tokens=True)


def test_beam_search_equals_offline(client, offline_llm):
    """vLLM's use_beam_search: the n best beams, best first, as the offline LLM.beam_search
    finds them for the same prompt tokens (completions, chat, streamed)."""
    tokenizer = offline_llm.get_tokenizer()
    settings = dict(
        model=MODEL, max_tokens=6, temperature=0, n=2,
        extra_body={"use_beam_search": True, "length_penalty": 0.5, "return_token_ids": True},
    )  # fmt: skip
    params = tandem.BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=0.5)
    for route in ("completions", "chat"):
        if route == "completions":
            response = client.completions.create(prompt=PROMPT, **settings)
            prompt_ids = response.choices[0].model_extra["prompt_token_ids"]
            texts = [choice.text for choice in response.choices]
        else:
            response = client.chat.completions.create(messages=CHAT, **settings)
            prompt_ids = response.model_extra["prompt_token_ids"]
            texts = [choice.message.content for choice in response.choices]
        [reference] = offline_llm.beam_search([{"prompt_token_ids": prompt_ids}], params)
        beams = reference.sequences
        assert [c.index for c in response.choices] == [0, 1]
        assert [token_ids_of(c) for c in response.choices] == [
            b.tokens[len(prompt_ids) :] for b in beams
        ], route
        assert texts == [_beam_text(tokenizer, b, len(prompt_ids)) for b in beams]
        assert [c.finish_reason for c in response.choices] == [b.finish_reason for b in beams]
        generated = sum(len(token_ids_of(choice)) for choice in response.choices)
        assert response.usage.completion_tokens == generated
    stream = client.completions.create(prompt=PROMPT, stream=True, **settings)
    streamed = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    first = client.completions.create(prompt=PROMPT, **settings)
    assert streamed == [choice.text for choice in first.choices]


def test_beam_search_refuses_what_it_cannot_honour(http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "use_beam_search": True}
    for field, value in (("top_p", 0.5), ("seed", 1), ("stop", ["."]), ("min_tokens", 2)):
        response = http.post("/v1/completions", json={**body, field: value})
        assert response.status_code == 400, field
        error = response.json()["error"]
        assert error["param"] == field and "does not apply to beam search" in error["message"]
    # values that ask for nothing are fine
    response = http.post("/v1/completions", json={**body, "top_p": 1.0, "stop": []})
    assert response.status_code == 200


def test_response_role_and_token_ids_as_names_by_flag(server_factory):
    """vLLM's server flags: --response-role names new chat replies; with
    --return-tokens-as-token-ids logprobs name tokens by id unless a request says false."""
    server = server_factory.start(
        "--response-role", "bot", "--return-tokens-as-token-ids", name="flags-server"
    )
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
    settings = dict(model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True)
    response = client.chat.completions.create(**settings)
    assert response.choices[0].message.role == "bot"
    assert all(e.token.startswith("token_id:") for e in response.choices[0].logprobs.content)
    stream = client.chat.completions.create(**settings, stream=True)
    assert next(iter(stream)).choices[0].delta.role == "bot"
    response = client.chat.completions.create(
        **settings, extra_body={"return_tokens_as_token_ids": False}
    )
    assert not any(e.token.startswith("token_id:") for e in response.choices[0].logprobs.content)


def test_long_prompt_logprobs_cross_in_one_large_message(client, offline_llm):
    """A 1,500-token prompt's 20 top logprobs per position leave the engine core in one
    message of about a megabyte: several times what the output socket holds at once. They
    arrive whole and equal the offline engine's."""
    prompt = list(range(1000, 2500))
    reference = offline(
        offline_llm, prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=20)
    )
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=20
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(prompt) + 1
    assert all(len(top) > 10 for top in logprobs.top_logprobs[1 : len(prompt)])
    expected = [
        row[token].logprob
        for token, row in zip(prompt[1:], reference.prompt_logprobs[1:], strict=True)
    ]
    assert logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(expected, abs=1e-4)


# -- usage: prefix-cache hits, cache_salt ------------------------------------------------------


def test_cached_tokens_in_usage(client):
    """The same long prompt twice: the second reuses the first's full KV blocks; a different
    cache_salt shares nothing."""
    nonce = uuid.uuid4().hex  # first, so no earlier request shares even the first block
    prompt = f"{nonce} " + "The quick brown fox jumps over the lazy dog. " * 30

    def cached(**kwargs) -> tuple[int, int]:
        response = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, temperature=0, **kwargs
        )
        usage = response.usage
        return usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens

    first, prompt_tokens = cached()
    assert prompt_tokens > 200 and first == 0
    second, _ = cached()
    assert 0 < second < prompt_tokens and second % 16 == 0, second
    assert second >= prompt_tokens - 32  # every full block but the one holding the last token
    assert cached(extra_body={"cache_salt": "salt-1"})[0] == 0
    assert cached(extra_body={"cache_salt": "salt-1"})[0] == second
    assert cached(extra_body={"cache_salt": "salt-2"})[0] == 0
    # streamed usage reports them too
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == second


# -- stop strings ---------------------------------------------------------------------------


def test_stop_strings(client, offline_llm):
    reference = offline(offline_llm, PROMPT, greedy(32)).outputs[0]
    text = reference.text
    # a stop string from the middle of the greedy text that spans several tokens
    middle = len(text) // 2
    stop = text[middle : middle + 5]
    cut = text.find(stop)
    assert cut > 0 and len(reference.token_ids) > 8, "the reference text is too short"

    def ask(**kwargs):
        return client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, **kwargs
        )

    choice = ask(stop=stop).choices[0]
    assert choice.text == text[:cut]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    choice = ask(stop=stop, extra_body={"include_stop_str_in_output": True}).choices[0]
    assert choice.text == text[: cut + len(stop)] and choice.finish_reason == "stop"
    # several: the earliest match wins, whichever the list order
    early = text[2:5]
    assert text.find(early) < cut
    choice = ask(stop=[stop, early]).choices[0]
    assert choice.text == text[: text.find(early)]
    assert choice.model_extra["stop_reason"] == early
    # streamed: no piece of a stop string leaks out before it is known not to match
    pieces = [chunk.choices[0] for chunk in ask(stop=stop, stream=True)]
    assert "".join(piece.text for piece in pieces) == text[:cut]
    assert pieces[-1].finish_reason == "stop"


# -- vLLM's extra sampling fields --------------------------------------------------------------

# (name, prompt, the request's extra fields, the offline SamplingParams that must give the
# same greedy answer, the offline SamplingParams that must NOT: without the field honoured)
EXTRA_CASES = [
    ("top_k=1", PROMPT, dict(temperature=1.0, top_k=1), dict(), None),
    ("min_p=1", PROMPT, dict(temperature=1.0, min_p=1.0), dict(), None),
    ("top_p tiny", PROMPT, dict(temperature=1.0, top_p=1e-6), dict(), None),
    ("repetition_penalty", COUNTING, dict(repetition_penalty=1.5),
     dict(repetition_penalty=1.5), dict()),
    ("frequency_penalty", COUNTING, dict(frequency_penalty=1.5),
     dict(frequency_penalty=1.5), dict()),
    ("ignore_eos", SHORT_CHAT, dict(ignore_eos=True), dict(ignore_eos=True), dict()),
    ("min_tokens", SHORT_CHAT, dict(min_tokens=28), dict(min_tokens=28), dict()),
    ("skip_special_tokens=false", SHORT_CHAT, dict(ignore_eos=True, skip_special_tokens=False),
     dict(ignore_eos=True, skip_special_tokens=False), dict(ignore_eos=True)),
    ("logit_bias", PROMPT, dict(logit_bias={"28": 100}), dict(logit_bias={28: 100}), dict()),
    ("allowed_token_ids", PROMPT, dict(allowed_token_ids=[28, 29, 30]),
     dict(allowed_token_ids=[28, 29, 30]), dict()),
    ("bad_words", PROMPT, dict(bad_words=["Paris"]), dict(bad_words=["Paris"]), dict()),
    ("truncate_prompt_tokens", PROMPT, dict(truncate_prompt_tokens=2),
     dict(truncate_prompt_tokens=2), dict()),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "prompt", "fields", "same_as", "differs_from"),
    EXTRA_CASES,
    ids=[case[0] for case in EXTRA_CASES],
)
def test_vllm_extra_fields(client, offline_llm, name, prompt, fields, same_as, differs_from):
    max_tokens = 32  # "Say hi." is answered in 24 tokens: ignore_eos and min_tokens show
    fields = {"temperature": 0, **fields}
    if differs_from is None:  # sampling that must collapse to the argmax
        reference = offline(offline_llm, prompt, greedy(max_tokens)).outputs[0]
    else:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, **same_as)
        unhonoured = SamplingParams(temperature=0, max_tokens=max_tokens, **differs_from)
        reference, without = offline(offline_llm, prompt, params, unhonoured)
        reference = reference.outputs[0]
        assert without.outputs[0].text != reference.text, (
            f"{name}: the case cannot tell whether the field is honoured"
        )
    standard = {k: fields.pop(k) for k in ("temperature", "top_p", "frequency_penalty")
                if k in fields}  # fmt: skip
    extra_body = {**fields, "return_token_ids": True}
    if isinstance(prompt, list):
        response = client.chat.completions.create(
            model=MODEL, messages=prompt, max_tokens=max_tokens, extra_body=extra_body, **standard
        )
        choice = response.choices[0]
        text = choice.message.content
    else:
        response = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, extra_body=extra_body, **standard
        )
        choice = response.choices[0]
        text = choice.text
    assert_same_greedy(token_ids_of(choice), text, reference, name)
    assert choice.finish_reason == reference.finish_reason


def test_stop_token_ids(client, offline_llm):
    reference = offline(offline_llm, PROMPT, greedy(32)).outputs[0]
    stop_id = reference.token_ids[5]
    expected = offline(offline_llm, PROMPT, SamplingParams(
        temperature=0, max_tokens=32, stop_token_ids=[stop_id])).outputs[0]  # fmt: skip
    assert expected.finish_reason == "stop" and len(expected.token_ids) <= 6
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0,
        extra_body={"stop_token_ids": [stop_id], "return_token_ids": True},
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.text == expected.text and token_ids_of(choice) == expected.token_ids
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop_id


# -- the other endpoints ----------------------------------------------------------------------


def test_models(client, offline_llm):
    models = client.models.list().data
    assert [model.id for model in models] == [MODEL]
    assert models[0].object == "model" and models[0].owned_by == "tandem"
    assert models[0].model_extra["max_model_len"] == offline_llm.config.scheduler.max_model_len


def test_chat_documents_reach_the_template(http, offline_llm):
    """vLLM's `documents` (for templates that render them, as RAG models' do), in /tokenize
    and the chat route alike; chat_template_kwargs may still override them."""
    template = (
        "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    documents = [{"title": "Paris", "text": "the capital of France"}]
    body = {"messages": CHAT, "chat_template": template, "documents": documents}
    tokens = http.post("/tokenize", json=body).json()["tokens"]
    expected = "[Paris: the capital of France]" + CHAT[0]["content"]
    tokenizer = offline_llm.get_tokenizer()
    assert tokens == tokenizer(expected, add_special_tokens=False).input_ids
    response = http.post(
        "/v1/chat/completions",
        json={**body, "model": MODEL, "max_tokens": 1, "return_token_ids": True},
    )
    assert response.json()["prompt_token_ids"] == tokens
    overridden = {**body, "chat_template_kwargs": {"documents": []}}
    tokens = http.post("/tokenize", json=overridden).json()["tokens"]
    assert tokens == tokenizer(CHAT[0]["content"], add_special_tokens=False).input_ids


def test_tokenize_detokenize_version_health(http, offline_llm):
    tokenizer = offline_llm.get_tokenizer()
    body = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert body["tokens"] == tokenizer(PROMPT).input_ids
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == offline_llm.config.scheduler.max_model_len
    body = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    # messages are rendered with the chat template, as /v1/chat/completions renders them
    body = http.post("/tokenize", json={"messages": CHAT}).json()
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == tokenizer(rendered, add_special_tokens=False).input_ids
    assert body["tokens"] == offline(offline_llm, CHAT, greedy(N)).prompt_token_ids
    # round trip
    for text in (PROMPT, rendered, "naïve café — 東京 🙂"):
        tokens = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": text}
    assert http.get("/version").json() == {"version": tandem.__version__}
    response = http.get("/health")
    assert response.status_code == 200
