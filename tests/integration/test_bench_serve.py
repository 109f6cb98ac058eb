"""`tandem bench` end to end against a live `tandem serve`: valid JSON with every request's
timestamps, the figures, and readable PNGs; a sweep over request rates; compare."""

from __future__ import annotations

import json

import pytest

from tandem.bench.report import compute_metrics, load_run
from tandem.cli import main

from server_process import ServerProcess

pytestmark = pytest.mark.slow

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(log_dir=tmp_path_factory.mktemp("bench-server"), name="bench-server") as s:
        yield s


def bench(server, tmp_path, name: str, args: str):
    out = tmp_path / f"{name}.json"
    common = f"--disable-tqdm --out {out} --plots {tmp_path / 'plots'} --label {name}"
    main(["bench", "serve", "--base-url", server.url, *common.split(), *args.split()])
    return out


def test_serve_random_writes_records_metrics_and_plots(server, tmp_path, capsys):
    args = "--num-prompts 4 --input-len 16:48 --output-len 8 --request-rate 8 --goodput ttft:60000"
    out = bench(server, tmp_path, "random", args)
    assert "Output token throughput (tok/s)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["config"]["model"] == "default" and data["config"]["goodput"] == {"ttft": 60000}
    assert data["warmup"]["error"] is None
    records = data["records"]
    assert len(records) == 4 and all(r["error"] is None for r in records)
    for r in records:
        assert r["output_tokens"] == 8  # ignore_eos: exactly what was asked, from the usage
        assert 16 <= r["prompt_tokens"] <= 48  # one token per generated word
        assert r["send"] <= r["chunks"][0] <= r["chunks"][-1] <= r["end"]
    # the stored figures are the ones the records give
    again = compute_metrics(load_run(out)["records"], {"ttft": 60000})
    assert again["ttft_ms"] == pytest.approx(data["metrics"]["ttft_ms"])
    assert data["metrics"]["completed"] == 4 and data["metrics"]["goodput"] > 0
    for png in ("random_cdf.png", "random_itl.png"):
        assert (tmp_path / "plots" / png).read_bytes().startswith(PNG)


def test_stutter_chat_and_compare(server, tmp_path, capsys):
    args = "--workload stutter --num-prompts 1 --streams 2 --output-len 16 --long-prompt-len 128"
    stutter = bench(server, tmp_path, "stutter", args + " --long-start 0.3 --long-output-len 2")
    run = load_run(stutter)
    assert [r.tag for r in run["records"]] == ["stream", "stream", "long"]
    assert all(r.ok for r in run["records"])
    args = "--workload multi-turn --endpoint chat --num-prompts 1 --turns 2 --input-len 8"
    chat = bench(server, tmp_path, "chat", args + " --output-len 4")
    turns = load_run(chat)["records"]
    assert [r.turn for r in turns] == [0, 1] and all(r.ok for r in turns)
    assert turns[1].prompt_tokens > turns[0].prompt_tokens + 8  # the history was re-sent
    capsys.readouterr()
    main(["bench", "compare", str(stutter), str(chat)])
    table = capsys.readouterr().out
    assert table.startswith("| metric | stutter | chat |") and "| completed | 3 | 2 |" in table
    assert (tmp_path / "plots" / "stutter_itl.png").read_bytes().startswith(PNG)


def test_sweep_over_request_rates(server, tmp_path):
    args = "--request-rates 2,inf --num-prompts 2 --input-len 16 --output-len 4 --disable-tqdm"
    main(["bench", "sweep", "--base-url", server.url, "--out-dir", str(tmp_path), *args.split()])
    assert (tmp_path / "sweep.png").read_bytes().startswith(PNG)
    assert "| metric | rate 2/s | rate inf/s |" in (tmp_path / "sweep.md").read_text()
    assert len(list(tmp_path.glob("sweep_*.json"))) == 2
