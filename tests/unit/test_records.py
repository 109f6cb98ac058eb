"""The step loop's records: msgspec Structs where msgspec is installed, slotted dataclasses where
it is not (the engine core without msgspec); both must behave alike."""

from __future__ import annotations

import gc
import pickle
from collections.abc import Callable

import pytest

from tandem.core.scheduler import ScheduledRequest
from tandem.engine.engine_core import EngineCoreOutput
from tandem.outputs import Logprob
from tandem.records import as_dataclass, as_struct

msgspec = pytest.importorskip("msgspec")


def _point_class() -> type:
    class Point:
        """A record."""

        name: str
        values: list[int]
        weight: float | None = None

    return Point


def _both() -> tuple[type, type]:
    """The same record as a Struct and as a dataclass."""
    return as_struct(_point_class(), array_like=True), as_dataclass(_point_class())


@pytest.mark.parametrize("kind", ["struct", "dataclass"])
def test_records_construct_compare_and_mutate_alike(kind: str) -> None:
    struct, dataclass = _both()
    cls = struct if kind == "struct" else dataclass
    first = cls("a", [1, 2])
    assert (first.name, first.values, first.weight) == ("a", [1, 2], None)
    assert cls(name="a", values=[1, 2], weight=None) == first
    assert cls("a", [1, 2], 0.5) != first
    first.weight = 2.0  # records are mutable (prompt logprobs are attached after the fact)
    assert first.weight == 2.0
    assert not hasattr(first, "__dict__")  # slotted either way
    assert cls.__doc__ == "A record."
    with pytest.raises(TypeError):
        cls("a")  # a field without a default is required


def test_struct_records_are_not_tracked_by_the_collector() -> None:
    struct, dataclass = _both()
    assert not gc.is_tracked(struct("a", [1]))
    assert gc.is_tracked(dataclass("a", [1]))


def test_engine_core_output_crosses_processes_as_an_array() -> None:
    output = EngineCoreOutput(
        "req-1", [5, 6], [{5: Logprob(-0.5, 1)}, {6: Logprob(-1.0, 1)}], "length", None, 3, 0,
        1.0, 2.0, [2.0, 2.5], 3.0, None, 0, 0, {"remote": "x"},
    )  # fmt: skip
    encoded = msgspec.msgpack.encode(output)
    assert isinstance(msgspec.msgpack.decode(encoded), list)  # no field names on the wire
    assert msgspec.msgpack.decode(encoded, type=EngineCoreOutput) == output
    assert pickle.loads(pickle.dumps(output)) == output


def test_scheduled_request_needs_every_field() -> None:
    entry = ScheduledRequest("r", [1, 2], 1, 1, [0], True, [])
    assert entry.draft_token_ids == [] and entry.sample
    with pytest.raises(TypeError):
        ScheduledRequest("r", [1, 2], 1, 1, [0], True)


@pytest.mark.parametrize("make", [as_dataclass, lambda cls: as_struct(cls, array_like=False)])
def test_both_kinds_refuse_what_the_other_would_not_build_alike(
    make: Callable[[type], type],
) -> None:
    class WithMethod:
        name: str

        def describe(self) -> str:
            return self.name

    class WithListDefault:
        values: list[int] = []  # noqa: RUF012 - the mistake under test

    class WithBase(WithMethod):
        weight: float

    for cls in (WithMethod, WithListDefault, WithBase):
        with pytest.raises(TypeError):
            make(cls)
