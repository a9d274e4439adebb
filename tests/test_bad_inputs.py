"""A corpus of bad inputs, each made from a good snapshot by the test itself.

Every case ends in one line on stderr naming the file, rank or tensor and what is wrong, exit
status 2, no traceback, and an input left exactly as it was. Hostile files are among them:
headers nested past Python's recursion limit, shapes past torch's 64-bit sizes, symlink loops,
a world size of 10^9 in a few kilobytes, 60,000 keys with one twice, and files truncated while
a run reads them. Megatron wgrads dumps have their own: a pickle that would run code (it must
not run), a list among the tensors, a truncated file, a missing TP file, a name no rule knows.
So do PyTorch distributed checkpoints: a ``.metadata`` pickle that would run code (it must not
run), a storage path out of the directory, a compressed entry, a truncated data file.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gradstat.cli import app
from tests._cli import SAMPLE_DATA, run_gradstat, run_python

SAMPLE = SAMPLE_DATA / "gtp2-pp2-dp2-ep2"
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


def _every_file(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def make(snapshot: Path) -> None:
        for path in sorted(snapshot.iterdir()):
            _edit_meta(path.name, change)(snapshot)

    return make


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _header_text(name: str, edit: Callable[[str], str]) -> Callable[[Path], None]:
    """Edit the header as text: JSON that json.dumps cannot write (a key twice, deep nesting)."""

    def make(snapshot: Path) -> None:
        raw = (snapshot / name).read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        text = edit(raw[8 : 8 + length].decode().rstrip()).encode()
        text += b" " * (-(8 + len(text)) % 8)
        (snapshot / name).write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])

    return make


def _meta_text(name: str, edit: Callable[[str], str]) -> Callable[[Path], None]:
    """Edit the gradstat metadata as text, inside a header json.dumps writes."""

    def change(header: dict[str, Any]) -> None:
        header["__metadata__"]["gradstat"] = edit(header["__metadata__"]["gradstat"])

    return _edit_header(name, change)


def _extra_keys(text: str) -> str:
    # 60,000 keys and the last one again: a quadratic duplicate check takes about a minute.
    keys = ",".join(f'"k{index}":0' for index in range(60_000))
    return text[:-1] + "," + keys + ',"k59999":0}'


def _extra_records(meta: dict[str, Any]) -> None:
    records = [
        {"name": f"p{index}", "grad": False, "shape": [], "param_shape": [], "attrs": {}}
        for index in range(60_000)
    ]
    meta["params"] += [*records, records[-1]]


def _empty_tensor(shape: list[int], **attrs: Any) -> Callable[[Path], None]:
    """A tensor of no bytes (a 0 in its shape) appended to rank 1's file and its records."""

    def change(header: dict[str, Any]) -> None:
        end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
        header["empty"] = {"dtype": "F32", "shape": shape, "data_offsets": [end, end]}
        meta = json.loads(header["__metadata__"]["gradstat"])
        record = {"name": "empty", "grad": True, "dtype": "float32", "dtensor": None}
        meta["params"].append({**record, "shape": shape, "param_shape": shape, "attrs": attrs})
        header["__metadata__"]["gradstat"] = json.dumps(meta)

    return _edit_header(RANK1, change)


