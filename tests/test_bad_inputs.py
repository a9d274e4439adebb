"""A corpus of bad inputs, each made from a good snapshot by the test itself.

Every case ends in one line on stderr naming the file, rank or tensor and what is wrong, exit
status 2, no traceback, and an input left exactly as it was.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gradstat.cli import app

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data" / "gtp2-pp2-dp2-ep2"
RANK1 = "rank-00001.safetensors"


def _split(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _join(path: Path, header: dict[str, Any], data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _edit_header(name: str, change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def make(snapshot: Path) -> None:
        header, data = _split(snapshot / name)
        change(header)
        _join(snapshot / name, header, data)

    return make


def _edit_meta(name: str, change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def change_header(header: dict[str, Any]) -> None:
        meta = json.loads(header["__metadata__"]["gradstat"])
        change(meta)
        header["__metadata__"]["gradstat"] = json.dumps(meta)

    return _edit_header(name, change_header)


def _gtp_attrs(meta: dict[str, Any]) -> dict[str, Any]:
    return next(p["attrs"] for p in meta["params"] if p["attrs"].get("is_gtp_weight_remat"))


def _grad_attrs(meta: dict[str, Any]) -> dict[str, Any]:
    return next(p["attrs"] for p in meta["params"] if p["grad"])


def _first_tensor(header: dict[str, Any]) -> dict[str, Any]:
    return next(entry for key, entry in header.items() if key != "__metadata__")


def _bytes(name: str, content: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def make(snapshot: Path) -> None:
        path = snapshot / name
        path.write_bytes(content(path.read_bytes()))

    return make


def _set(meta_key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda meta: meta.__setitem__(meta_key, value)


def _overlap(header: dict[str, Any]) -> None:
    entries = sorted(
        (entry for key, entry in header.items() if key != "__metadata__"),
        key=lambda entry: entry["data_offsets"][0],
    )
    start, end = entries[1]["data_offsets"]
    shift = start - entries[0]["data_offsets"][0] - 4  # now begins 4 bytes into the first
    entries[1]["data_offsets"] = [start - shift, end - shift]


def _duplicate_name(snapshot: Path) -> None:
    path = snapshot / RANK1
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + length].decode().rstrip()
    header = json.loads(text)
    name, entry = next((k, v) for k, v in header.items() if k != "__metadata__")
    # JSON with the same key twice (json.dumps cannot write it): prepend a second copy.
    text = "{" + json.dumps(name) + ":" + json.dumps(entry) + "," + text[1:]
    blob = text.encode() + b" " * (-(8 + len(text.encode())) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + length :])


def _pickle_file(snapshot: Path) -> None:
    (snapshot / RANK1).write_bytes(pickle.dumps({"grad": [1.0, 2.0]}))


def _fifo(snapshot: Path) -> None:
    (snapshot / RANK1).unlink()
    os.mkfifo(snapshot / RANK1)


def _directory(snapshot: Path) -> None:
    (snapshot / RANK1).unlink()
    (snapshot / RANK1).mkdir()


def _symlink_out(snapshot: Path) -> None:
    outside = snapshot.parent / "elsewhere.safetensors"
    shutil.copy(snapshot / RANK1, outside)
    (snapshot / RANK1).unlink()
    (snapshot / RANK1).symlink_to(outside)


def _other_snapshot_file(key: str, value: Any) -> Callable[[Path], None]:
    return _edit_meta(RANK1, _set(key, value))


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "empty directory": (lambda s: [p.unlink() for p in s.iterdir()], "no rank files"),
    "rank file missing": (lambda s: (s / RANK1).unlink(), "1 of 8 rank files missing (rank 1)"),
    "rank twice": (
        lambda s: shutil.copy(s / RANK1, s / "copy.safetensors"),
        "rank 1 is also in",
    ),
    "rank beyond world size": (_other_snapshot_file("rank", 8), "rank 8 is outside world size 8"),
    "other world size": (
        _edit_meta(RANK1, lambda m: m.update(world_size=16, rank=1)),
        "world size 16 differs from 8",
    ),
    "other step": (_other_snapshot_file("step", 99), "step 99 differs from 100"),
    "other format version": (_other_snapshot_file("version", 2), "format version 2 is not"),
    "not gradstat": (_other_snapshot_file("format", "x"), "format is 'x', expected"),
    "empty file": (_bytes(RANK1, lambda raw: b""), "0 bytes is too short"),
    "shorter than 8 bytes": (_bytes(RANK1, lambda raw: raw[:5]), "5 bytes is too short"),
    "truncated": (_bytes(RANK1, lambda raw: raw[:-100]), "file is truncated"),
    "trailing garbage": (_bytes(RANK1, lambda raw: raw + b"junk"), "has trailing bytes"),
    "random bytes": (
        _bytes(RANK1, lambda raw: random.Random(1).randbytes(len(raw))),
        "exceeds the file's",
    ),
    "header length 2^62": (
        _bytes(RANK1, lambda raw: struct.pack("<Q", 2**62) + raw[8:]),
        "header length 4611686018427387904 exceeds",
    ),
    "header not utf-8": (
        _bytes(RANK1, lambda raw: raw[:8] + b"\xff\xfe" + raw[10:]),
        "header is not UTF-8",
    ),
    "header a json list": (
        _bytes(
            RANK1,
            lambda raw: (
                struct.pack("<Q", 8) + b"[1,2,3] " + raw[8 + struct.unpack("<Q", raw[:8])[0] :]
            ),
        ),
        "header is not a JSON object",
    ),
    "duplicate tensor name": (_duplicate_name, "twice"),
    "overlapping byte ranges": (_edit_header(RANK1, _overlap), "byte range overlaps"),
    "bytes disagree with shape": (
        _edit_header(RANK1, lambda h: _first_tensor(h)["shape"].append(2)),
        "which needs",
    ),
    "pad_length beyond the shard": (
        _edit_meta(RANK1, lambda m: _gtp_attrs(m).update(pad_length=10_000)),
        "pad_length 10000 is larger than the padded tensor",
    ),
    "gtp group size against coordinates": (
        _edit_meta(RANK1, lambda m: _gtp_attrs(m).update(gtp_group=[1, 4])),
        "does not match the rank's gtp coordinate",
    ),
    "coordinate outside its axis": (
        _edit_meta(RANK1, lambda m: m["coords"].update(pp=[2, 2])),
        "axis 'pp' is [2, 2]",
    ),
    "integer dtype": (
        _edit_header(RANK1, lambda h: _first_tensor(h).update(dtype="I32")),
        "dtype 'I32' is not supported; supported: float32, bfloat16, float16",
    ),
    "bool dtype": (
        _edit_header(RANK1, lambda h: _first_tensor(h).update(dtype="BOOL")),
        "dtype 'BOOL' is not supported",
    ),
    "fp8 dtype": (
        _edit_header(RANK1, lambda h: _first_tensor(h).update(dtype="F8_E4M3")),
        "dtype 'F8_E4M3' is not supported",
    ),
    "fifo": (_fifo, "not a regular file"),
    "directory instead of a file": (_directory, "a directory, expected a rank file"),
    "symlink out of the snapshot": (_symlink_out, "symlink leads out of the snapshot"),
    "pickle renamed": (_pickle_file, "exceeds the file's"),
    "fragment offset without its shape": (
        _edit_meta(RANK1, lambda m: _grad_attrs(m).update(fragment_offset=0)),
        "fragment_offset and fragment_shape come together",
    ),
    "fragment beyond its parameter": (
        _edit_meta(RANK1, lambda m: _grad_attrs(m).update(fragment_offset=3, fragment_shape=[2])),
        "does not fit in a parameter of shape [2]",
    ),
    "record without tensor": (
        _edit_meta(RANK1, lambda m: m["params"].append({**m["params"][0], "name": "ghost"})),
        "parameter 'ghost': its gradient tensor is missing",
    ),
}


def _state(directory: Path) -> dict[str, Any]:
    """What is in a directory, without opening FIFOs: names, kinds and regular files' bytes."""
    state: dict[str, Any] = {}
    for path in sorted(directory.iterdir()):
        if path.is_symlink():
            state[path.name] = ("link", os.readlink(path))
        elif path.is_file():
            state[path.name] = path.read_bytes()
        else:
            state[path.name] = "other"
    return state


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", ["norm", "zeros", "audit", "compare"])
def test_bad_snapshot(case: str, command: str, tmp_path: Path) -> None:
    snapshot = tmp_path / "snapshot"
    shutil.copytree(SAMPLE, snapshot)
    make, message = CASES[case]
    make(snapshot)
    before = _state(snapshot)
    # compare: the good sample first, so that the bad one is found second.
    inputs = [str(SAMPLE), str(snapshot)] if command == "compare" else [str(snapshot)]
    result = CliRunner().invoke(app, [command, *inputs])
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gradstat: error: ")
    assert message in lines[0], lines[0]
    assert str(snapshot) in lines[0]
    assert _state(snapshot) == before


def test_missing_directory(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["norm", str(tmp_path / "absent")])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"gradstat: error: {tmp_path / 'absent'}: no such directory"


@pytest.mark.parametrize(
    "args",
    [
        ["norm", str(SAMPLE), "--bogus"],
        ["frobnicate", str(SAMPLE)],
        ["norm"],
        ["clip", str(SAMPLE), "--out", "x"],
    ],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert result.stdout == ""
