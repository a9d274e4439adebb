"""Parameter lists read once per template (``gradstat.snapshot.repeats``): the lists of an FSDP2
job's or a distributed optimizer's rank files differ in each rank's own numbers alone, those of
pipeline stages named by global layer index in their names alone, and a file whose template is
known reads as a whole parse of it reads, to the error message."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest

from gradstat.core.placements import MeshPlacement
from gradstat.errors import SnapshotError
from gradstat.snapshot.container import read_container
from gradstat.snapshot.format import ParamRecord, RankHeader, load_json, parse_header, parse_params
from gradstat.snapshot.repeats import _OWN_VALUES, KnownParams

SEED = 20261204
PATH = Path("rank-00003.safetensors")
_COORDS = {"dp": (3, 8)}


def _header(records: list[ParamRecord]) -> str:
    return RankHeader(3, 8, 100, dict(_COORDS), False, "grad", tuple(records)).to_json()


def _fsdp2(rank: int) -> list[ParamRecord]:
    """FSDP2 over 8 ranks: each parameter's rows split evenly, one record older (no offset)."""
    records = []
    for index, shape in enumerate(((64, 32), (32,), (128, 16), (16, 4))):
        rows = shape[0] // 8
        offset = (rank * rows, *(0 for _ in shape[1:])) if index != 3 else None
        placement = MeshPlacement((8,), (rank,), ("S(0)",), shape, ("dp_shard",), offset)
        local = (rows, *shape[1:])
        records.append(
            ParamRecord(f"layers.{index}.w", True, local, "float32", shape, {}, placement)
        )
    return records


def _hsdp_tp(rank: int) -> list[ParamRecord]:
    """HSDP x TP on a (2, 2) mesh with a pipeline copy, and a parameter without a gradient."""
    replica, column = divmod(rank % 4, 2)
    placement = MeshPlacement(
        (2, 2),
        (replica, column),
        ("R", "S(1)"),
        (4, 6),
        ("dp_replicate", "tp"),
        (0, 3 * column),
        (("pp", 0, 2),),
    )
    attrs = {"tensor_model_parallel": True, "partition_dim": 1}
    frozen = ParamRecord("frozen", False, (4, 3), None, (4, 6), {}, placement)
    return [ParamRecord("w", True, (4, 3), "bfloat16", (4, 6), attrs, placement), frozen]


def _distopt(rank: int) -> list[ParamRecord]:
    """A distributed optimizer's fragments, one of a GTP shard (checked field by field)."""
    records = []
    for index, (full, extra) in enumerate(
        (((24, 10), {}), ((40,), {"shared": True}), ((8, 8), {"gtp_group": [1, 2]}))
    ):
        size = math.prod(full) // 8
        attrs = {**extra, "fragment_offset": rank * size, "fragment_shape": list(full)}
        records.append(ParamRecord(f"p{index}", True, (size,), "float32", full, attrs))
    return records


def _stages(rank: int) -> list[ParamRecord]:
    """Pipeline stage ``rank`` of a model whose names carry the global layer index (one layer
    per stage), and a parameter without a gradient: the records differ in their names alone."""
    attrs = {"tensor_model_parallel": True, "partition_dim": 0}
    return [
        ParamRecord(f"layers.{rank}.attn.w", True, (64, 32), "float32", (64, 32), attrs),
        ParamRecord(f"layers.{rank}.norm", True, (32,), "bfloat16", (32,), {}),
        ParamRecord(f"layers.{rank}.frozen", False, (8,), None, (8,), {}),
    ]


LAYOUTS = {"fsdp2": _fsdp2, "hsdp_tp": _hsdp_tp, "distopt": _distopt, "stages": _stages}

# Texts an own value takes in a mutant: sound and out of bounds, of other lengths, forms the
# template's pattern does not read (a sign, a leading zero, a space, an escape, another kind),
# and names another record of a list holds.
_VALUE_TEXTS = (
    '"layers.1.w"',
    '"layers.3.norm"',
    '"layers.3.attn.w"',
    '"layers.3.frozen"',
    '"p1"',
    '"w"',
    '"frozen"',
    '""',
    '"a\\"b"',
    '"\\u0070\\u0031"',
    '"tab\there"',
    "[0]",
    "[1]",
    "[7]",
    "[8]",
    "[2**70]",
    "[]",
    "[0,0]",
    "[1,0]",
    "[0,3]",
    "[0,4]",
    "[8,0]",
    "[56,0]",
    "[57,0]",
    "[120,0]",
    "[1,3]",
    "[1,1,1]",
    "[01]",
    "[-1]",
    "[1, 0]",
    "[1.0]",
    "null",
    "[" + "9" * 5000 + "]",
    "0",
    "3",
    "30",
    "210",
    "211",
    "1000",
    "2**70",
    "-1",
    "1e1",
    "08",
    "[30]",
    "true",
)


