"""What the rank files of a snapshot repeat of each other's parameter lists, checked once.

Every data-parallel replica has its own rank file, and tensor-parallel shards and pipeline
stages of the same layers often list the same parameters: such a list's text is parsed and
checked once. The files of an FSDP2 job or of a distributed optimizer list the same parameters
too, but each with numbers of its own: a DTensor shard's ``coordinate`` and ``global_offset``,
a fragment's ``fragment_offset``. Their lists differ in those numbers alone, and are read once
per *template*: the text with those numbers taken out. A file whose template is known has its
numbers parsed and every check that involves them made; the rest of its list is the template's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradstat.core.placements import MeshPlacement
from gradstat.snapshot.format import (
    ParamRecord,
    are_sizes,
    fits_fragment,
    load_json,
    on_its_mesh,
    parse_params,
    shard_inside,
)

_INT = r"(?:0|[1-9][0-9]*)"  # as JSON writes an integer >= 0: no sign, no leading zero
# The key of an own number, then its value in the compact form gradstat writes: a list of
# integers for a shard's coordinate and offset, an integer for a fragment's offset. A template
# is made only where each match is an own key in its place (see _template_of).
_OWN_NUMBERS = re.compile(
    r'("(?:coordinate|global_offset)":(?=\[)|"fragment_offset":(?=[0-9]))'
    r"(\[(?:" + _INT + r"(?:," + _INT + r")*)?\]|" + _INT + r"(?=[,}]))"
)
# Where each own number sits in a parameter's record.
_PLACES = {"coordinate": "dtensor", "global_offset": "dtensor", "fragment_offset": "attrs"}


@dataclass(frozen=True)
class _Slot:
    """Where a record's own numbers are among a list's: the index of each, None for none."""

    record: int
    coordinate: int | None = None
    global_offset: int | None = None
    fragment_offset: int | None = None


@dataclass(frozen=True)
class _Template:
    """A parameter list read once, and where a list of its template puts its own numbers."""

    records: tuple[ParamRecord, ...]
    slots: tuple[_Slot, ...]

    def fill(self, numbers: list[str]) -> tuple[ParamRecord, ...] | None:
        """The records of a list of this template whose own numbers' text is ``numbers``, in
        the list's order, each checked as parsing the record checks it; None when one fails
        (the caller parses the list whole, and words what is wrong).

        Raises:
            ValueError: a number of more digits than Python converts.
        """
        records = list(self.records)
        for slot in self.slots:
            record = records[slot.record]
            attrs, placement = record.attrs, record.dtensor
            if slot.fragment_offset is not None:
                attrs = {**attrs, "fragment_offset": int(numbers[slot.fragment_offset])}
                if not fits_fragment(attrs, record.shape):
                    return None
            if placement is not None:
                placement = _placed(placement, record.shape, slot, numbers)
                if placement is None:
                    return None
            records[slot.record] = ParamRecord(
                record.name,
                record.has_grad,
                record.shape,
                record.dtype,
                record.param_shape,
                attrs,
                placement,
            )
        return tuple(records)


def _placed(
    placement: MeshPlacement, shape: tuple[int, ...], slot: _Slot, numbers: list[str]
) -> MeshPlacement | None:
    """A DTensor shard's placement with its own coordinate and offset; None where they do not
    fit its mesh and its global shape."""
    coordinate, offset = placement.coordinate, placement.global_offset
    if slot.coordinate is not None:
        coordinate = _sizes(numbers[slot.coordinate])
    if slot.global_offset is not None:
        offset = _sizes(numbers[slot.global_offset]) or None  # [] as none, as parsing reads it
    placed = MeshPlacement(
        placement.mesh_shape,
        coordinate,
        placement.placements,
        placement.global_shape,
        placement.mesh_dim_names,
        offset,
        placement.copies,
    )
    return placed if on_its_mesh(placed) and shard_inside(placed, shape) else None


def _sizes(text: str) -> tuple[int, ...]:
    """The integers of a list's text as ``_OWN_NUMBERS`` matches it."""
    return tuple(map(int, text[1:-1].split(","))) if len(text) > 2 else ()


