"""Under torchrun: rank files split over processes, numbers identical to one process."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from tests._cli import run_gradstat, run_torchrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SAMPLES = Path(__file__).resolve().parent.parent / "sample_data"


def _run(*args: str, processes: int | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m gradstat ARGS``, or under torchrun with ``processes`` processes."""
    return run_gradstat(*args, nproc=processes, timeout=240)


@pytest.mark.parametrize(
    ("snapshot", "args"),
    [
        ("tp2-pp2-dp2-ep2-distopt", ["norm", "--norm-type", "2", "--top", "100"]),
        ("gtp2-pp2-dp2-ep2", ["zeros"]),
        ("tp2-pp2-dp2-ep2-distopt-nan", ["norm", "--norm-type", "inf"]),
        ("tp2-pp2-dp2-ep2-distopt", ["explain", "--logged", "1.5"]),
        ("gtp2-pp2-dp2-ep2", ["explain", "--logged-zeros", "100"]),
    ],
)
def test_three_processes_print_what_one_prints(snapshot: str, args: list[str]) -> None:
    """3 processes do not divide the snapshot's 8 ranks; the JSON must be byte-identical."""
    command = [args[0], str(SAMPLES / snapshot), *args[1:], "--json"]
    alone = _run(*command)
    launched = _run(*command, processes=3)
    assert launched.returncode == alone.returncode, launched.stderr
    assert alone.stdout and launched.stdout == alone.stdout


def test_more_processes_than_rank_files(tmp_path: Path) -> None:
    import torch

    from gradstat.snapshot import save_rank
    from tests._params import param_with

    for rank in range(2):
        grad = torch.arange(6, dtype=torch.float32) * (rank + 1)
        param = param_with(grad, tensor_model_parallel=True)
        save_rank(tmp_path, [("w", param)], rank=rank, world_size=2, coords={"tp": [rank, 2]})
    alone = _run("zeros", str(tmp_path), "--json")
    launched = _run("zeros", str(tmp_path), "--json", processes=3)
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout == alone.stdout
    assert '"num_zeros": 2' in launched.stdout


def test_bad_rank_file_stops_every_process_with_one_line(tmp_path: Path) -> None:
    """Every process meets the error; process 0 alone says it (issue 13)."""
    snapshot = tmp_path / "snapshot"
    shutil.copytree(SAMPLES / "gtp2-pp2-dp2-ep2", snapshot)
    broken = snapshot / "rank-00005.safetensors"
    broken.write_bytes(broken.read_bytes()[:100])
    result = _run("norm", str(snapshot), processes=3)
    assert result.returncode != 0
    message = f"gradstat: error: {broken}: header length"
    assert result.stderr.count(message) == 1, result.stderr
    assert len(_error_lines(result.stderr)) == 1, result.stderr
    # torchrun's own launcher prints a traceback when its children fail; none comes from ours.
    assert "gradstat/cli/app.py" not in result.stderr
    assert result.stdout == ""


def test_compare_under_three_processes_prints_what_one_prints() -> None:
    """Full tensors are rebuilt by parameter, split over the processes."""
    command = [
        "compare",
        str(SAMPLES / "tp2-pp2-dp2-ep2-distopt"),
        str(SAMPLES / "tp2-pp2-dp2-ep2-distopt-nan"),
        "--json",
    ]
    alone = _run(*command)
    launched = _run(*command, processes=3)
    assert alone.returncode == launched.returncode == 1, launched.stderr
    assert '"mismatches": [' in alone.stdout and launched.stdout == alone.stdout