def _mutant(texts: list[str], rng: random.Random) -> str:
    """One of ``texts`` (the ranks' lists) with one to three of its own values written
    otherwise: another rank's value there, or one of ``_VALUE_TEXTS``."""
    parts = _OWN_VALUES.split(rng.choice(texts))
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(2, len(parts), 3)
        if rng.random() < 0.4:
            parts[at] = _OWN_VALUES.split(rng.choice(texts))[at]
        else:
            parts[at] = rng.choice(_VALUE_TEXTS).replace("2**70", str(2**70))
    return "".join(parts)


def _outcome(text: str, known: KnownParams | None) -> RankHeader | str:
    try:
        return parse_header(PATH, text, known)
    except SnapshotError as error:
        return str(error)


def _list_of(text: str) -> str:
    return text[text.rindex('"params":') + len('"params":') : -1]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_list_of_a_known_template_reads_as_its_whole_parse(layout: str) -> None:
    """Every rank's list of a layout is read by the first rank's template; mutants of a list's
    own values read as their whole parse does, and the template takes what that parse takes."""
    make = LAYOUTS[layout]
    known = KnownParams()
    texts = [_header(make(rank)) for rank in range(8)]
    for text in texts:
        assert parse_header(PATH, text, known) == parse_header(PATH, text)
    assert len(known.by_template) == 1  # all eight read by one template
    # By text too where they differ in names alone (a file that repeats one reads it at once).
    assert len(known.by_text) == (8 if layout == "stages" else 0)
    (template,) = known.by_template.values()
    for record in template.records:  # cached, so that a list filled from them carries them
        _cached_values(record)
    rng = random.Random(SEED)
    filled = declined = 0
    for _ in range(4000):
        text = _mutant(texts, rng)
        assert _outcome(text, known.copy()) == _outcome(text, None), text
        parts = _OWN_VALUES.split(_list_of(text))
        if (*parts[0::3], *parts[1::3]) not in known.by_template:
            continue  # a number the pattern does not read: the list is another template's
        try:
            records = template.fill(parts[2::3])
        except ValueError:
            records = None
        try:
            whole = parse_params(PATH, load_json(PATH, _list_of(text), "list"))
        except (SnapshotError, ValueError):
            whole = None
        assert records == whole, text
        if records is not None and whole is not None:
            assert list(map(_cached_values, records)) == list(map(_cached_values, whole)), text
        filled += records is not None
        declined += records is None
    # A list of names alone declines only a name listed twice.
    assert filled > 100 and declined > (10 if layout == "stages" else 100), (filled, declined)


def _cached_values(record: ParamRecord) -> tuple[Any, ...]:
    """What a record caches, which a filled record may take over from its template's."""
    return record.plain_attrs, record.is_expert, record.extent


def _with(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new, 1)


def _out_of_place() -> dict[str, tuple[str, str]]:
    """Lists whose own numbers a template would misplace, each with a second list that differs
    from it in one key's number alone: an own key elsewhere than its place (a record's unknown
    key, which the parse ignores), and a key whose name ends in one beside the real key written
    with a space (a match of the pattern that is not the key it seems)."""
    fsdp2 = _header(_fsdp2(3))
    real = '"coordinate":[3]'
    elsewhere = _with(fsdp2, '"grad":true', '"grad":true,"coordinate":[3]')
    ending = _with(fsdp2, real, '"x\\"coordinate":[3],"coordinate": [3]')
    return {
        "an own key out of its place": (elsewhere, _with(elsewhere, real, '"coordinate":[5]')),
        "a key that ends in one": (ending, _with(ending, 'coordinate":[3]', 'coordinate":[5]')),
    }