def _template_of(
    entries: list[Any], records: tuple[ParamRecord, ...], parts: list[str]
) -> _Template | None:
    """The template of a list parsed whole (``entries``, checked into ``records``) and split
    at its own numbers (``parts``: text, key, number, text, key, number, ..., text); None
    unless each match is an own key in its place, one to one with those ``entries`` hold.

    A match's quote after "{" or "," opens a string in a valid JSON text (closing one, it would
    be followed by a letter), so the match is a key; each key found in ``entries`` whose value a
    match would read must then be a match, in the same order, with the same value.
    """
    numbers = parts[2::3]
    if not all(text.endswith(("{", ",")) for text in parts[0:-1:3]):
        return None
    found = [
        (where, key, value)
        for where, key, value in _own_keys(entries, ())
        if _is_own_number(key, value)
    ]
    if len(found) != len(numbers):
        return None
    slots: dict[int, dict[str, int]] = {}
    for at, ((where, key, value), number) in enumerate(zip(found, numbers, strict=True)):
        as_read = _sizes(number) if number[0] == "[" else int(number)
        as_parsed = tuple(value) if type(value) is list else value
        if where[1:] != (_PLACES[key],) or as_read != as_parsed:
            return None
        slots.setdefault(where[0], {})[key] = at
    return _Template(records, tuple(_Slot(index, **own) for index, own in slots.items()))


def _own_keys(value: Any, where: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], str, Any]]:
    """Every own-number key anywhere in ``value``, in the text's order, with where its object
    lies (list indices and keys) and its value."""
    if type(value) is dict:
        for key, inner in value.items():
            if key in _PLACES:
                yield where, key, inner
            yield from _own_keys(inner, (*where, key))
    elif type(value) is list:
        for index, inner in enumerate(value):
            yield from _own_keys(inner, (*where, index))


def _is_own_number(key: str, value: Any) -> bool:
    """Whether ``value`` is of the kind a match of ``_OWN_NUMBERS`` reads for ``key``."""
    if key == "fragment_offset":
        return type(value) is int and value >= 0
    return type(value) is list and are_sizes(value)


@dataclass
class KnownParams:
    """The parameter lists of a snapshot's rank files already read: by their text, and those
    with own numbers by their template (see the module's docstring)."""

    by_text: dict[str, tuple[ParamRecord, ...]] = field(default_factory=dict)
    by_template: dict[tuple[str, ...], _Template] = field(default_factory=dict)

    def copy(self) -> KnownParams:
        return KnownParams(dict(self.by_text), dict(self.by_template))

    def records(self, path: Path, listed: str) -> tuple[ParamRecord, ...] | None:
        """The checked records of the list whose text is ``listed``; None when it is not a list.

        Raises:
            SnapshotError, ValueError: the list is malformed (the caller parses the whole
                metadata and words the error).
        """
        records = self.by_text.get(listed)
        if records is not None:
            return records
        # A list without the keys (a scan of a fifth of the split's time) splits into itself.
        with_keys = '"coordinate":' in listed or '_offset":' in listed
        parts = _OWN_NUMBERS.split(listed) if with_keys else [listed]
        if len(parts) == 1:  # else text, key, number, text, key, number, ..., text
            entries = load_json(path, listed, "gradstat metadata")
            if type(entries) is not list:
                return None
            records = self.by_text[listed] = parse_params(path, entries)
            return records
        numbers = parts[2::3]
        template_key = tuple(parts[0::3] + parts[1::3])
        template = self.by_template.get(template_key)
        if template is not None:
            records = template.fill(numbers)
            if records is not None:
                return records
        entries = load_json(path, listed, "gradstat metadata")
        if type(entries) is not list:
            return None
        records = parse_params(path, entries)
        if template is None:
            made = _template_of(entries, records, parts)
            if made is not None:
                self.by_template[template_key] = made
            else:  # numbers that cannot be placed: by text, as a list without them
                self.by_text[listed] = records
        return records
