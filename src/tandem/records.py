"""Records the step loop makes by the thousand: one per running request per step (the
scheduler's `ScheduledRequest`, the core's `EngineCoreOutput`).

With msgspec installed (a dependency of the package) a record is a msgspec Struct: built in C,
about a third of a slotted dataclass's cost to make (75 against 220 ns for fifteen fields), not
tracked by the cyclic garbage collector (a record holds lists and numbers, never a cycle), and
encoded between processes as an array, five times faster than a dataclass's map of field
names. The engine core also runs where msgspec is missing (the lent GPU machine's Python has
only torch and the model libraries): there a record is a slotted dataclass with the same
fields and defaults (the `dataclasses` helpers, such as `replace`, and the collector's
tracking tell the two apart). A record is its fields alone, with immutable defaults: what
both kinds build alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

try:
    import msgspec
except ImportError:  # pragma: no cover - exercised on bare GPU machines
    msgspec = None

RecordType = TypeVar("RecordType", bound=type)

# What Python itself puts in a class's namespace; anything else in a record's body must be
# a field.
_CLASS_NAMESPACE = frozenset({
    "__module__", "__qualname__", "__doc__", "__annotations__", "__dict__", "__weakref__",
    "__firstlineno__", "__static_attributes__", "__annotate_func__", "__annotations_cache__",
})  # fmt: skip


def record(array_like: bool = False) -> Callable[[RecordType], RecordType]:
    """Class decorator: the annotated fields of the class body, in order, with their
    (immutable) defaults. `array_like`: encoded as an array of the fields' values (for records
    that cross processes; both ends share the class)."""

    def make(cls: RecordType) -> RecordType:
        if msgspec is None:
            return as_dataclass(cls)
        return as_struct(cls, array_like)

    return make


def _check_fields_only(cls: type) -> None:
    """Refuse what one kind would keep and the other lose or reject: a base class, methods
    (special ones included) or other attributes, mutable defaults (the dataclass rule: an
    unhashable value), field specifiers."""
    if cls.__bases__ != (object,):
        raise TypeError(f"record {cls.__name__} must not have a base class")
    for name, value in vars(cls).items():
        if name in _CLASS_NAMESPACE:
            continue
        if name not in cls.__annotations__:
            raise TypeError(f"record {cls.__name__} has an attribute that is not a field: {name}")
        if type(value).__hash__ is None or isinstance(value, dataclasses.Field):
            raise TypeError(f"record {cls.__name__}.{name}: a default must be immutable")
        if type(value).__module__.startswith("msgspec"):
            raise TypeError(f"record {cls.__name__}.{name}: a default must be a plain value")


def as_struct(cls: RecordType, array_like: bool) -> RecordType:
    """The record as a msgspec Struct, untracked by the collector."""
    assert msgspec is not None
    _check_fields_only(cls)
    fields = [
        (name, annotation) if name not in cls.__dict__ else (name, annotation, cls.__dict__[name])
        for name, annotation in cls.__annotations__.items()
    ]
    struct = msgspec.defstruct(
        cls.__name__, fields, array_like=array_like, gc=False, module=cls.__module__
    )
    struct.__qualname__ = cls.__qualname__
    struct.__doc__ = cls.__doc__
    return struct


def as_dataclass(cls: RecordType) -> RecordType:
    """The record as a slotted dataclass (without msgspec, and to test that path)."""
    _check_fields_only(cls)
    return dataclasses.dataclass(slots=True)(cls)
