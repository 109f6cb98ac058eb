"""Every engine step's telemetry reaches StepStats and the JSONL step log, with the counted work
of what the step computed and an MFU/MBU against the machine's peaks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.bench.step_plots import load_steps, machine_ceilings
from tandem.cli import main
from tandem.core.roofline import BatchSums, ModelShape, request_sums, sums_work
from tandem.core.step_cost import StepCostModel
from tandem.engine.engine_core import TELEMETRY_BATCH


def test_step_log_has_every_step_with_its_roofline(tiny_llama, tmp_path):
    folder, _ = tiny_llama
    log = tmp_path / "steps.jsonl"
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, step_log=log, peak_tflops=1.0,
              peak_bandwidth_gbps=10.0)  # fmt: skip
    prompt = {"prompt_token_ids": list(range(1, 21))}
    llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    core = llm.llm_engine.core
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, core.num_steps + 1))
    stats = list(core.step_stats)
    assert len(stats) == len(records)
    first = records[0]  # the whole prompt, and its first token sampled
    assert first["num_prefill_tokens"] == 20 and first["num_decode_tokens"] == 0
    shape = core.model_shape
    assert isinstance(shape, ModelShape)

    expected = sums_work(shape, request_sums(0, 20, True))
    assert first["flops"] == pytest.approx(expected.flops)
    assert first["bytes"] == pytest.approx(expected.bytes)
    for record in records:
        assert record["bound"] in ("compute", "memory")
        assert record["mfu"] == pytest.approx(record["flops"] / record["step_time"] / 1e12)
        assert record["mbu"] == pytest.approx(record["bytes"] / record["step_time"] / 10e9)
    assert len(records) == 4  # the prompt, then 3 decodes of one token
    assert all(r["num_decode_tokens"] == 1 and r["bound"] == "memory" for r in records[1:])


def test_plot_steps_draws_the_roofline_and_the_timeline(tiny_llama, tmp_path, capsys):
    folder, _ = tiny_llama
    log = tmp_path / "steps.jsonl"
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, step_log=log,
              max_num_batched_tokens=16, max_num_seqs=4)  # fmt: skip
    prompts = [{"prompt_token_ids": list(range(1, 41))}, {"prompt_token_ids": [3, 4, 5]}]
    llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    steps = load_steps(log)
    assert {"prefill", "decode"} <= {s["phase"] for s in steps}
    peak_flops, peak_bytes = machine_ceilings(steps)
    assert peak_flops == pytest.approx(llm.llm_engine.core.peaks.flops_per_second)
    assert peak_bytes == pytest.approx(llm.llm_engine.core.peaks.bytes_per_second)
    main(["plot", "steps", str(log), "--out", str(tmp_path / "plots")])
    printed = capsys.readouterr().out.split()
    assert [Path(p).name for p in printed] == ["roofline.png", "steps_timeline.png"]
    for path in printed:
        assert Path(path).stat().st_size > 10_000  # a drawn figure, not an empty canvas
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    with pytest.raises(ValueError, match="no steps"):
        load_steps(empty)


def test_itl_target_changes_steps_not_outputs(tiny_llama, tmp_path):
    """The same greedy tokens with and without --target-itl-ms; with it, long prompts go in
    smaller chunks next to the decodes, and every step carries the cost model's forecast."""
    folder, _ = tiny_llama
    prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 1 for j in range(n)]}
               for i, n in enumerate((12, 150, 240, 200, 9, 230))]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(folder, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=512)
    targeted = LLM(
        folder,
        dtype="float32",
        skip_tokenizer_init=True,
        max_num_batched_tokens=512,
        target_itl_ms=2.0,
    )
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in targeted.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    steps = list(targeted.llm_engine.core.step_stats)
    assert all(s.predicted_step_time > 0 for s in steps)
    assert len(steps) > len(plain.llm_engine.core.step_stats)  # smaller chunks: more steps


def test_batched_telemetry_is_the_step_by_step_telemetry(tiny_llama, tmp_path):
    """Steps' rooflines and forecasts are worked out TELEMETRY_BATCH at a time: they equal,
    to the bit, a cost model fed the same steps one by one, and the step log has every step
    once, in order, as step_stats has it."""
    folder, _ = tiny_llama
    log = tmp_path / "steps.jsonl"
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, step_log=log,
              max_num_batched_tokens=32, max_num_seqs=4)  # fmt: skip
    prompts = [{"prompt_token_ids": [(5 * i + j) % 200 + 1 for j in range(n)]}
               for i, n in enumerate((70, 9, 41))]  # fmt: skip
    llm.generate(prompts, SamplingParams(max_tokens=3 * TELEMETRY_BATCH, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    core = llm.llm_engine.core
    steps = list(core.step_stats)
    assert len(steps) == core.num_steps > 3 * TELEMETRY_BATCH
    assert {"prefill", "mixed", "decode"} <= {step.phase for step in steps}  # prompt chunks
    replay = StepCostModel(core.model_shape, core.peaks)
    for step in steps:
        sums = BatchSums(step.num_prefill_tokens + step.num_decode_tokens, step.num_attended,
                         step.num_context, step.num_sampled)  # fmt: skip
        work = sums_work(core.model_shape, sums)
        assert (step.flops, step.bytes) == (work.flops, work.bytes)
        seconds = step.step_time - step.propose_time
        assert step.predicted_step_time == replay.observe(sums, seconds, num_steps=step.num_steps)
    assert replay.coefficients == core.cost_model.coefficients is not None
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r.pop("step") for r in records] == list(range(1, len(steps) + 1))
    assert [{k: v for k, v in r.items() if k not in ("time", "phase")} for r in records] == [
        dataclasses.asdict(step) for step in steps
    ]


def test_stat_loggers_and_the_step_log_get_every_step_once(tiny_llama, tmp_path):
    """take_finished_stats hands each step's telemetry out once, at most TELEMETRY_BATCH - 1
    steps late while requests run; an engine gone idle (here: its last request aborted, no
    step after) has worked out every step, so the step log is whole without step_stats read."""
    folder, _ = tiny_llama
    log = tmp_path / "steps.jsonl"
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, step_log=log)
    engine, core = llm.llm_engine, llm.llm_engine.core
    engine.add_request("long", list(range(1, 30)), SamplingParams(max_tokens=100, ignore_eos=True))
    taken = []
    for _ in range(TELEMETRY_BATCH + 5):
        engine.step()
        taken += core.take_finished_stats()
        assert core.num_steps - TELEMETRY_BATCH < len(taken) <= core.num_steps
    engine.abort_request("long")
    assert not core.has_unfinished_requests()
    assert len(log.read_text().splitlines()) == core.num_steps == TELEMETRY_BATCH + 5
    taken += core.take_finished_stats()
    assert taken == list(core.step_stats) and core.take_finished_stats() == []


def test_a_scheduler_that_forecasts_gets_every_steps_learning_at_once(tiny_llama):
    """With an ITL target the scheduler sizes each step by the cost model: every step's
    telemetry, and the model's learning from it, is worked out before the next step."""
    folder, _ = tiny_llama
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, target_itl_ms=5.0)
    engine, core = llm.llm_engine, llm.llm_engine.core
    engine.add_request("long", list(range(1, 200)), SamplingParams(max_tokens=40, ignore_eos=True))
    num_taken = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_taken += len(core.take_finished_stats())
        assert num_taken == core.num_steps
    assert core.num_steps > TELEMETRY_BATCH
