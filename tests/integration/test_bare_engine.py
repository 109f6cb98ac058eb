"""The engine core runs without msgspec, pyzmq, gguf and the server extras, as on the lent GPU
machine, whose image has none of them: offline generation in a process where importing those
fails gives the tokens it gives here, and the step loop's records are the dataclass fallback
there (tandem/records.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tandem import LLM, SamplingParams

# Missing from the GPU image (the device library's KINDS.md lists what it holds).
MISSING_THERE = ("msgspec", "zmq", "gguf", "fastapi", "uvicorn", "pydantic", "httptools")

PROMPTS = [[1, 5, 9, 13, 17], [2, 4, 6], list(range(3, 40))]

SCRIPT = """
import dataclasses, json, sys
for name in {missing!r}:
    sys.modules[name] = None  # its import fails, as where the package is not installed
from tandem import LLM, SamplingParams
from tandem.core.scheduler import ScheduledRequest
from tandem.core.outputs import EngineCoreOutput
assert dataclasses.is_dataclass(ScheduledRequest) and dataclasses.is_dataclass(EngineCoreOutput)
llm = LLM({folder!r}, dtype="float32", skip_tokenizer_init=True, async_scheduling={async_mode})
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
outputs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}], params, use_tqdm=False)
print(json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
"""


def _bare_tokens(folder: Path, async_mode: bool) -> list[list[int]]:
    script = SCRIPT.format(
        missing=MISSING_THERE, folder=str(folder), async_mode=async_mode, prompts=PROMPTS
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_engine_without_msgspec_zmq_gguf_or_server_extras_gives_the_same_tokens(tiny_llama):
    folder = tiny_llama[0]
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    expected = [list(o.outputs[0].token_ids) for o in outputs]
    for async_mode in (False, True):
        assert _bare_tokens(folder, async_mode) == expected
