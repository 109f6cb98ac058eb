"""`tandem bench` workloads: deterministic per seed, honouring their length distributions and
timing, and request bodies built from them."""

from __future__ import annotations

import itertools
import json
import math
import statistics

import pytest

from tandem.bench import workloads as w
from tandem.bench.client import ClientConfig, completion_prompt, request_body
from tandem.bench.words import WORDS


def prompts(workload):
    return [[t.prompt for t in s.turns] for s in workload.sessions]


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: w.random_workload(20, seed, (8, 64), (4, 16)),
        lambda seed: w.random_workload(20, seed, (8, 64), (4, 16), tokens=True),
        lambda seed: w.chat_workload(20, seed),
        lambda seed: w.stutter_workload(3, seed),
        lambda seed: w.shared_prefix_workload(10, seed, prefix_len=64),
        lambda seed: w.multi_turn_workload(5, seed, turns=3),
    ],
    ids=["random", "random-tokens", "chat", "stutter", "shared-prefix", "multi-turn"],
)
def test_deterministic_per_seed(make):
    first, again, other = make(7), make(7), make(8)
    assert prompts(first) == prompts(again)
    assert [[t.output_len for t in s.turns] for s in first.sessions] == [
        [t.output_len for t in s.turns] for s in again.sessions
    ]
    assert prompts(first) != prompts(other)


def test_random_lengths_within_ranges():
    load = w.random_workload(300, 1, (10, 50), (3, 9))
    lengths = [s.turns[0].prompt_len for s in load.sessions]
    outputs = [s.turns[0].output_len for s in load.sessions]
    assert min(lengths) >= 10 and max(lengths) <= 50 and len(set(lengths)) > 30
    assert set(outputs) == set(range(3, 10))
    for session in load.sessions:
        words = session.turns[0].prompt.split()
        assert len(words) == session.turns[0].prompt_len
        assert set(words) <= set(WORDS)
    tokens = w.random_workload(50, 1, (5, 5), (2, 2), tokens=True, id_range=(100, 200))
    for session in tokens.sessions:
        assert len(session.turns[0].prompt) == 5
        assert all(100 <= t <= 200 for t in session.turns[0].prompt)


def test_chat_lengths_follow_the_published_means():
    load = w.chat_workload(20000, 3, max_input_len=10**6, max_output_len=10**6)
    inputs = [s.turns[0].prompt_len for s in load.sessions]
    outputs = [s.turns[0].output_len for s in load.sessions]
    assert statistics.mean(inputs) == pytest.approx(w.CHAT_INPUT_MEAN, rel=0.05)
    assert statistics.mean(outputs) == pytest.approx(w.CHAT_OUTPUT_MEAN, rel=0.05)
    # log-normal: the median is exp(mu) = mean * exp(-sigma^2 / 2)
    median = w.CHAT_INPUT_MEAN * math.exp(-(w.CHAT_INPUT_SIGMA**2) / 2)
    assert statistics.median(inputs) == pytest.approx(median, rel=0.05)
    capped = w.chat_workload(500, 3, scale=0.25, max_input_len=64, max_output_len=32)
    assert all(w.CHAT_MIN_LEN <= s.turns[0].prompt_len <= 64 for s in capped.sessions)
    assert all(w.CHAT_MIN_LEN <= s.turns[0].output_len <= 32 for s in capped.sessions)


def test_stutter_timing_and_tags():
    load = w.stutter_workload(3, 0, streams=4, input_len=(16, 16), output_len=(100, 100),
                              long_len=500, long_start=1.5, long_every=2.0)  # fmt: skip
    assert load.self_timed
    streams = [s for s in load.sessions if s.tag == "stream"]
    longs = [s for s in load.sessions if s.tag == "long"]
    assert len(streams) == 4 and all(
        s.arrival == 0 and s.turns[0].output_len == 100 for s in streams
    )
    assert [s.arrival for s in longs] == [1.5, 3.5, 5.5]
    assert all(s.turns[0].prompt_len == 500 for s in longs)
    assert all(len(s.turns[0].prompt.split()) == 500 for s in longs)


