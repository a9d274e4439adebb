"""A seeded mutation fuzzer over rank files: gradstat's own error or a result, nothing else.

Mutants are bytes flipped, cut, inserted or repeated, and hostile headers that stay well-formed
around the hostility: a number made huge (world size, an axis, a dimension, an offset), nesting
past Python's recursion limit, a key given twice, in the safetensors header or in gradstat's
metadata. Some snapshots are also truncated after they were validated, before they are read.

``python tests/test_fuzz.py 100000`` runs a longer campaign than the test suite's.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import signal
import struct
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from safetensors import safe_open

from gradstat.analysis.audit import audit_snapshot
from gradstat.analysis.compare import compare_snapshots
from gradstat.analysis.stats import snapshot_stats
from gradstat.core.placements import MeshPlacement
from gradstat.distributed.runner import Processes
from gradstat.errors import GradstatError, SnapshotError
from gradstat.snapshot import Snapshot, save_rank
from gradstat.snapshot.format import (
    ATTRIBUTE_KINDS,
    ParamRecord,
    _checked_param,
    _param_to_json,
    _plain_record,
)
from gradstat.snapshot.reader import Repeats, open_rank_file

MUTANTS = 2000
SEED = 20261129
SAMPLE_DATA = Path(__file__).resolve().parents[1] / "sample_data"


def _good_snapshot(directory: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    for rank in range(2):
        weight = torch.randn(6, 5, generator=gen)
        weight[1] = 0.0
        params = []
        for name, grad, attrs in (
            ("w", weight, {"tensor_model_parallel": True, "partition_dim": 0}),
            ("b", torch.randn(7, generator=gen).bfloat16(), {}),
        ):
            holder = type("Param", (), {})()
            holder.grad, holder.shape = grad, grad.shape
            for key, value in attrs.items():
                setattr(holder, key, value)
            params.append((name, holder))
        save_rank(directory, params, rank=rank, world_size=2, coords={"tp": [rank, 2]}, step=1)


# Numbers that once sized an allocation, overflowed torch's 64-bit sizes, or both.
HUGE_NUMBERS = (0, 10**7, 10**9, 2**62, 2**63, 2**64 + 1, 10**30)


def _split(raw: bytes) -> tuple[str, bytes]:
    (length,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + length].decode(), raw[8 + length :]


def _join(text: str, data: bytes) -> bytes:
    header = text.encode()
    header += b" " * (-(8 + len(header)) % 8)
    return struct.pack("<Q", len(header)) + header + data


def _twice(document: dict[str, Any], rng: random.Random) -> str:
    """``document`` as JSON with one of its keys written twice (json.dumps cannot)."""
    key = rng.choice(sorted(document))
    return "{" + json.dumps(key) + ":" + json.dumps(document[key]) + "," + json.dumps(document)[1:]


def _deep(text: str, rng: random.Random) -> str:
    depth = rng.choice((1000, 5000, 100_000))
    return "{" + '"deep":' + "[" * depth + "]" * depth + "," + text.lstrip()[1:]


def _hostile_header(raw: bytes, rng: random.Random) -> bytes:
    """A well-formed rank file with one hostile thing in its header or its metadata."""
    text, data = _split(raw)
    kind = rng.randrange(3)
    if kind == 0:  # a number made huge: world size, coordinates, shapes, offsets alike
        numbers = list(re.finditer(r"\d+", text))
        found = rng.choice(numbers)
        value = str(rng.choice(HUGE_NUMBERS))
        return _join(text[: found.start()] + value + text[found.end() :], data)
    header = json.loads(text)
    in_metadata = rng.random() < 0.5
    if kind == 1:  # nested past the recursion limit
        if in_metadata:
            header["__metadata__"]["gradstat"] = _deep(header["__metadata__"]["gradstat"], rng)
            return _join(json.dumps(header), data)
        return _join(_deep(text, rng), data)
    if in_metadata:  # a key twice
        meta = json.loads(header["__metadata__"]["gradstat"])
        header["__metadata__"]["gradstat"] = _twice(meta, rng)
        return _join(json.dumps(header), data)
    return _join(_twice(header, rng), data)


def _mutate(raw: bytes, rng: random.Random) -> bytes:
    data = bytearray(raw)
    kind = rng.randrange(7)
    if kind == 0:  # flip bytes, header and data alike
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # overwrite a byte inside the header (where structure lives)
        (length,) = (int.from_bytes(data[:8], "little"),)
        end = min(len(data), 8 + length) if length < len(data) else len(data)
        data[rng.randrange(0, max(1, end))] = rng.randrange(256)
    elif kind == 2:  # truncate
        del data[rng.randrange(len(data)) :]
    elif kind == 3:  # insert junk
        position = rng.randrange(len(data) + 1)
        data[position:position] = rng.randbytes(rng.randint(1, 16))
    elif kind == 4:  # duplicate a slice
        start = rng.randrange(len(data))
        data[start:start] = data[start : start + rng.randint(1, 64)]
    else:
        return _hostile_header(raw, rng)
    return bytes(data)


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise TimeoutError("a mutant made gradstat hang")


def campaign(workdir: Path, mutants: int, seed: int = SEED) -> dict[str, int]:
    """Run ``mutants`` mutants; returns how many ended in an error and in a result.

    One valid snapshot in eight also has a rank file truncated between validation and reading:
    that must end in gradstat's error, never a result or a crash.
    """
    good = workdir / "good"
    _good_snapshot(good)
    originals = {path.name: path.read_bytes() for path in good.iterdir()}
    rng = random.Random(seed)
    outcome = {"error": 0, "result": 0}
    trial = workdir / "trial"
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        for _ in range(mutants):
            shutil.rmtree(trial, ignore_errors=True)
            shutil.copytree(good, trial)
            victim = rng.choice(sorted(originals))
            (trial / victim).write_bytes(_mutate(originals[victim], rng))
            cut = rng.random() < 1 / 8
            signal.alarm(10)
            try:
                snapshot = Snapshot.open(trial)
                if cut:
                    shortened = trial / rng.choice(sorted(originals))
                    kept = rng.randrange(shortened.stat().st_size)
                    shortened.write_bytes(shortened.read_bytes()[:kept])
                stats = snapshot_stats(snapshot, (2.0, math.inf))
                assert not cut, "a snapshot truncated after validation gave a result"
                assert stats.zeros >= 0 and stats.numel >= 0
                # What survives validation must survive the diagnostics too.
                audit_snapshot(snapshot, Processes(0, 1))
                compare_snapshots(Snapshot.open(good), snapshot, Processes(0, 1))
                outcome["result"] += 1
            except GradstatError:
                outcome["error"] += 1
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, previous)
    return outcome


def test_mutants_end_in_an_error_or_a_result(tmp_path: Path) -> None:
    outcome = campaign(tmp_path, MUTANTS)
    assert sum(outcome.values()) == MUTANTS
    assert outcome["error"] > MUTANTS // 2  # most mutants break something and are caught


def _read(folder: Path, name: str, known: Repeats | None) -> Any:
    """What reading one rank file gives: its error's message, or what it holds."""
    try:
        rank_file = open_rank_file(folder, name, known=known)
    except GradstatError as error:
        return str(error)
    container = rank_file.container
    return rank_file.header, container.metadata, container.slots, container.data_start