def _symlink_loop(snapshot: Path) -> None:
    (snapshot / RANK1).unlink()
    (snapshot / RANK1).symlink_to(RANK1)


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
    "dtype a list": (
        _edit_header(RANK1, lambda h: _first_tensor(h).update(dtype=["F32"])),
        "dtype ['F32'] is not supported",
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
    "header nested 1000 levels": (
        _header_text(RANK1, lambda text: text[:-1] + ',"deep":' + _nested(1000) + "}"),
        "header is nested too deeply to parse",
    ),
    "gradstat metadata nested 1000 levels": (
        _meta_text(RANK1, lambda text: text[:-1] + ',"deep":' + _nested(1000) + "}"),
        "gradstat metadata is nested too deeply to parse",
    ),
    "60,000 header keys, one twice": (
        _header_text(RANK1, _extra_keys),
        "header lists 'k59999' twice",
    ),
    "60,000 parameter records, one twice": (
        _edit_meta(RANK1, _extra_records),
        "parameter 'p59999' is listed twice",
    ),
    "key twice in the gradstat metadata": (
        _meta_text(RANK1, lambda text: text[:-1] + ',"step":7}'),
        "gradstat metadata lists 'step' twice",
    ),
    "empty tensor with a 2^63 dimension": (
        _empty_tensor([0, 2**63]),
        "shape [0, 9223372036854775808] is too large for torch",
    ),
    "empty tensor whose strides overflow": (
        _empty_tensor([0, 2**62, 4]),
        "shape [0, 4611686018427387904, 4] is too large for torch",
    ),
    "empty GTP shard of a 2^63-row tensor": (
        _empty_tensor([2**62, 0], is_gtp_weight_remat=True, gtp_group=[1, 2]),
        "parameter 'empty': shape [4611686018427387904, 0] across 2 shards is too large",
    ),
    "param_shape with a 2^63 dimension": (
        _edit_meta(RANK1, lambda m: m["params"].append({**m["params"][0], "param_shape": [2**63]})),
        "field 'param_shape' is [9223372036854775808], too large for torch",
    ),
    "rank file a symlink to itself": (_symlink_loop, "a symlink loop"),
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


@pytest.mark.parametrize(
    "case",
    [
        "empty tensor with a 2^63 dimension",
        "empty tensor whose strides overflow",
        "empty GTP shard of a 2^63-row tensor",
    ],
)
def test_oversized_empty_tensor_compared_with_itself(case: str, tmp_path: Path) -> None:
    """compare rebuilds the tensor from both sides (the GTP shard stacked to 2^63 rows): the
    shape must be refused when the snapshot is opened, never reach torch.empty."""
    snapshot = tmp_path / "snapshot"
    shutil.copytree(SAMPLE, snapshot)
    make, message = CASES[case]
    make(snapshot)
    before = _state(snapshot)
    result = CliRunner().invoke(app, ["compare", str(snapshot), str(snapshot)])
    assert result.exit_code == 2, (result.exception, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and str(snapshot) in lines[0], lines
    assert _state(snapshot) == before


def test_missing_directory(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["norm", str(tmp_path / "absent")])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"gradstat: error: {tmp_path / 'absent'}: no such directory"


@pytest.mark.parametrize("name", ["rank-00000.safetensors", "mp_rank_00.pth", "notes.txt"])
def test_a_file_given_for_a_snapshot_names_its_directory(tmp_path: Path, name: str) -> None:
    """A rank file (or a wgrads file) given where its snapshot belongs: the line says to pass
    the directory that holds it; another file is only not a directory."""
    shutil.copytree(SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt", tmp_path / "snap")
    path = tmp_path / "snap" / name
    path.touch()
    result = CliRunner().invoke(app, ["norm", str(path)])
    assert result.exit_code == 2
    said = f"gradstat: error: {path}: not a directory"
    if name != "notes.txt":
        said += f"; pass the snapshot, the directory that holds it ({tmp_path / 'snap'})"
    assert result.stderr.strip() == said


def test_symlink_loop_directory(tmp_path: Path) -> None:
    loop = tmp_path / "snapshot"
    loop.symlink_to("snapshot")
    result = CliRunner().invoke(app, ["norm", str(loop)])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.strip() == (
        f"gradstat: error: {loop}: a symlink loop (the link leads back to itself)"
    )
    assert os.readlink(loop) == "snapshot"


def _gradstat(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -c code args``: the CLI in a process of its own, where a crash is a status."""
    return run_python(code, *args)


def _one_error_line(result: subprocess.CompletedProcess[str], *parts: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("gradstat: error: ")
    for part in parts:
        assert part in lines[0], lines[0]


# Numbers in a header that once sized what gradstat built: before, a set of world_size ranks
# (1.4 GB at 10^7) and a tuple of an axis's ranks in the TP/GTP placement (itertools.product).
HUGE: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "world size 10^9": (
        lambda meta: meta.update(world_size=10**9),
        "999999992 of 1000000000 rank files missing (rank 8, 9, 10, 11",
    ),
    "tp axis of 10^9 ranks": (
        lambda meta: meta["coords"].update(tp=[0, 10**9]),
        "axis tp has size 1000000000, larger than the world size 8",
    ),
}

# Under a 2 GiB cap on the data segment such a structure (tens of GB at 10^9) fails with
# MemoryError, exit 1, instead of taking the machine's memory (an uncapped run was OOM-killed).
CAPPED_RUN = """
import resource, sys
resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))
from gradstat.cli import main
sys.argv = ["gradstat", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize(
    ("case", "command"),
    [
        ("world size 10^9", "norm"),
        ("tp axis of 10^9 ranks", "audit"),
        ("tp axis of 10^9 ranks", "compare"),
    ],
)
def test_huge_header_numbers_cost_what_the_files_do(
    case: str, command: str, tmp_path: Path
) -> None:
    snapshot = tmp_path / "snapshot"
    shutil.copytree(SAMPLE, snapshot)
    change, message = HUGE[case]
    _every_file(change)(snapshot)
    before = _state(snapshot)
    inputs = [str(SAMPLE), str(snapshot)] if command == "compare" else [str(snapshot)]
    result = _gradstat(CAPPED_RUN, command, *inputs)
    _one_error_line(result, str(snapshot), message)
    assert _state(snapshot) == before


# Truncates a rank file during a run, at a chosen moment, then runs the CLI:
# "validated": right after Snapshot.open validated the snapshot holding it;
# "mapped": right after it is first mapped, before any of its tensors is read;
# "kept": the same moment, for a small file read whole with its header (not mapped);
# "never": not at all.
TRUNCATING_RUN = """
import sys
from contextlib import contextmanager
from pathlib import Path

from gradstat.cli import main  # first: it quiets torch's import-time numpy warning
from gradstat.snapshot import Snapshot, container, reader

victim, keep, moment, *args = sys.argv[1:]
if moment == "mapped":
    reader.SMALL_FILE_BYTES = 0  # every file mapped


def cut():
    with open(victim, "r+b") as file:
        file.truncate(int(keep))


if moment == "validated":
    validate = Snapshot.open.__func__

    def validate_then_cut(cls, directory, *options):
        snapshot = validate(cls, directory, *options)
        if Path(directory) == Path(victim).parent:
            cut()
        return snapshot

    Snapshot.open = classmethod(validate_then_cut)
elif moment != "never":
    original, done = container.mapped, []

    @contextmanager
    def map_then_cut(found):
        with original(found) as tensors:
            if Path(found.path) == Path(victim) and not done:
                cut()
                done.append(victim)
            yield tensors

    for module in list(sys.modules.values()):
        if getattr(module, "mapped", None) is original:
            module.mapped = map_then_cut
sys.argv = ["gradstat", *args]
main()
"""


@pytest.mark.parametrize("moment", ["validated", "mapped"])
@pytest.mark.parametrize("command", ["norm", "clip", "audit"])
def test_file_truncated_during_a_run(moment: str, command: str, tmp_path: Path) -> None:
    """Before: SIGBUS with no message (mapped), a ValueError traceback (validated)."""
    snapshot = tmp_path / "snapshot"
    shutil.copytree(SAMPLE, snapshot)
    victim = snapshot / RANK1
    (length,) = struct.unpack("<Q", victim.read_bytes()[:8])
    keep = 8 + length  # the header stays, every tensor's bytes go
    expected = {**_state(snapshot), RANK1: victim.read_bytes()[:keep]}
    out = tmp_path / "clipped"
    extra = ["--out", str(out), "--max-norm", "0.001"] if command == "clip" else []
    result = _gradstat(
        TRUNCATING_RUN, str(victim), str(keep), moment, command, str(snapshot), *extra
    )
    _one_error_line(result, str(victim), "the file changed while gradstat was reading it")
    assert _state(snapshot) == expected  # only the truncation: gradstat wrote nothing
    assert sorted(path.name for path in tmp_path.iterdir()) == ["snapshot"]


def test_a_small_file_cut_after_it_was_read_gives_the_numbers_read(tmp_path: Path) -> None:
    """A small rank file is read whole with its header; cut once its tensors are viewed in those
    bytes, the numbers are the file's as it was read, the same as without the cut."""
    snapshot = tmp_path / "snapshot"
    shutil.copytree(SAMPLE, snapshot)
    victim = snapshot / RANK1
    (length,) = struct.unpack("<Q", victim.read_bytes()[:8])
    args = ["norm", str(snapshot), "--json"]
    untouched = _gradstat(TRUNCATING_RUN, str(victim), "0", "never", *args)
    assert untouched.returncode == 0, untouched.stderr
    result = _gradstat(TRUNCATING_RUN, str(victim), str(8 + length), "kept", *args)
    assert result.returncode == 0, result.stderr
    assert len(victim.read_bytes()) == 8 + length  # it was cut
    assert json.loads(result.stdout) == json.loads(untouched.stdout)


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


def test_coordinates_that_describe_more_places_than_ranks(tmp_path: Path) -> None:
    """Issue 18: dp read with GTP folded in (TP=1 x GTP=2 x DP=2 dumped with dp [r, 4]) made a
    snapshot whose replicas were merged wrongly, 1.7% low and exit 0. It is refused."""
    import torch

    from gradstat.snapshot import save_rank
    from tests._params import param_with

    snapshot = tmp_path / "gtp-folded-into-dp"
    for rank in range(4):
        grad = torch.full((4, 2), float(rank + 1))
        param = param_with(grad, tensor_model_parallel=False)
        coords = {"dp": [rank, 4], "gtp": [rank % 2, 2]}
        save_rank(snapshot, [("w", param)], rank=rank, world_size=4, coords=coords)
    before = {path.name: path.read_bytes() for path in snapshot.iterdir()}
    result = run_gradstat("norm", snapshot)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "describe 8 places" in lines[0] and "has 4 ranks" in lines[0]
    assert {path.name: path.read_bytes() for path in snapshot.iterdir()} == before


# --- Megatron wgrads dumps ----------------------------------------------------------------------

WGRADS_VICTIM = "mp_rank_01_000.pth"


class _RunsCode:
    """What a hostile pickle holds: unpickling it would run a shell command."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.sentinel}",))


def _wgrads_replace(content: Callable[[Path], Any]) -> Callable[[Path], None]:
    def make(dump: Path) -> None:
        import torch

        torch.save(content(dump), dump / WGRADS_VICTIM)

    return make


def _wgrads_every_file(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def make(dump: Path) -> None:
        import torch

        for path in dump.iterdir():
            chunks = torch.load(path)
            change(chunks["model_chunk0"])
            torch.save(chunks, path)

    return make


def _wgrads_cut(dump: Path) -> None:
    path = dump / WGRADS_VICTIM
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


WGRADS_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "a pickle that would run code": (
        _wgrads_replace(lambda dump: {"model_chunk0": {"w": _RunsCode(dump.parent / "ran")}}),
        "not nested dicts of tensors",
    ),
    "a list among the tensors": (
        _wgrads_replace(lambda _: {"model_chunk0": {"w": [1.0, 2.0]}}),
        "model_chunk0/w",
    ),
    "truncated": (_wgrads_cut, WGRADS_VICTIM),
    "a TP file missing": (lambda dump: (dump / WGRADS_VICTIM).unlink(), "no file for TP rank 1"),
    "an unknown name": (
        _wgrads_every_file(
            lambda chunk: chunk.update(
                {"decoder.layers.0.adapter.w": chunk.pop("decoder.final_layernorm.weight")}
            )
        ),
        "matches no Megatron naming rule",
    ),
}


@pytest.mark.parametrize("case", sorted(WGRADS_CASES))
@pytest.mark.parametrize("command", ["norm", "zeros", "audit", "compare", "inspect"])
def test_bad_wgrads_dump(case: str, command: str, tmp_path: Path) -> None:
    from tests._wgrads import Layout, Model

    model = Model.make(Layout(tp=2, ep=2, experts=4))
    good, dump = tmp_path / "good" / "iter_0000010", tmp_path / "bad" / "iter_0000010"
    model.write(good)
    model.write(dump)
    make, message = WGRADS_CASES[case]
    make(dump)
    before = _state(dump)
    inputs = [str(good), str(dump)] if command == "compare" else [str(dump)]
    result = CliRunner().invoke(app, [command, *inputs])
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gradstat: error: ") and str(dump) in lines[0]
    assert message in lines[0], lines[0]
    assert _state(dump) == before
    assert not (tmp_path / "bad" / "ran").exists()


# --- PyTorch distributed checkpoints ------------------------------------------------------------


def _write_checkpoint(directory: Path) -> None:
    """A small model and its AdamW state, saved by torch.distributed.checkpoint (one process)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    weights, states = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # saved without a process group, as one process
        dcp.save({"model": weights, "optimizer": states}, checkpoint_id=str(directory))


def _edit_storage(change: Callable[[Any], Any]) -> Callable[[Path], None]:
    """Rewrite the first weight chunk's storage entry of the (test's own, trusted) metadata."""

    def make(checkpoint: Path) -> None:
        path = checkpoint / ".metadata"
        metadata = pickle.loads(path.read_bytes())
        index = next(key for key in metadata.storage_data if key.fqn == "model.0.weight")
        metadata.storage_data[index] = change(metadata.storage_data[index])
        path.write_bytes(pickle.dumps(metadata))

    return make


def _replaced(**fields: Any) -> Callable[[Any], Any]:
    import dataclasses

    return lambda info: dataclasses.replace(info, **fields)


def _cut_data(checkpoint: Path) -> None:
    (path,) = checkpoint.glob("*.distcp")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


CHECKPOINT_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "a metadata pickle that would run code": (
        lambda checkpoint: (checkpoint / ".metadata").write_bytes(
            pickle.dumps(_RunsCode(checkpoint.parent / "ran"))
        ),
        "refused to unpickle",
    ),
    "a storage path out of the directory": (
        _edit_storage(_replaced(relative_path="../outside.distcp")),
        "model.0.weight",
    ),
    "a compressed entry": (
        _edit_storage(_replaced(transform_descriptors=["zstd"])),
        "model.0.weight",
    ),
    "a truncated data file": (_cut_data, "__0_0.distcp"),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
@pytest.mark.parametrize("command", ["norm", "zeros", "audit", "compare", "inspect"])
def test_bad_checkpoint(case: str, command: str, tmp_path: Path) -> None:
    good, checkpoint = tmp_path / "good", tmp_path / "bad" / "step-1"
    _write_checkpoint(good)
    shutil.copytree(good, checkpoint)
    make, message = CHECKPOINT_CASES[case]
    make(checkpoint)
    before = _state(checkpoint)
    inputs = [str(good), str(checkpoint)] if command == "compare" else [str(checkpoint)]
    result = CliRunner().invoke(app, [command, *inputs])
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gradstat: error: ") and str(checkpoint) in lines[0], lines[0]
    assert message in lines[0], lines[0]
    assert _state(checkpoint) == before
    assert not (tmp_path / "bad" / "ran").exists()


def test_a_checkpoint_without_its_metadata_says_so(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path)
    (tmp_path / ".metadata").unlink()  # an interrupted save writes the data files first
    result = CliRunner().invoke(app, ["norm", str(tmp_path)])
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert "holds DCP data files (__0_0.distcp) but no .metadata" in line, line


def test_a_kind_the_checkpoint_lacks_is_named_with_what_it_holds(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path)
    result = CliRunner().invoke(app, ["norm", str(tmp_path), "--kind", "grad"])
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert "holds no gradients" in line and "model weights (4)" in line, line
    result = CliRunner().invoke(app, ["norm", str(tmp_path), "--kind", "moments"])
    assert result.exit_code == 2 and "--kind 'moments' is not a kind" in result.stderr


def test_a_kind_given_for_a_gradient_snapshot_is_refused() -> None:
    result = CliRunner().invoke(app, ["norm", str(SAMPLE), "--kind", "weight"])
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert str(SAMPLE) in line and "this is a gradient snapshot, not a checkpoint" in line


# --- special files named like a snapshot's ------------------------------------------------------


def _special_sources(root: Path) -> dict[str, tuple[Path, str]]:
    """A good snapshot of each kind, and the file in it the test replaces."""
    from tests._wgrads import Layout, Model

    rank_files, dump, checkpoint = root / "rank-files", root / "iter_0000010", root / "step-1"
    shutil.copytree(SAMPLE, rank_files)
    Model.make(Layout(tp=2, ep=2, experts=4)).write(dump)
    _write_checkpoint(checkpoint)
    return {
        "rank file": (rank_files, "rank-00003.safetensors"),
        "wgrads file": (dump, WGRADS_VICTIM),
        "checkpoint metadata": (checkpoint, ".metadata"),
    }


@pytest.mark.parametrize("special", ["a FIFO", "a character device"])
def test_a_fifo_or_a_device_named_like_a_snapshots_file_is_refused(
    special: str, tmp_path: Path
) -> None:
    """A FIFO's open waited for a writer for ever, and /dev/zero read without end (until the
    process ran out of memory): a file that is not regular is refused in one line."""
    for source, (directory, name) in _special_sources(tmp_path / special).items():
        victim = directory / name
        victim.unlink()
        if special == "a FIFO":
            os.mkfifo(victim)
        else:
            victim.symlink_to("/dev/zero")
        result = run_gradstat("norm", directory, timeout=120)
        assert result.returncode == 2 and result.stdout == "", (source, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, (source, result.stderr)
        said = lines[0].removeprefix(f"gradstat: error: {victim}: ")
        # Rank files are listed only if regular and inside the directory; the others are opened.
        listed = ("not a regular file, expected a rank file", "symlink leads out of the snapshot")
        expected = listed if source == "rank file" else (f"is {special}, not a regular file",)
        assert said.startswith(expected), (source, lines[0])
