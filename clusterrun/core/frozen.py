"""``@frozen``: the controller's frozen dataclasses (a hosts file, a plan, an event, an answer).

A frozen dataclass whose ``__eq__``, ``__hash__``, ``__repr__``, ``__setattr__`` and ``__delattr__`` are
five shared functions instead of source that ``dataclass`` writes and compiles for each class: with
over a hundred such classes that compiling was about 20 ms of every command's start
(docs/benchmarks.md). They behave as dataclass's own: equal when of the same class with equal fields
(``compare``), hashed by those fields (or by ``hash``), shown as ``Name(field=value, ...)`` (``repr``);
a field is set once, by ``__init__``, and ``FrozenInstanceError`` stops any other assignment or
deletion. ``__init__``, ``dataclasses.replace``/``fields``/``asdict`` are dataclass's (its plain
``__init__``: a frozen one writes through ``object.__setattr__``, which needs the compiled setters).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:
    def dataclass_transform(**_: object) -> Any:  # only type checkers need it (typing has it from 3.11)
        return lambda decorator: decorator

C = TypeVar("C", bound=type)

_FIELDS: dict[tuple[type, str], tuple[str, ...]] = {}  # (class, "compare"/"hash"/"repr") -> field names


def _names(cls: type, use: str) -> tuple[str, ...]:
    names = _FIELDS.get((cls, use))
    if names is None:
        fields = dataclasses.fields(cls)
        if use == "hash":  # dataclass's rule: a field's hash flag, else its compare flag
            names = tuple(f.name for f in fields if (f.compare if f.hash is None else f.hash))
        else:
            names = tuple(f.name for f in fields if getattr(f, use))
        _FIELDS[(cls, use)] = names
    return names


def _values(self: Any, use: str) -> tuple[Any, ...]:
    return tuple(getattr(self, name) for name in _names(self.__class__, use))


def _eq(self: Any, other: object) -> Any:  # bool, or NotImplemented
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _values(self, "compare") == _values(other, "compare")  # tuples: identity first, as dataclass's


def _hash(self: Any) -> int:
    return hash(_values(self, "hash"))


def _repr(self: Any) -> str:
    shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in _names(self.__class__, "repr"))
    return f"{self.__class__.__qualname__}({shown})"


def _setattr(self: Any, name: str, value: Any) -> None:
    """Only ``__init__``'s first assignment of each field (or ``object.__setattr__``) gets through."""
    if name in self.__dict__ or name not in self.__dataclass_fields__:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
    object.__setattr__(self, name, value)


def _delattr(self: Any, name: str) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, dataclasses.Field))
def frozen(cls: C) -> C:
    """``@dataclass(frozen=True)`` with the shared methods (see the module docstring); an ``__eq__``,
    ``__repr__`` or ``__hash__`` the class defines itself is kept, a ``__setattr__`` refused."""
    for name, method in (("__eq__", _eq), ("__repr__", _repr)):
        if name not in cls.__dict__:
            setattr(cls, name, method)
    if cls.__dict__.get("__hash__") is None:
        cls.__hash__ = _hash  # type: ignore[assignment]
    setters: tuple[tuple[str, Any], ...] = (("__setattr__", _setattr), ("__delattr__", _delattr))
    for name, setter in setters:
        if name in cls.__dict__:  # as dataclass(frozen=True) refuses
            raise TypeError(f"Cannot overwrite attribute {name} in class {cls.__name__}")
        setattr(cls, name, setter)
    return dataclasses.dataclass(eq=False, repr=False)(cls)  # type: ignore[return-value]
