"""``@frozen`` behaves as ``@dataclass(frozen=True)``, with methods shared by every class."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from clusterrun.core.events import NodeStarted
from clusterrun.core.frozen import frozen
from clusterrun.run.plan import LaunchPlan


@frozen
class Shared:
    name: str
    count: int = 0
    note: str = field(default="", compare=False)
    secret: str = field(default="", repr=False)
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Generated:
    name: str
    count: int = 0
    note: str = field(default="", compare=False)
    secret: str = field(default="", repr=False)
    tags: tuple[str, ...] = ()


@frozen
class Derived(Shared):
    extra: float = 0.5


def as_generated(value: Shared) -> Generated:
    return Generated(value.name, value.count, value.note, value.secret, value.tags)


@pytest.mark.parametrize(("a", "b"), [
    (Shared("a", 1), Shared("a", 1)),
    (Shared("a", 1), Shared("a", 2)),
    (Shared("a", 1, note="x"), Shared("a", 1, note="y")),  # not compared
    (Shared("a", secret="s"), Shared("a", secret="t")),
    (Shared("a", tags=("x",)), Shared("a", tags=("x", "y"))),
    (Shared("a", 1, note="x", secret="s", tags=("t",)), Shared("a", 1, note="x", secret="s", tags=("t",))),
])
def test_equality_hash_and_repr_are_dataclasss(a: Shared, b: Shared) -> None:
    ga, gb = as_generated(a), as_generated(b)
    assert (a == b) == (ga == gb) and (a != b) == (ga != gb)
    assert (hash(a) == hash(b)) == (hash(ga) == hash(gb))
    assert repr(a) == repr(ga).replace("Generated(", "Shared(") and "secret" not in repr(a)


def test_classes_differ_subclasses_add_fields_and_the_rest_is_dataclasss() -> None:
    assert Shared("a") != Derived("a") and Derived("a", extra=1.0) != Derived("a")
    assert repr(Derived("a", 2, extra=1.0)) == "Derived(name='a', count=2, note='', tags=(), extra=1.0)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        Shared("a").count = 3  # type: ignore[misc]
    assert dataclasses.replace(Shared("a"), count=4) == Shared("a", 4)
    assert [f.name for f in dataclasses.fields(Derived)] == ["name", "count", "note", "secret", "tags", "extra"]
    assert len({Shared("a"), Shared("a", note="other"), Shared("b")}) == 2
    nan = float("nan")
    assert Derived("a", extra=nan) == Derived("a", extra=nan)  # the same object: equal, as in a tuple


def test_the_methods_are_shared_not_written_for_each_class() -> None:
    """What saves the start-up time: no class gets methods of its own (NodeStarted, LaunchPlan: the
    controller's classes use it)."""
    for cls in (Shared, Derived, NodeStarted, LaunchPlan):
        assert cls.__eq__ is Shared.__eq__ and cls.__repr__ is Shared.__repr__ and cls.__hash__ is Shared.__hash__


def test_fields_are_set_once_by_init_and_never_again() -> None:
    """The shared ``__setattr__``/``__delattr__`` refuse what dataclass(frozen=True)'s refuse, and let
    ``replace``, copies and ``object.__setattr__`` (a ``__post_init__``'s) through."""
    import copy
    import pickle

    value = Derived("a", 2, tags=("t",), extra=1.5)
    for name in ("name", "extra", "other"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, name, "changed")
        with pytest.raises(dataclasses.FrozenInstanceError):
            delattr(value, name)
    assert value == Derived("a", 2, tags=("t",), extra=1.5) and not hasattr(value, "other")
    assert copy.copy(value) == value and copy.deepcopy(value) == value
    assert pickle.loads(pickle.dumps(Shared("p", 3))) == Shared("p", 3)
    object.__setattr__(value, "count", 5)
    assert value.count == 5
    with pytest.raises(TypeError, match="Cannot overwrite attribute __setattr__"):
        @frozen
        class Own:
            x: int

            def __setattr__(self, name: str, value: object) -> None:
                pass


def test_setters_are_shared_too() -> None:
    for cls in (Shared, Derived, NodeStarted, LaunchPlan):
        assert cls.__setattr__ is Shared.__setattr__ and cls.__delattr__ is Shared.__delattr__