@pytest.mark.parametrize("case", sorted(_out_of_place()))
def test_own_keys_out_of_their_place_make_no_template(case: str) -> None:
    """A list whose own numbers cannot be placed one to one is read whole every time: the
    second file reads its own numbers, not the first file's with another's put in."""
    first, second = _out_of_place()[case]
    assert _OWN_VALUES.split(first)[0::3] == _OWN_VALUES.split(second)[0::3]
    known = KnownParams()
    assert _outcome(first, known) == _outcome(first, None)
    assert isinstance(_outcome(second, None), RankHeader)
    assert _outcome(second, known) == _outcome(second, None)
    assert not known.by_template


@pytest.mark.parametrize(
    "old, new",
    [
        ('"layers.0.w"', '"a\\",\\"coordinate\\":[{rank}]"'),  # the key's text in a name
        ('"coordinate":[{rank}]', ' "coordinate":[{rank}]'),  # a space before a key
        ('"coordinate":[{rank}]', '"coordinate":[{rank}] '),  # and after its value
        ('"global_offset":[{row},0]', '"global_offset":null'),  # no offset
    ],
)
def test_lists_written_otherwise_read_as_their_whole_parse(old: str, new: str) -> None:
    """Lists that gradstat does not write so, with and without a template made before."""
    known = KnownParams()
    first = _header(_fsdp2(3))
    assert _outcome(first, known) == _outcome(first, None)
    for rank in range(8):
        place = {"rank": rank, "row": 8 * rank}
        text = _with(_header(_fsdp2(rank)), old.format(**place), new.format(**place))
        assert _outcome(text, known) == _outcome(text, None)


def test_each_rank_reads_the_records_it_was_written_from() -> None:
    """The records a template fills in for every rank of the layouts above are those its header
    was written from: each rank's own coordinate, offset and fragment offset."""
    for make in LAYOUTS.values():
        known = KnownParams()
        headers = [parse_header(PATH, _header(make(rank)), known) for rank in range(8)]
        for rank, header in enumerate(headers):
            assert header.params == tuple(make(rank))


# Tensor names in a safetensors header's entries, as a mutant writes them: another file's, one
# the header holds already, the metadata's key, and forms the template's pattern does not read.
_NAME_TEXTS = (
    '"layers.5.w"',
    '"layers.3.b"',
    '"__metadata__"',
    '""',
    '"a\\"b"',
    '"\\u0061"',
    '"tab\there"',
    '"a\\\\"',
)


def _safetensors(rank: int, names: list[str] | None = None) -> bytes:
    """Rank ``rank``'s file: a weight and a bias named by its layer, metadata of its own."""
    texts = names or [f'"layers.{rank}.w"', f'"layers.{rank}.b"']
    entries = [
        f'{texts[0]}:{{"dtype":"F32","shape":[4,2],"data_offsets":[0,32]}}',
        f'{texts[1]}:{{"dtype":"F32","shape":[2],"data_offsets":[32,40]}}',
    ]
    header = '{"__metadata__":{"rank":"' + str(rank) + '"},' + ",".join(entries) + "}"
    raw = header.encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + bytes(40)


def _container(path: Path, known: dict[Any, Any] | None) -> tuple[dict[str, Any], Any] | str:
    try:
        found = read_container(path, 1 << 20, known)
    except SnapshotError as error:
        return str(error)
    return found.metadata, found.slots


def test_tensor_names_of_a_known_template_read_as_their_whole_parse(tmp_path: Path) -> None:
    """Files whose tensors differ in their names alone (pipeline stages) share one layout
    template; a name another entry holds, the metadata's key, or a name the template's pattern
    does not read gives what the whole parse gives, slots or error."""
    known: dict[Any, Any] = {}
    for rank in range(4):
        path = tmp_path / f"rank-{rank}.safetensors"
        path.write_bytes(_safetensors(rank))
        assert _container(path, known) == _container(path, None)
        assert set(_container(path, None)[1]) == {f"layers.{rank}.w", f"layers.{rank}.b"}
    assert sum(type(key) is tuple for key in known) == 1  # one template for the four
    rng = random.Random(SEED)
    outcomes = set()
    for index in range(200):
        names = [f'"layers.{index}.w"', f'"layers.{index}.b"']
        names[rng.randrange(2)] = rng.choice(_NAME_TEXTS)
        path = tmp_path / f"mutant-{index}.safetensors"
        path.write_bytes(_safetensors(index, names))
        whole = _container(path, None)
        assert _container(path, dict(known)) == whole, names
        outcomes.add(type(whole))
    assert outcomes == {str, tuple}  # both sound files and errors met
