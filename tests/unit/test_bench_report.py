"""`tandem bench` figures from synthetic request records with known answers (vLLM's
definitions: TTFT, TPOT = (E2E - TTFT)/(n - 1), ITL = every gap, E2E to the last chunk)."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from tandem.bench.records import RequestRecord
from tandem.bench.report import (
    compare_table,
    compute_metrics,
    latencies,
    load_run,
    parse_goodput,
    percentile,
    runs_table,
    save_run,
)


def record(index, send, chunks, output_tokens=None, error=None, end=None, output_len=None,
           prompt_tokens=None):  # fmt: skip
    return RequestRecord(
        index=index, session=index, turn=0, tag="", prompt_len=10,
        output_len=output_len or max(len(chunks), 1), scheduled=send, send=send,
        chunks=list(chunks), end=end if end is not None else (chunks[-1] if chunks else send),
        prompt_tokens=prompt_tokens, output_tokens=output_tokens, error=error,
    )  # fmt: skip


@pytest.fixture
def records():
    return [
        # TTFT 0.5, E2E 1.1, gaps 0.1 0.2 0.3, TPOT 0.6 / 3 = 0.2
        record(0, 0.0, [0.5, 0.6, 0.8, 1.1], output_tokens=4, prompt_tokens=12),
        # one token: TTFT = E2E = 0.2, no TPOT
        record(1, 1.0, [1.2], output_tokens=1, prompt_tokens=8),
        # failed after two chunks: only the count and the duration see it
        record(2, 0.5, [0.9, 1.0], error="dropped", end=3.0),
        # no usage: two chunks = two tokens; TTFT 0.5, E2E 1.0, gap 0.5, TPOT 0.5
        record(3, 1.5, [2.0, 2.5], output_len=4),
    ]


def test_per_request_latencies(records):
    lat = latencies(records[0])
    assert lat.ttft == pytest.approx(0.5)
    assert lat.e2el == pytest.approx(1.1)
    assert lat.itls == pytest.approx([0.1, 0.2, 0.3])
    assert lat.tpot == pytest.approx(0.2)
    single = latencies(records[1])
    assert (single.ttft, single.e2el, single.itls, single.tpot) == (
        pytest.approx(0.2), pytest.approx(0.2), [], None)  # fmt: skip
    assert latencies(records[3]).tpot == pytest.approx(0.5)


def test_tpot_uses_the_servers_token_count_not_the_chunks():
    # 3 chunks but the server says 5 tokens (it bundled some): TPOT = (1.0 - 0.2) / 4
    lat = latencies(record(0, 0.0, [0.2, 0.6, 1.0], output_tokens=5))
    assert lat.tpot == pytest.approx(0.2)
    assert lat.itls == pytest.approx([0.4, 0.4])


def test_run_metrics(records):
    m = compute_metrics(records)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["short"] == 1  # record 3 asked for 4 tokens and got 2
    assert m["duration_s"] == pytest.approx(3.0)  # first send 0.0, last end 3.0 (the failure)
    assert m["input_tokens"] == 12 + 8 + 10  # usage where given, else the workload's length
    assert m["output_tokens"] == 4 + 1 + 2
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(7 / 3)
    assert m["total_token_throughput"] == pytest.approx(37 / 3)
    assert m["ttft_ms"]["mean"] == pytest.approx((500 + 200 + 500) / 3)
    assert m["ttft_ms"]["median"] == pytest.approx(500)
    assert m["ttft_ms"]["max"] == pytest.approx(500)
    assert m["e2el_ms"]["median"] == pytest.approx(1000)
    assert m["tpot_ms"]["mean"] == pytest.approx(350)  # 200 and 500; the 1-token one has none
    gaps = [0.1, 0.2, 0.3, 0.5]
    assert m["itl_ms"]["mean"] == pytest.approx(275)
    assert m["itl_ms"]["median"] == pytest.approx(250)
    assert m["itl_ms"]["p90"] == pytest.approx(440)  # rank 2.7: 0.3 + 0.7 * 0.2
    assert m["itl_ms"]["p99"] == pytest.approx(np.percentile(gaps, 99) * 1e3)
    assert m["itl_ms"]["max"] == pytest.approx(500)
    assert m["goodput"] is None
    assert m["errors"] == ["dropped"]


@pytest.mark.parametrize("p", [0, 1, 25, 50, 73.5, 90, 99, 100])
def test_percentile_matches_numpy(p):
    values = [0.3, 5.0, 1.0, 2.5, 2.5, 9.0, 0.01]
    assert percentile(values, p) == pytest.approx(np.percentile(values, p))
    assert percentile([4.0], p) == 4.0
    assert math.isnan(percentile([], p))


def test_goodput_counts_requests_meeting_every_slo(records):
    # TTFT <= 400 ms: only record 1 (200 ms)
    assert compute_metrics(records, {"ttft": 400})["goodput"] == pytest.approx(1 / 3)
    # TTFT <= 500 and TPOT <= 300: records 0 (200) and 1 (one token: TPOT 0); not 3 (500)
    assert compute_metrics(records, {"ttft": 500, "tpot": 300})["goodput"] == pytest.approx(2 / 3)
    assert compute_metrics(records, {"e2el": 1000})["goodput"] == pytest.approx(2 / 3)
    assert compute_metrics(records, {"ttft": 1})["goodput"] == 0.0


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    with pytest.raises(argparse.ArgumentTypeError, match="key"):
        parse_goodput(["itl:5"])
    with pytest.raises(argparse.ArgumentTypeError, match="MILLISECONDS"):
        parse_goodput(["ttft:fast"])


def test_all_failed_gives_counts_and_no_latencies():
    m = compute_metrics([record(0, 0.0, [], error="HTTP 500", end=0.1)])
    assert (m["completed"], m["failed"], m["output_tokens"]) == (0, 1, 0)
    assert math.isnan(m["ttft_ms"]["median"])
    assert m["request_throughput"] == 0.0


def test_json_round_trip_and_compare_table(tmp_path, records):
    run = {"label": "a", "config": {"goodput": {"ttft": 400}}, "records": records}
    save_run(run, tmp_path / "a.json")
    again = load_run(tmp_path / "a.json")
    assert [r.to_dict() for r in again["records"]] == [r.to_dict() for r in records]
    other = dict(again, label="b", records=again["records"][:2])
    table = compare_table([again, other])
    lines = table.splitlines()
    assert lines[0] == "| metric | a | b |"
    assert "| completed | 3 | 2 |" in lines
    assert "| failed | 1 | 0 |" in lines
    assert any(line.startswith("| goodput (req/s) | 0.33 |") for line in lines)
    assert any(line.startswith("| ITL p90 (ms) | 440.0 |") for line in lines)


def test_runs_table_one_row_per_run(records):
    table = runs_table([{"label": "x", "records": records}], {"ttft": 400})
    header, _, row = table.splitlines()
    assert header.startswith("| run | ok/failed | req/s | out tok/s | TTFT p50 |")
    assert header.endswith("| goodput |")
    assert row.startswith("| x | 3/1 | 1.00 | 2.3 | 500 |") and row.endswith("| 0.33 |")
