"""What the API process does after the streams a step woke have taken their outputs: it records
the step's telemetry (recording a finished request observes every gap it lived through, and
when a batch finishes together that must not hold up every stream's last token), and tells the
core the chunks are written where it waits for that (stream writes first: core_process.py)."""

import asyncio

from tandem.core.outputs import EngineCoreOutput
from tandem.engine.async_llm import AsyncLLM
from tandem.engine.config import EngineConfig
from tandem.engine.messages import CoreOutputs, OutputsWritten
from tandem.engine.stats import FinishedRequestStats, SchedulerStats, StepStats
from tandem.sampling_params import SamplingParams

STATS = SchedulerStats(0, 0, 0.0, 16, 16, 0, 0, 0, 1, 2)


class FakeCoreClient:
    """Stands in for the engine-core process: the test hands the API process its messages."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue = asyncio.Queue()

    def send(self, message: object) -> None:
        pass

    async def recv(self) -> object:
        return await self.messages.get()

    def shutdown(self, timeout: float = 5.0) -> None:
        pass


class OrderLogger:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def record_steps(self, scheduler_stats: SchedulerStats, steps: list[StepStats]) -> None:
        self.events.append("steps")

    def record_finished(self, finished: FinishedRequestStats) -> None:
        self.events.append(f"finished {finished.request_id}")


def finishing_output(request_id: str) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id, [7], None, "length", None, 0, 0, 1.0, 1.0, 1.0, finished_time=1.0
    )


def test_after_the_streams_took_their_outputs_the_core_hears_then_the_stats_are_recorded(
    tiny_llama,
):
    async def scenario() -> list[str]:
        events: list[str] = []
        client = FakeCoreClient()
        client.send = lambda message: events.append(f"sent {message!r}")  # type: ignore
        config = EngineConfig.create(str(tiny_llama[0]), skip_tokenizer_init=True)
        engine = AsyncLLM(config, [OrderLogger(events)], client=client)
        engine._output_task = asyncio.create_task(engine._output_loop())
        params = SamplingParams(max_tokens=1, detokenize=False)

        async def consume(request_id: str) -> None:
            async for output in engine.generate([1, 2, 3], params, request_id):
                if output.finished:
                    events.append(f"got {request_id}")

        consumers = [asyncio.create_task(consume(name)) for name in ("a", "b")]
        await asyncio.sleep(0)  # both wait for their first output
        events.clear()  # the requests' own messages
        outputs = [finishing_output("a"), finishing_output("b")]
        await client.messages.put(CoreOutputs(outputs, [], STATS, [], written_ack=5))
        await asyncio.gather(*consumers)
        await asyncio.sleep(0)
        engine._output_task.cancel()
        return events

    assert asyncio.run(scenario()) == [
        "got a", "got b", f"sent {OutputsWritten(5)!r}", "steps", "finished a", "finished b",
    ]  # fmt: skip
