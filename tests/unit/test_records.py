"""The step loop's records: msgspec Structs where msgspec is installed, slotted dataclasses where
it is not (the engine core without msgspec); both must behave alike."""

from __future__ import annotations

import dataclasses
import gc
import pickle

import pytest

from tandem.core.outputs import EngineCoreOutput
from tandem.core.scheduler import ScheduledRequest
from tandem.outputs import Logprob
from tandem.records import as_dataclass, as_struct, msgspec

needs_msgspec = pytest.mark.skipif(msgspec is None, reason="msgspec is not installed")


def _point_class() -> type:
    class Point:
        """A record."""

        name: str
        values: list[int]
        weight: float | None = None

    return Point


def _make(kind: str, cls: type) -> type:
    return as_struct(cls, array_like=True) if kind == "struct" else as_dataclass(cls)


KINDS = [pytest.param("struct", marks=needs_msgspec), "dataclass"]


@pytest.mark.parametrize("kind", KINDS)
def test_records_construct_compare_and_mutate_alike(kind: str) -> None:
    cls = _make(kind, _point_class())
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


@needs_msgspec
def test_struct_records_are_not_tracked_by_the_collector() -> None:
    assert not gc.is_tracked(_make("struct", _point_class())("a", [1]))
    assert gc.is_tracked(_make("dataclass", _point_class())("a", [1]))


@needs_msgspec
def test_engine_core_output_crosses_processes_as_an_array() -> None:
    output = EngineCoreOutput(
        "req-1", [5, 6], [{5: Logprob(-0.5, 1)}, {6: Logprob(-1.0, 1)}], "length", None, 3, 0,
        1.0, 2.0, 2.5, 3.0, None, 0, 0, {"remote": "x"},
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


@pytest.mark.parametrize("kind", KINDS)
def test_both_kinds_refuse_what_the_other_would_not_build_alike(kind: str) -> None:
    class WithMethod:
        name: str

        def describe(self) -> str:
            return self.name

    class WithSpecialMethod:
        size: int

        def __len__(self) -> int:
            return self.size

    class WithListDefault:
        values: list[int] = []  # noqa: RUF012 - the mistake under test

    class WithByteArrayDefault:
        data: bytearray = bytearray()

    class WithFieldSpecifier:
        values: list[int] = dataclasses.field(default_factory=list)

    class WithBase(WithMethod):
        weight: float

    for cls in (
        WithMethod, WithSpecialMethod, WithListDefault, WithByteArrayDefault,
        WithFieldSpecifier, WithBase,
    ):  # fmt: skip
        with pytest.raises(TypeError):
            _make(kind, cls)
