"""Fixtures for the server's integration tests: one shared `tandem serve` process with default
settings, the offline LLM whose outputs it must reproduce, and the server logs attached to the
report of any test that fails."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from server_process import KV_CACHE_MEMORY_BYTES, ServerProcess


class ServerFactory:
    """Starts servers a test needs for itself (ones it will kill); stops them afterwards."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.servers: list[ServerProcess] = []

    def start(self, *args: str, name: str = "server", **kwargs) -> ServerProcess:
        server = ServerProcess(*args, log_dir=self.log_dir, name=name, **kwargs)
        self.servers.append(server)
        return server.start()

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture(scope="session")
def default_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """`tandem serve` with default settings, shared by the test modules that do not stop it
    (a start loads the model: several seconds on two cores). It runs the chat templates that
    requests send, so that tests can send broken ones."""
    with ServerProcess(
        "--trust-request-chat-template",
        log_dir=tmp_path_factory.mktemp("server"),
        name="default-server",
    ) as server:
        yield server


@pytest.fixture
def server_factory(tmp_path) -> Iterator[ServerFactory]:
    factory = ServerFactory(tmp_path)
    yield factory
    factory.stop_all()


@pytest.fixture(scope="session")
def offline_llm():
    """The in-process engine whose greedy outputs the server must reproduce."""
    from tandem import LLM

    return LLM("default", dtype="float32", kv_cache_memory=KV_CACHE_MEMORY_BYTES)


@pytest.fixture(scope="session")
def smollm2_hf() -> torch.nn.Module:
    """HF transformers' own reading of the embedded GGUF (fp32): the reference for the embedded
    model's outputs. Loaded once: its GGUF dequantization takes seconds on two cores."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.models.loader import resolve_model_path

    path = resolve_model_path("default")
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def _servers(item: pytest.Item) -> list[ServerProcess]:
    servers = []
    for value in getattr(item, "funcargs", {}).values():
        if isinstance(value, ServerProcess):
            servers.append(value)
        elif isinstance(value, ServerFactory):
            servers += value.servers
    return servers


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failing server test shows the end of each server's log."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for server in _servers(item):
            tail = "\n".join(server.log().splitlines()[-150:])
            report.sections.append((f"{server.name} log ({server.log_path})", tail))