def test_parts_repeated_from_files_read_before_read_as_the_whole_file(tmp_path: Path) -> None:
    """A rank file's tensor layout and parameter list, when files read before held the same
    text, are not checked again (``Repeats``): a mutant reads the same with and without them
    known, to the error message."""
    good = tmp_path / "good"
    _good_snapshot(good)
    originals = {path.name: path.read_bytes() for path in sorted(good.iterdir())}
    known = Repeats()
    for name in originals:
        open_rank_file(good, name, known=known)
    # Both ranks hold one list and one layout, each kept by its text and by its template (a
    # file whose names differ would read it); their metadata differ (rank, coordinates).
    assert len(known.layouts) == 2 and len(known.params.by_text) == 1
    assert len(known.params.by_template) == 1
    rng = random.Random(SEED)
    trial = tmp_path / "trial"
    trial.mkdir()
    repeated = 0
    for _ in range(MUTANTS):
        victim = rng.choice(sorted(originals))
        (trial / victim).write_bytes(_mutate(originals[victim], rng))
        seen = Repeats(dict(known.layouts), known.params.copy())
        result = _read(trial, victim, seen)
        assert result == _read(trial, victim, None)
        # Read, with both parts known: the mutant changed the file's own parts (or nothing).
        repeated += seen == known and not isinstance(result, str)
    assert repeated > MUTANTS // 100


