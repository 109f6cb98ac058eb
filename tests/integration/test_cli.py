"""The CLI as a user runs it: real processes, the embedded model."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args],
        input=stdin, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_generate_chat_prompt():
    # fp32: in bf16 this 135M model's first answer token is a near-tie ("The" vs "L").
    result = run_cli("generate", "--chat", "--prompt", "What is the capital of France?",
                     "--max-tokens", "24", "--dtype", "float32")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "TTFT" in result.stdout and "tok/s" in result.stdout


def test_make_run_answers_with_the_default_dtype():
    """What `make run` does, in dtype="auto" (this machine's fastest formats)."""
    prompt = "Explain in two sentences why the sky is blue."
    result = run_cli("generate", "--chat", "--prompt", prompt, "--max-tokens", "40")
    assert result.returncode == 0, result.stderr
    assert "Rayleigh" in result.stdout


def test_chat_streams_answers_and_keeps_history():
    result = run_cli(
        "chat", "--max-tokens", "40", "--dtype", "float32",
        stdin="What is the capital of France?\nAnd of Italy?\n/exit\n",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and "Rome" in result.stdout
    assert result.stdout.count("TTFT") == 2


def test_bad_arguments_give_a_clear_error():
    result = run_cli("generate", "--prompt", "hi", "--model", "/nonexistent/model")
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr
    result = run_cli("generate", "--prompt", "hi", "--temperature", "-1")
    assert result.returncode == 2 and "temperature" in result.stderr