def test_audit_under_three_processes_prints_what_one_prints(tmp_path: Path) -> None:
    from gradstat.testing import Layout, RankParams
    from tests import _model

    def plant(ranks: list[RankParams]) -> None:
        for share, param in _model.params_named(ranks, _model.LAYERNORM):
            if share.coords["tp"][0] == 1:
                param.grad[0] += 1.0
        for _, param in _model.params_named(ranks, _model.OUTPUT):
            param.shared = False
        for share, param in _model.params_named(ranks, _model.QKV):
            if share.coords["gtp"][0] == 1:
                param.grad[-1] = 2.0

    layout = Layout(tp=2, gtp=2, pp=2, gtp_align=8)
    directory = _model.write(tmp_path, layout, plant=plant)
    alone = _run("audit", str(directory), "--json")
    launched = _run("audit", str(directory), "--json", processes=3)
    assert alone.returncode == launched.returncode == 1, launched.stderr
    kinds = [finding["kind"] for finding in json.loads(alone.stdout)["findings"]]
    assert sorted(kinds) == ["gtp_padding_nonzero", "tied_copy_counted_twice", "tp_replicas_differ"]
    assert launched.stdout == alone.stdout


# Started by torchrun, each process runs the gradstat command line given for its rank, from
# the working directory given for it.
STARTER = """
import json, os, sys
from gradstat.cli import main

cwd, arguments = json.loads(sys.argv[1])[int(os.environ["RANK"])]
os.chdir(cwd)
sys.argv = ["gradstat", *arguments]
main()
"""


def _run_each(
    tmp_path: Path, per_rank: list[tuple[Path, list[str]]]
) -> subprocess.CompletedProcess[str]:
    starter = tmp_path / "starter.py"
    starter.write_text(STARTER)
    plan = json.dumps([[str(cwd), arguments] for cwd, arguments in per_rank])
    return run_torchrun(len(per_rank), str(starter), plan, timeout=240)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("gradstat: error:")]


@pytest.mark.parametrize(
    ("process_1", "shown"),
    [
        (["-p", "3"], "norm {snapshot} -p 3"),  # another norm
        (["--top", "5"], "norm {snapshot} --top 5"),  # another option, even a harmless one
    ],
)
def test_processes_started_with_other_arguments_stop_with_one_line(
    tmp_path: Path, process_1: list[str], shown: str
) -> None:
    """Issue 14 item 4: a 5.4156 norm was printed as 14.02, merged from -p 2 and -p 3 pieces."""
    snapshot = SAMPLES / "tp2-pp2-dp2-ep2-distopt"
    result = _run_each(
        tmp_path,
        [
            (tmp_path, ["norm", str(snapshot), "-p", "2"]),
            (tmp_path, ["norm", str(snapshot), *process_1]),
        ],
    )
    assert result.returncode != 0
    assert _error_lines(result.stderr) == [
        "gradstat: error: process 1 of 2 was started with other arguments than process 0 "
        f'(process 1 ran "gradstat {shown.format(snapshot=snapshot)}", process 0 "gradstat norm '
        f'{snapshot} -p 2"); start every process with the same command'
    ], result.stderr
    assert result.stdout == ""


def test_processes_reading_other_snapshots_stop_with_one_line(tmp_path: Path) -> None:
    """The same command line, but "snapshot" is another directory for each process.

    The digest reads names, sizes and headers, not the gradients: snapshots that differ only in
    their data (the "-nan" sample against its original) are not told apart.
    """
    for name, sample in (("a", "tp2-pp2-dp2-ep2-distopt"), ("b", "gtp2-pp2-dp2-ep2")):
        (tmp_path / name).mkdir()
        shutil.copytree(SAMPLES / sample, tmp_path / name / "snapshot")
    arguments = ["norm", "snapshot", "--json"]
    result = _run_each(tmp_path, [(tmp_path / "a", arguments), (tmp_path / "b", arguments)])
    _assert_stopped_seeing_others(result, "process 1 of 2")


def _assert_stopped_seeing_others(result: subprocess.CompletedProcess[str], who: str) -> None:
    assert result.returncode != 0
    assert _error_lines(result.stderr) == [
        f"gradstat: error: {who} sees other rank files in snapshot than process 0 "
        "(names, sizes or headers differ); every process must read the same snapshot"
    ], result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("changed", [False, True])