def _edges(text: str, data: bytes) -> dict[str, tuple[str, bytes]]:
    """Rank files that a split at the known parts could read otherwise than a whole parse does:
    each is the header's text and the data."""
    header = json.loads(text)
    meta = json.loads(header["__metadata__"]["gradstat"])
    listed = json.dumps(meta["params"])
    head = json.dumps({key: value for key, value in meta.items() if key != "params"})[:-1]
    tensors = json.dumps({key: value for key, value in header.items() if key != "__metadata__"})
    meta_object = header["__metadata__"]
    extra = json.dumps({"dtype": "F32", "shape": [1], "data_offsets": [len(data), len(data) + 4]})

    def with_meta(meta_text: str) -> tuple[str, bytes]:
        return json.dumps({**header, "__metadata__": {"gradstat": meta_text}}), data

    last = text.rstrip()[:-1]
    return {
        "metadata again, as a tensor": (f'{last},"__metadata__":{extra}}}', data + bytes(4)),
        "a form feed after the header": (text.rstrip() + "\f", data),
        "nothing after the metadata's comma": (text[: text.index(',"')] + ",}", b""),
        "members after the list": with_meta(f'{head},"params":{listed},"triggers":["spike"]}}'),
        "the list twice": with_meta(f'{head},"params":[],"params":{listed}}}'),
        "the key in the list": with_meta(f'{head},"params":{listed[:-2]},"params":[]}}]}}'),
        "junk after the list": with_meta(f'{head},"params":{listed}]}}'),
        "metadata last": (f'{tensors[:-1]},"__metadata__":{json.dumps(meta_object)}}}', data),
    }


def test_headers_built_to_split_wrongly_read_as_a_whole_parse_reads(tmp_path: Path) -> None:
    good = tmp_path / "good"
    _good_snapshot(good)
    known = Repeats()
    names = sorted(path.name for path in good.iterdir())
    for name in names:
        open_rank_file(good, name, known=known)
    trial = tmp_path / "trial"
    trial.mkdir()
    for edge, (header, data) in _edges(*_split((good / names[1]).read_bytes())).items():
        (trial / names[1]).write_bytes(_join(header, data))
        seen = Repeats(dict(known.layouts), known.params.copy())
        assert _read(trial, names[1], seen) == _read(trial, names[1], None), edge


# Values a record's fields take in a mutant: sound ones of other kinds, and the edges.
_FIELD_VALUES: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    1.5,
    2**63,
    "",
    "x",
    "float32",
    "bfloat16",
    "F32",
    [],
    [0],
    [-1],
    [2, 3],
    [True],
    [1.0],
    [2**62, 4],
    [2**63],
    {},
    {"a": 1},
    [0, 2**64],
    ["S(0)"],
    ["R", "S(1)"],
    ["S(-1)"],
    [["pp", 0, 2]],
    [["pp", 2, 2]],
)

# The fields of a DTensor record, mutated like the record's own.
_DTENSOR_KEYS = (
    "mesh_shape",
    "coordinate",
    "placements",
    "global_shape",
    "mesh_dim_names",
    "global_offset",
    "copies",
)


