"""What the rank files of a snapshot repeat of each other's parameter lists, checked once.

Every data-parallel replica has its own rank file, and tensor-parallel shards and pipeline
stages of the same layers often list the same parameters: such a list's text is parsed and
checked once. Other files list parameters alike but for values of their own: the pipeline
stages of a job that names layers by their global index (torchtitan's ``layers.17.``) hold the
same records under other names; the files of an FSDP2 job or of a distributed optimizer list
the same parameters, each with numbers of its own (a DTensor shard's ``coordinate`` and
``global_offset``, a fragment's ``fragment_offset``). Such lists are read once per *template*:
the text with those names and numbers taken out. A file whose template is known has its own
values parsed and every check that involves them made (a name listed twice, a shard outside
its tensor); the rest of its list is the template's.
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
# A JSON string that is its own value: no escape, no control character.
_PLAIN_STRING = r'"[^"\\\x00-\x1f]*"'
# The key of an own value, then the value in the compact form gradstat writes: a list of
# integers for a shard's coordinate and offset, an integer for a fragment's offset, a string
# for a name. A template is made only where each match is an own key in its place (see
# _template_of).
_OWN_VALUES = re.compile(
    r'("(?:coordinate|global_offset)":(?=\[)|"fragment_offset":(?=[0-9])|"name":(?="))'
    r"(\[(?:" + _INT + r"(?:," + _INT + r")*)?\]|" + _INT + r"(?=[,}])|" + _PLAIN_STRING + ")"
)
# Where each own value sits in a parameter's record: the keys from the record to its object.
_PLACES = {
    "coordinate": ("dtensor",),
    "global_offset": ("dtensor",),
    "fragment_offset": ("attrs",),
    "name": (),
}


@dataclass(frozen=True)
class _Slot:
    """Where a record's own values are among a list's: the index of each, None for none."""

    record: int
    name: int | None = None
    coordinate: int | None = None
    global_offset: int | None = None
    fragment_offset: int | None = None


@dataclass(frozen=True)
class _Template:
    """A parameter list read once, and where a list of its template puts its own numbers."""

    records: tuple[ParamRecord, ...]
    slots: tuple[_Slot, ...]
    named: bool  # its names are own values (each list's checked for one listed twice)

    def fill(self, values: list[str]) -> tuple[ParamRecord, ...] | None:
        """The records of a list of this template whose own values' text is ``values``, in
        the list's order, each checked as parsing the record checks it; None when one fails or
        a name is listed twice (the caller parses the list whole, and words what is wrong).

        Raises:
            ValueError: a number of more digits than Python converts.
        """
        records = list(self.records)
        for slot in self.slots:
            record = records[slot.record]
            name, attrs, placement = record.name, record.attrs, record.dtensor
            if slot.name is not None:
                name = values[slot.name][1:-1]
            if slot.fragment_offset is not None:
                attrs = {**attrs, "fragment_offset": int(values[slot.fragment_offset])}
                if not fits_fragment(attrs, record.shape):
                    return None
            if placement is not None:
                placement = _placed(placement, record.shape, slot, values)
                if placement is None:
                    return None
            records[slot.record] = record.with_own(name, attrs, placement)
        if self.named and len({record.name for record in records}) != len(records):
            return None
        return tuple(records)


def _placed(
    placement: MeshPlacement, shape: tuple[int, ...], slot: _Slot, values: list[str]
) -> MeshPlacement | None:
    """A DTensor shard's placement with its own coordinate and offset; None where they do not
    fit its mesh and its global shape."""
    coordinate, offset = placement.coordinate, placement.global_offset
    if slot.coordinate is not None:
        coordinate = _sizes(values[slot.coordinate])
    if slot.global_offset is not None:
        offset = _sizes(values[slot.global_offset]) or None  # [] as none, as parsing reads it
    placed = placement.at(coordinate, offset)
    return placed if on_its_mesh(placed) and shard_inside(placed, shape) else None


def _sizes(text: str) -> tuple[int, ...]:
    """The integers of a list's text as ``_OWN_VALUES`` matches it."""
    return tuple(map(int, text[1:-1].split(","))) if len(text) > 2 else ()