def test_shared_prefix_shares_one_system_prompt():
    load = w.shared_prefix_workload(6, 0, prefix_len=100, suffix_len=(10, 20))
    assert len({s.system for s in load.sessions}) == 1
    assert len(load.sessions[0].system.split()) == 100
    assert len({s.turns[0].prompt for s in load.sessions}) == 6
    tokens = w.shared_prefix_workload(4, 0, prefix_len=32, suffix_len=(8, 8), tokens=True)
    heads = {tuple(s.turns[0].prompt[:32]) for s in tokens.sessions}
    assert len(heads) == 1 and all(len(s.turns[0].prompt) == 40 for s in tokens.sessions)


def test_multi_turn_resends_history():
    load = w.multi_turn_workload(2, 0, turns=3, system_len=5, input_len=(4, 4))
    session = load.sessions[0]
    assert len(session.turns) == 3 and load.num_requests == 6
    answers = ["first answer", "second answer"]
    text = completion_prompt(session, 2, answers)
    assert text.startswith(session.system + "\n")
    assert text.index(session.turns[0].prompt) < text.index("first answer")
    assert text.index("second answer") < text.index(session.turns[2].prompt)
    assert text.endswith("Assistant:")
    chat = request_body(ClientConfig("http://x", "m", endpoint="chat"), session, 2, answers)
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert chat["messages"][2]["content"] == "first answer"


def test_request_body_asks_for_exact_lengths():
    load = w.random_workload(1, 0, (4, 4), (7, 7))
    body = request_body(ClientConfig("http://x", "m"), load.sessions[0], 0, [])
    assert body["max_tokens"] == 7 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["prompt"] == load.sessions[0].turns[0].prompt


def test_arrival_times():
    assert w.arrival_times(4, math.inf, 1.0, 0) == [0.0] * 4
    times = w.arrival_times(200, 4.0, 1.0, 0)
    assert times == w.arrival_times(200, 4.0, 1.0, 0)
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] == pytest.approx(199 / 4.0)  # the run averages the rate asked for
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # gamma gaps: coefficient of variation^2 = 1 / burstiness
    poisson_cv2 = statistics.pvariance(gaps) / statistics.mean(gaps) ** 2
    bursty = w.arrival_times(2000, 4.0, 0.25, 0)
    bursty_gaps = [b - a for a, b in itertools.pairwise(bursty)]
    bursty_cv2 = statistics.pvariance(bursty_gaps) / statistics.mean(bursty_gaps) ** 2
    assert poisson_cv2 == pytest.approx(1.0, abs=0.35)
    assert bursty_cv2 == pytest.approx(4.0, rel=0.3)
    with pytest.raises(ValueError):
        w.arrival_times(3, 1.0, 0.0, 0)


def test_jsonl_workload(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "hello there", "output_len": 5}, {"prompt": [1, 2, 3], "max_tokens": 2},
             {"prompt": "third", "output_len": 1, "system": "be brief"}]  # fmt: skip
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    load = w.jsonl_workload(path, None, 0)
    assert [s.turns[0].prompt for s in load.sessions] == ["hello there", [1, 2, 3], "third"]
    assert [s.turns[0].output_len for s in load.sessions] == [5, 2, 1]
    assert load.sessions[2].system == "be brief"
    assert len(w.jsonl_workload(path, 2, 0).sessions) == 2
    shuffled = [prompts(w.jsonl_workload(path, None, s, shuffle=True)) for s in range(6)]
    assert shuffled[0] == prompts(w.jsonl_workload(path, None, 0, shuffle=True))
    assert len({json.dumps(p) for p in shuffled}) > 1
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"prompts\.jsonl:1"):
        w.jsonl_workload(path, None, 0)


def test_parse_range():
    assert w.parse_range("5") == (5, 5)
    assert w.parse_range("3:9") == (3, 9)
    for bad in ("0", "9:3", "a:b"):
        with pytest.raises(Exception, match="LO"):
            w.parse_range(bad)