def _dtensor_entries() -> list[dict[str, Any]]:
    """DTensor gradients' records as a dump writes them: an FSDP2 shard at its offset, an
    HSDP x TP shard with a copy outside its mesh, and an older record without the optional
    fields."""
    placements = (
        ((2, 3), MeshPlacement((4,), (1,), ("S(0)",), (8, 3), ("dp_shard",), (2, 0))),
        (
            (4, 3),
            MeshPlacement(
                (2, 2),
                (1, 0),
                ("R", "S(1)"),
                (4, 6),
                ("dp_replicate", "tp"),
                (0, 0),
                (("pp", 0, 2),),
            ),
        ),
        ((4, 6), MeshPlacement((2,), (0,), ("R",), (4, 6))),
    )
    return [
        json.loads(
            json.dumps(
                _param_to_json(
                    ParamRecord("w", True, shape, "float32", full.global_shape, {}, full)
                )
            )
        )
        for shape, full in placements
    ]


def _mutated_record(entry: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    mutant = json.loads(json.dumps(entry))
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.5:
            where = mutant
        elif roll >= 0.8 and type(mutant.get("dtensor")) is dict:
            where = mutant["dtensor"]
        else:
            where = mutant.setdefault("attrs", {})
        if type(where) is not dict:
            continue
        keys = [*sorted(where), "dtensor", "extra", *ATTRIBUTE_KINDS, *_DTENSOR_KEYS]
        key = rng.choice(keys)
        if rng.random() < 0.2:
            where.pop(key, None)
        else:
            where[key] = rng.choice(_FIELD_VALUES)
    return mutant


def test_the_quick_record_check_accepts_only_what_the_full_check_does() -> None:
    """A parameter record accepted in a few steps (``_plain_record``, which declines anything
    unusual) is the record the field-by-field check makes of it, and that check accepts it."""
    entries = []
    for path in sorted(SAMPLE_DATA.glob("*/*.safetensors")):
        with safe_open(str(path), framework="pt") as file:
            entries += json.loads(file.metadata()["gradstat"])["params"]
    assert entries
    entries += _dtensor_entries() * 40  # a quarter of the picks: the samples hold none
    rng = random.Random(SEED)
    quick = dtensors = 0
    for index in range(20_000):
        entry = (
            rng.choice(entries) if index % 10 == 0 else _mutated_record(rng.choice(entries), rng)
        )
        record = _plain_record(entry)
        try:
            checked = _checked_param(Path("rank.safetensors"), 0, entry)
        except SnapshotError:
            checked = None
        if record is not None:
            quick += 1
            assert record == checked, entry
        if checked is not None and index % 10 == 0:
            # An unmutated plain record (a fragment's, a DTensor's too) is taken the quick way.
            assert record is not None or "gtp_group" in entry["attrs"]
            dtensors += entry["dtensor"] is not None
    assert quick > 2_000
    assert dtensors > 20


@pytest.mark.parametrize("offset", [-1, 0, 1, 20, 21, 2**63])
@pytest.mark.parametrize("full", [[4, 6], [24], [0, 6], [2**62, 4], [4, True], []])
@pytest.mark.parametrize("shape", [[3], [4], [0], [2, 2]])
def test_fragments_at_their_bounds_are_read_alike(
    offset: int, full: list[Any], shape: list[int]
) -> None:
    """A distributed-optimizer fragment's place, at the edges of its parameter: the quick check
    accepts what the full check accepts, and makes the same record of it."""
    entry = {
        "name": "w",
        "grad": True,
        "shape": shape,
        "dtype": "float32",
        "param_shape": [24],
        "attrs": {"fragment_offset": offset, "fragment_shape": full},
        "dtensor": None,
    }
    try:
        checked = _checked_param(Path("rank.safetensors"), 0, entry)
    except SnapshotError:
        checked = None
    assert _plain_record(entry) == checked


if __name__ == "__main__":
    import tempfile

    count = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    with tempfile.TemporaryDirectory() as temporary:
        print(campaign(Path(temporary), count))