def _template_of(
    entries: list[Any], records: tuple[ParamRecord, ...], parts: list[str]
) -> _Template | None:
    """The template of a list parsed whole (``entries``, checked into ``records``) and split
    at its own values (``parts``: text, key, value, text, key, value, ..., text); None unless
    each match is an own key in its place, one to one with those ``entries`` hold.

    A match's quote after "{" or "," opens a string in a valid JSON text (closing one, it would
    be followed by a letter), so the match is a key; each key found in ``entries`` whose value a
    match would read must then be a match, in the same order, with the same value.
    """
    texts = parts[2::3]
    if not all(text.endswith(("{", ",")) for text in parts[0:-1:3]):
        return None
    found = [
        (where, key, value)
        for where, key, value in _own_keys(entries, ())
        if _is_own_value(key, value)
    ]
    if len(found) != len(texts):
        return None
    slots: dict[int, dict[str, int]] = {}
    for at, ((where, key, value), text) in enumerate(zip(found, texts, strict=True)):
        as_parsed = tuple(value) if type(value) is list else value
        if where[1:] != _PLACES[key] or _value_of(text) != as_parsed:
            return None
        slots.setdefault(where[0], {})[key] = at
    own = tuple(_Slot(index, **keys) for index, keys in slots.items())
    return _Template(records, own, any(slot.name is not None for slot in own))


def _value_of(text: str) -> Any:
    """The value of an own value's text as ``_OWN_VALUES`` matches it."""
    if text[0] == '"':
        return text[1:-1]  # a plain string: its text is its value
    return _sizes(text) if text[0] == "[" else int(text)


def _own_keys(value: Any, where: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], str, Any]]:
    """Every own-value key anywhere in ``value``, in the text's order, with where its object
    lies (list indices and keys) and its value."""
    if type(value) is dict:
        for key, inner in value.items():
            if key in _PLACES:
                yield where, key, inner
            yield from _own_keys(inner, (*where, key))
    elif type(value) is list:
        for index, inner in enumerate(value):
            yield from _own_keys(inner, (*where, index))


def _is_own_value(key: str, value: Any) -> bool:
    """Whether ``value`` is of the kind a match of ``_OWN_VALUES`` reads for ``key``."""
    if key == "name":
        return type(value) is str
    if key == "fragment_offset":
        return type(value) is int and value >= 0
    return type(value) is list and are_sizes(value)


@dataclass
class KnownParams:
    """The parameter lists of a snapshot's rank files already read: by their template (see the
    module's docstring), and by their text those without own numbers (those with, a DTensor's
    or a fragment's, differ in every file) or without a template."""

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
        parts = _OWN_VALUES.split(listed)  # text, key, value, text, key, value, ..., text
        values = parts[2::3]
        template_key = tuple(parts[0::3] + parts[1::3])
        template = self.by_template.get(template_key)
        if template is not None:
            records = template.fill(values)
            if records is not None:
                self._by_text(listed, values, records)
                return records
        entries = load_json(path, listed, "gradstat metadata")
        if type(entries) is not list:
            return None
        records = parse_params(path, entries)
        made = None if template is not None or not values else _template_of(entries, records, parts)
        if made is not None:
            self.by_template[template_key] = made
            self._by_text(listed, values, records)
        elif template is None:  # values that cannot be placed: by text alone
            self.by_text[listed] = records
        return records

    def _by_text(self, listed: str, values: list[str], records: tuple[ParamRecord, ...]) -> None:
        """Keep a list of a template by its text too, unless it has own numbers: the files that
        repeat a list of names (tensor-parallel shards, replicas) then read it at once."""
        if all(value[0] == '"' for value in values):
            self.by_text[listed] = records