def test_views_of_several_processes_split_the_digest(tmp_path: Path, changed: bool) -> None:
    """Processes 0 and 1 read one copy (one view: they split its digest, files 0, 2, ... and
    1, 3, ...), process 2 another. Equal copies agree; a header byte changed in a file of
    process 1's half (its padding: same size, still valid) stops them all."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        shutil.copytree(SAMPLES / "tp2-pp2-dp2-ep2-distopt", tmp_path / name / "snapshot")
    if changed:
        rank_file = tmp_path / "a" / "snapshot" / "rank-00001.safetensors"
        data = bytearray(rank_file.read_bytes())
        end = 8 + int.from_bytes(data[:8], "little")
        assert data[end - 1 : end] == b" "
        data[end - 1 : end] = b"\n"
        rank_file.write_bytes(bytes(data))
    arguments = ["norm", "snapshot", "--json"]
    result = _run_each(
        tmp_path,
        [(tmp_path / "a", arguments), (tmp_path / "a", arguments), (tmp_path / "b", arguments)],
    )
    if not changed:
        alone = _run("norm", str(SAMPLES / "tp2-pp2-dp2-ep2-distopt"), "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["total_norm"] == json.loads(alone.stdout)["total_norm"]
        return
    _assert_stopped_seeing_others(result, "process 2 of 3")


def test_the_same_snapshot_in_other_places_is_the_same_snapshot(tmp_path: Path) -> None:
    """The negative control: equal rank files under another working directory are accepted."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        shutil.copytree(SAMPLES / "tp2-pp2-dp2-ep2-distopt", tmp_path / name / "snapshot")
    arguments = ["norm", "snapshot", "--json"]
    result = _run_each(tmp_path, [(tmp_path / "a", arguments), (tmp_path / "b", arguments)])
    alone = _run("norm", str(SAMPLES / "tp2-pp2-dp2-ep2-distopt"), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["total_norm"] == json.loads(alone.stdout)["total_norm"]


def test_a_rank_file_identity_is_its_size_and_whole_header(tmp_path: Path) -> None:
    """The digest's reading of one file: its size and every byte of its header, however long
    the header (one read or two), and nothing of the data after it."""
    from gradstat.distributed.runner import _IDENTITY_READ, _rank_file_identity

    def write(name: str, header: bytes, data: bytes) -> bytes:
        path = tmp_path / name
        path.write_bytes(len(header).to_bytes(8, "little") + header + data)
        return bytes(path)

    for header_len in (16, _IDENTITY_READ - 8, _IDENTITY_READ - 7, 3 * _IDENTITY_READ):
        header = b"{" + b" " * (header_len - 2) + b"}"
        changed_last = header[:-2] + b"x}"
        same = _rank_file_identity(write("a", header, b"data"))
        assert same == b"%d\0%s" % (8 + header_len + 4, len(header).to_bytes(8, "little") + header)
        assert _rank_file_identity(write("b", header, b"DATA")) == same  # the data is not read
        assert _rank_file_identity(write("c", changed_last, b"data")) != same
        assert _rank_file_identity(write("d", header, b"data!")) != same  # another size
    # A header length past the file's end: what there is; a file too short for one: its bytes.
    cut = tmp_path / "cut"
    cut.write_bytes((1 << 20).to_bytes(8, "little") + b"{}")
    assert _rank_file_identity(bytes(cut)) == b"10\0" + cut.read_bytes()
    cut.write_bytes(b"abc")
    assert _rank_file_identity(bytes(cut)) == b"3\0abc"


def test_pieces_cross_processes_as_columns_unchanged() -> None:
    """What a process sends of its pieces (a list per field, through JSON) gives back the same
    pieces, in order: non-finite norms, a NaN/Inf record, no peak, an expert row, a tensor placed
    at its site (a box), none at all."""
    import math

    from gradstat.analysis.stats import NonFinite, Piece

    pieces = [
        Piece(0, "a", False, 12, 0, 3, (1.5, 0.25), 2.0, None),
        Piece(0, "b", True, 7, 2, 0, (math.inf, math.nan), math.inf, NonFinite(0, "b", 1, 2)),
        Piece(3, "c[4]", True, 1, 0, 1, (0.0,), None, None, row_of="c"),
        Piece(5, "d", False, 2**40, 0, 2**33, (1e-300, 3e300), 5e-324, None),
        Piece(6, "e", False, 4, 0, 0, (2.0,), 2.0, None, site=(1, -1, 0, -1), extent=12),
    ]
    pieces[-1] = pieces[-1]._replace(box=((2, 4), (2, 2)))
    for sent in (pieces, []):
        back = Piece.from_columns(json.loads(json.dumps(Piece.to_columns(sent))))
        assert [repr(piece) for piece in back] == [repr(piece) for piece in sent]
        assert all(type(piece.norms) is tuple for piece in back)
    with pytest.raises(ValueError):  # a column short of the others is refused, never cut
        columns = Piece.to_columns(pieces)
        Piece.from_columns([*columns[:-1], columns[-1][:-1]])


def test_file_summaries_cross_processes_as_columns_unchanged() -> None:
    """What a process sends of the rank files it read (a list per field, through JSON) gives
    back the same summaries: every header field the checks of the whole read, and the path."""
    from gradstat.snapshot.reader import FileSummary, Snapshot

    snapshot = Snapshot.open(SAMPLES / "tp2-gtp2-pp2-ep2-bugs")
    summaries = [FileSummary.of(rank_file) for rank_file in snapshot.files]
    # A process sends its rank files' summaries without making them first.
    assert FileSummary.to_columns(snapshot.files) == FileSummary.to_columns(summaries)
    summaries[1] = FileSummary(
        summaries[1].directory,
        summaries[1].name,
        summaries[1].size_bytes,
        replace(summaries[1].header, step=None, triggers=("nonfinite", "spike")),
    )
    for sent in (summaries, []):
        columns = json.loads(json.dumps(FileSummary.to_columns(sent)))
        back = FileSummary.from_columns(SAMPLES / "tp2-gtp2-pp2-ep2-bugs", columns)
        assert back == sent
        assert [summary.path for summary in back] == [summary.path for summary in sent]
    assert summaries[0].path == snapshot.files[0].path
    with pytest.raises(ValueError):  # a column short of the others is refused, never cut
        columns = FileSummary.to_columns(summaries)
        FileSummary.from_columns(SAMPLES, [*columns[:-1], columns[-1][:-1]])


def test_merge_gives_a_parameter_the_norms_that_adding_to_zero_gives() -> None:
    """A parameter's first piece is taken as it is, its next ones added with ``add_norms``:
    the totals are those of adding every piece to zero, in order, whatever the values."""
    import math

    from gradstat.analysis.stats import Piece, Request, merge
    from gradstat.core.kernels import add_norms

    request = Request.make((2.0, 1.0, 3.0, math.inf), zeros=True)
    values = (0.0, -0.0, 1e-300, 2.5, math.inf, math.nan)
    pieces = []
    for index, (a, b) in enumerate((a, b) for a in values for b in values):
        for rank, (first, second) in enumerate(((a, b), (b, a))):
            norms = (first, 0.5, second)  # request.finite is (2.0, 1.0, 3.0)
            pieces.append(Piece(rank, f"p{index}", False, 4, 0, 1, norms, abs(first), None))
    stats = {param.name: param for param in merge(pieces, request).params}
    for name, param in stats.items():
        mine = [piece for piece in pieces if piece.name == name]
        for at, norm_type in enumerate(request.finite):
            expected = 0.0
            for piece in mine:
                expected = add_norms(expected, piece.norms[at], norm_type)
            assert repr(param.norms[norm_type]) == repr(expected), (name, norm_type)
        assert param.ranks == [0, 1] and param.numel == 8 and param.zeros == 2
