"""``functools.cached_property`` without its lock.

Before Python 3.12 every first access of a ``cached_property`` takes a lock (held per class,
not per instance), about 2 us where the value itself costs a fraction of that. A snapshot of
8192 rank files of distinct parameter lists makes tens of thousands of records, each read once
(``benchmarks/bench_many_files.py --layout distinct``). gradstat's cached values are pure
functions of frozen data, so two threads computing one at once get equal values: no lock is
needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

_T = TypeVar("_T")


class cached(Generic[_T]):
    """A property computed on first access and kept in the instance's ``__dict__`` (where later
    lookups find it before this descriptor, which defines no ``__set__``)."""

    def __init__(self, function: Callable[[Any], _T]) -> None:
        self._function = function
        self._name = function.__name__
        self.__doc__ = function.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> cached[_T]: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> _T: ...

    def __get__(self, instance: object | None, owner: type | None = None) -> _T | cached[_T]:
        if instance is None:
            return self
        value = instance.__dict__[self._name] = self._function(instance)
        return value
