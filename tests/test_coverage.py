"""A snapshot whose counted tensors hold a parameter's elements twice is refused, not summed.

The statistics trust the attributes and the ``distributed_optimizer`` flag. A job that marks
its snapshot ``distributed_optimizer`` while every data-parallel rank holds the whole gradient
(a plain optimizer), or fragments that overlap, gave a norm sqrt(2) too large with exit 0, and
audit found nothing. Elements no rank file holds are warned of. An overlap that a gap of its
size hides (the totals right) is found from where each tensor lies. Expected norms are float64
sums over the gradients written here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from gradstat.core.axes import AXES
from gradstat.core.placements import MeshPlacement
from gradstat.snapshot import save_rank
from gradstat.snapshot.container import write_container
from gradstat.snapshot.format import METADATA_KEY, ParamRecord, RankHeader
from tests._cli import run_gradstat
from tests._oracle import float64_norm
from tests._params import param_with

_TP, _DP = 2, 2
_W = torch.arange(1.0, 25.0).reshape(4, 6) / 3  # TP-split along rows: [2, 6] per TP rank
_B = torch.tensor([0.5, -1.5, 2.0, 0.0, 4.0])  # not tensor-parallel: counted on TP rank 0
_TP_ATTRS = {"tensor_model_parallel": True, "partition_dim": 0, "partition_stride": 1}


def _coords(rank: int) -> dict[str, list[int]]:
    tp, dp = rank % _TP, rank // _TP
    return {"tp": [tp, _TP], "dp": [dp, _DP]}


def _write(folder: Path, params_of: Any, distributed_optimizer: bool) -> Path:
    for rank in range(_TP * _DP):
        tp, dp = rank % _TP, rank // _TP
        save_rank(
            folder,
            params_of(tp, dp),
            rank=rank,
            world_size=_TP * _DP,
            coords=_coords(rank),
            distributed_optimizer=distributed_optimizer,
        )
    return folder


def _whole(tp: int, _dp: int) -> list[tuple[str, Any]]:
    """What a plain optimizer's rank holds: its TP shard of w, and b, whole."""
    return [("w", param_with(_W.chunk(_TP)[tp].clone(), **_TP_ATTRS)), ("b", param_with(_B))]


def _fragments(ranges: tuple[tuple[int, int], ...]) -> Any:
    """A distributed optimizer's ranks holding w's TP-local elements ``ranges[dp]`` (empty: no
    gradient), with b whole on DP rank 0 alone."""

    def params_of(tp: int, dp: int) -> list[tuple[str, Any]]:
        local = _W.chunk(_TP)[tp].reshape(-1)
        start, stop = ranges[dp]
        grad = local[start:stop].clone() if stop > start else None
        stamps = {"fragment_offset": start, "fragment_shape": [2, 6]}
        held = [("w", param_with(grad, **_TP_ATTRS, **stamps))]
        b_stamps = {"fragment_offset": 0, "fragment_shape": [5]}
        return held + ([("b", param_with(_B.clone(), **b_stamps))] if dp == 0 else [])

    return params_of


def _refusals(folder: Path, tmp_path: Path) -> list[str]:
    """The one line with which each command that reads the statistics refuses ``folder``."""
    lines = []
    for command in ("norm", "zeros", "clip", "explain"):
        extra = {
            "clip": ("--max-norm", "1", "--out", tmp_path / "clipped"),
            "explain": ("--logged", repr(_TRUE_NORM)),  # its exact value would count twice
        }.get(command, ())
        status, _, stderr = _gradstat(command, folder, *extra)
        assert status == 2 and stderr.count("\n") == 1, (command, stderr)
        lines.append(stderr.rstrip("\n"))
    return lines


def _gradstat(*args: Any, nproc: int | None = None) -> tuple[int, dict[str, Any] | None, str]:
    result = run_gradstat(*args, nproc=nproc)
    document = json.loads(result.stdout) if result.stdout.startswith("{") else None
    return result.returncode, document, result.stderr


_TRUE_NORM = float64_norm([_W, _B], 2.0)


@pytest.mark.parametrize(
    "case",
    ["plain optimizer marked distributed", "fragments that overlap"],
)
def test_elements_counted_twice_are_refused_and_audited(tmp_path: Path, case: str) -> None:
    if case == "plain optimizer marked distributed":
        folder = _write(tmp_path / "snap", _whole, distributed_optimizer=True)
        right = _write(tmp_path / "right", _whole, distributed_optimizer=False)
        twice = 12  # each DP rank's whole TP shard of w: 12 elements counted twice
    else:
        folder = _write(tmp_path / "snap", _fragments(((0, 8), (4, 12))), True)
        right = _write(tmp_path / "right", _fragments(((0, 6), (6, 12))), True)
        twice = 4
    status, document, stderr = _gradstat("norm", right, "--json")
    assert status == 0 and document is not None, stderr
    assert math.isclose(document["total_norm"], _TRUE_NORM, rel_tol=1e-12)
    assert document["warnings"] == []
    for line in _refusals(folder, tmp_path):
        assert line.startswith(f"gradstat: error: {folder}: parameter 'w' at TP 0: its")
        assert f"hold {12 + twice} elements, {twice} more than its 12" in line
    status, document, stderr = _gradstat("audit", folder, "--json")
    assert status == 1 and document is not None, stderr
    found = [(item["kind"], item["name"]) for item in document["findings"]]
    assert found.count(("elements_counted_twice", "w")) == _TP, found
    # compare refuses the side that counts twice, whichever it is
    for pair in ((right, folder), (folder, right)):
        status, _, stderr = _gradstat("compare", *pair)
        assert status == 2 and "counted twice" in stderr, stderr


def test_elements_no_file_holds_are_warned_of(tmp_path: Path) -> None:
    folder = _write(tmp_path / "snap", _fragments(((0, 6), (6, 6))), True)
    status, document, stderr = _gradstat("norm", folder, "--json")
    assert status == 0 and document is not None, stderr
    held = [_W.chunk(_TP)[tp].reshape(-1)[:6] for tp in range(_TP)]
    assert math.isclose(document["total_norm"], float64_norm([*held, _B], 2.0), rel_tol=1e-12)
    (warning,) = document["warnings"]
    assert "parameter 'w' at TP 0: its counted tensors hold 6 elements of its 12" in warning
    assert warning.endswith("; 1 more like it (gradstat audit lists them)")
    assert stderr == f"gradstat: warning: {folder}: {warning.partition(': ')[2]}\n"
    status, document, _ = _gradstat("audit", folder, "--json")
    assert status == 1 and document is not None
    kinds = [(item["kind"], item["name"]) for item in document["findings"]]
    assert kinds.count(("elements_missing", "w")) == _TP


def test_an_overlap_that_a_gap_hides_is_refused(tmp_path: Path) -> None:
    """Fragments [0, 8) and [4, 8) of w's 12 TP-local elements hold 12 in all, as many as it
    has: the totals saw nothing, and the norm counted elements 4..8 twice and 8..12 nowhere
    (21.54 for 23.81, exit 0, audit clean). Where the fragments lie tells."""
    folder = _write(tmp_path / "snap", _fragments(((0, 8), (4, 8))), True)
    right = _write(tmp_path / "right", _fragments(((0, 8), (8, 12))), True)
    held = [
        _W.chunk(_TP)[tp].reshape(-1)[start:stop]
        for tp in range(_TP)
        for start, stop in ((0, 8), (4, 8))
    ]
    assert not math.isclose(float64_norm([*held, _B], 2.0), _TRUE_NORM, rel_tol=1e-3)
    status, document, stderr = _gradstat("norm", right, "--json")
    assert status == 0 and document is not None, stderr
    assert math.isclose(document["total_norm"], _TRUE_NORM, rel_tol=1e-12)
    assert document["warnings"] == []
    for line in _refusals(folder, tmp_path):
        assert line.startswith(
            f"gradstat: error: {folder}: parameter 'w' at TP 0: its counted tensors hold 12 "
            "elements of its 12, but ranks 0 and 2 both hold its elements [4:8]: 4 are counted "
            "twice, and 4 are in no rank file (fragments or shards that overlap); 1 more like it"
        ), line
    status, document, stderr = _gradstat("audit", folder, "--json")
    assert status == 1 and document is not None, stderr
    found = [(item["kind"], item["name"]) for item in document["findings"]]
    assert found.count(("elements_counted_twice", "w")) == _TP, found
    status, _, stderr = _gradstat("compare", right, folder)
    assert status == 2 and "counted twice" in stderr, stderr


def _write_shard(
    folder: Path,
    rank: int,
    world: int,
    grad: torch.Tensor,
    mesh: MeshPlacement,
    coords: dict[str, tuple[int, int]] | None = None,
) -> None:
    """Rank ``rank``'s file holding ``grad`` as ``0.weight``'s DTensor shard at ``mesh``, on no
    axis but dp (rank of ``world``) unless ``coords`` says otherwise."""
    full = mesh.global_shape
    record = ParamRecord("0.weight", True, tuple(grad.shape), "float32", full, {}, mesh)
    places = {axis: (0, 1) for axis in AXES} | {"dp": (rank, world)} | (coords or {})
    header = RankHeader(rank, world, None, places, False, "grad", (record,))
    with open(folder / f"rank-{rank:05d}.safetensors", "wb") as file:
        write_container(file, {METADATA_KEY: header.to_json()}, [("0.weight", grad)])


def _stages_of(
    folder: Path, stages: list[list[tuple[torch.Tensor, int]]], placed: bool = False
) -> Path:
    """Each stage's Shard(0) DTensor shards of ``0.weight``, shaped like ``_W`` (rows, and the
    first one's index), one rank file each, its mesh one rank per shard of the weight's rows;
    ``placed``: the files say their stage."""
    folder.mkdir()
    ranks = [(stage, item) for stage, shards in enumerate(stages) for item in enumerate(shards)]
    for rank, (stage, (index, (grad, start))) in enumerate(ranks):
        parts, full = _W.shape[0] // grad.shape[0], tuple(_W.shape)
        at = (start // grad.shape[0],)
        mesh = MeshPlacement((parts,), at, ("S(0)",), full, ("dp_shard",), (start, 0))
        own = {"pp": (stage, len(stages)), "dp": (index, len(stages[stage]))} if placed else None
        _write_shard(folder, rank, len(ranks), grad, mesh, own)
    return folder


def test_a_dtensor_shard_held_twice_and_another_missing_is_found(tmp_path: Path) -> None:
    """FSDP2 shards of one weight, the second file holding the first's rows at its offset: 24
    elements of 24, and the norm counted rows 0..2 twice and rows 2..4 nowhere (12.02 for
    23.33, exit 0). Where the shards lie tells."""
    top, bottom = _W.chunk(2)
    folder = _stages_of(tmp_path / "copy", [[(top, 0), (top.clone(), 0)]])
    assert not math.isclose(float64_norm([top, top], 2.0), float64_norm([_W], 2.0), rel_tol=1e-3)
    status, _, stderr = _gradstat("norm", folder)
    assert stderr == (
        f"gradstat: error: {folder}: parameter '0.weight': its counted tensors hold 24 elements "
        "of its 24, but ranks 0 and 1 both hold its elements [0:2, 0:6], copies of one tensor "
        "(their statistics alike): the copies are counted twice\n"
    )
    assert status == 2
    status, document, _ = _gradstat("audit", folder, "--json")
    assert status == 1 and document is not None
    found = [(item["kind"], item["name"]) for item in document["findings"]]
    assert ("elements_counted_twice", "0.weight") in found, found
    # Files that say their stage: two shards at one offset are counted twice, copies or not.
    stages = [[(top, 0), (bottom, 2)], [(-top, 0), (-bottom, 0)]]
    folder = _stages_of(tmp_path / "placed", stages, placed=True)
    status, _, stderr = _gradstat("norm", folder)
    assert status == 2 and stderr == (
        f"gradstat: error: {folder}: parameter '0.weight' at PP 1: its counted tensors hold 24 "
        "elements of its 24, but ranks 2 and 3 both hold its elements [0:2, 0:6]: 12 are "
        "counted twice, and 12 are in no rank file (fragments or shards that overlap)\n"
    )
    # Files that do not may be of stages of one local name in global shapes of their own:
    # only copies are told there; shards that differ are summed as they are.
    folder = _stages_of(tmp_path / "unplaced", [[(top, 0), (bottom, 0)]])
    status, document, stderr = _gradstat("norm", folder, "--json")
    assert status == 0 and document is not None, stderr
    assert math.isclose(document["total_norm"], float64_norm([_W], 2.0), rel_tol=1e-12)
    assert document["warnings"] == [] and stderr == ""


def test_pipeline_stages_cut_differently_are_no_copies(tmp_path: Path) -> None:
    """Two stages naming a weight alike, on meshes of 2 and 4, no file saying its stage: every
    element is held twice, by different values, and no shard overlaps another of its stage."""
    stages = [[(_W[:2], 0), (_W[2:], 2)], [(-row, index) for index, row in enumerate(_W.split(1))]]
    status, document, stderr = _gradstat("norm", _stages_of(tmp_path / "snap", stages), "--json")
    assert status == 0 and document is not None, stderr
    assert math.isclose(document["total_norm"], float64_norm([_W, -_W], 2.0), rel_tol=1e-12)
    assert document["warnings"] == [] and stderr == ""
    # Stages of one local name in global shapes of their own (a [24] norm weight on one, a
    # [6, 4] or [4, 6] linear on another), no file saying its stage: summed, no finding (a
    # traceback and a false warning for a while on 2026-12-06).
    for other in (_W.reshape(6, 4), _W.reshape(4, 6)):
        folder = tmp_path / f"shapes-{other.shape[0]}"
        folder.mkdir()
        shards = [(_W.reshape(-1)[:12], (24,)), (_W.reshape(-1)[12:], (24,))]
        shards += [(other[: other.shape[0] // 2], tuple(other.shape))]
        shards += [(other[other.shape[0] // 2 :], tuple(other.shape))]
        for rank, (grad, full) in enumerate(shards):
            at = rank % 2
            offset = (at * grad.shape[0], *(0 for _ in full[1:]))
            mesh = MeshPlacement((2,), (at,), ("S(0)",), full, ("dp_shard",), offset)
            _write_shard(folder, rank, len(shards), grad.clone(), mesh)
        status, document, stderr = _gradstat("norm", folder, "--json")
        assert status == 0 and document is not None, stderr
        assert math.isclose(document["total_norm"], float64_norm([_W, _W], 2.0), rel_tol=1e-12)
        assert document["warnings"] == [] and stderr == "", document["warnings"]


def test_a_dimension_sharded_twice_is_judged_by_its_totals(tmp_path: Path) -> None:
    """(Shard(0), _StridedShard(0)) on a 2 x 2 mesh: rank (i, j) holds row j * 2 + i of 4, and
    an offset that places rows by the first mesh dimension alone (rows 2 * i) makes boxes that
    overlap and leave a gap (a valid snapshot refused for a while on 2026-12-06; the probe's
    strided shards had such offsets from torch). One dimension sharded on two mesh dimensions
    has no box: the totals judge it."""
    for i in range(2):
        for j in range(2):
            rank, row = 2 * i + j, 2 * j + i
            mesh = MeshPlacement(
                (2, 2), (i, j), ("S(0)", "S(0)"), tuple(_W.shape), ("dp", "tp"), (i * 2, 0)
            )
            grad = _W[row : row + 1].clone()
            _write_shard(tmp_path, rank, 4, grad, mesh)
    status, document, stderr = _gradstat("norm", tmp_path, "--json")
    assert status == 0 and document is not None, stderr
    assert math.isclose(document["total_norm"], float64_norm([_W], 2.0), rel_tol=1e-12)
    assert document["warnings"] == [] and stderr == ""


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["plain optimizer marked distributed", "overlap a gap hides"])
def test_under_torchrun_every_process_refuses_in_one_line(tmp_path: Path, case: str) -> None:
    if case == "plain optimizer marked distributed":
        folder = _write(tmp_path / "snap", _whole, distributed_optimizer=True)
    else:  # the fragments' places cross processes with their statistics
        folder = _write(tmp_path / "snap", _fragments(((0, 8), (4, 8))), True)
    status = tmp_path / "status"
    for command in (("norm",), ("explain", "--logged", "1.0")):
        alone = run_gradstat(*command, folder)
        shared = run_gradstat(*command, folder, "--status-file", status, nproc=2)
        assert alone.returncode == 2 and status.read_text() == "2\n", command
        errors = [line for line in shared.stderr.splitlines() if line.startswith("gradstat: ")]
        assert errors == alone.stderr.splitlines() and len(errors) == 1, command


def test_shards_named_by_hand_are_no_copies(tmp_path: Path) -> None:
    """``distributed_optimizer`` also marks disjoint shards named by hand (the docs invite it):
    each DP rank's rows of w, two-dimensional, no fragment stamps. They differ, so they are
    shards; the plain optimizer's replicas above are alike, so they are copies."""
    rows = _W.chunk(_DP)
    for dp in range(_DP):
        save_rank(
            tmp_path,
            [("w", param_with(rows[dp].clone())), ("b", param_with(_B.chunk(_DP)[dp].clone()))],
            rank=dp,
            world_size=_DP,
            coords={"dp": [dp, _DP]},
            distributed_optimizer=True,
        )
    status, document, stderr = _gradstat("norm", tmp_path, "--json")
    assert status == 0 and document is not None, stderr
    assert math.isclose(document["total_norm"], _TRUE_NORM, rel_tol=1e-12)
    assert document["warnings"] == [] and stderr == ""
    # zeros too, whose counts alone (the rows' 12 elements, no zero) would look like copies
    status, document, stderr = _gradstat("zeros", tmp_path, "--json")
    assert status == 0 and document is not None, stderr
    assert document["num_elements"] == 29 and document["warnings"] == [], document


def _dtensor_file(folder: Path, rank: int, world: int, grad: torch.Tensor, place: int) -> None:
    """Rank ``rank``'s file: w's Shard(0) shard ``place`` of 2 on its stage's own mesh, as
    a job dumps it without a pipeline coordinate."""
    rows = grad.shape[0]
    full = (2 * rows, *grad.shape[1:])
    mesh = MeshPlacement((2,), (place,), ("S(0)",), full, ("dp_shard",), (place * rows, 0))
    _write_shard(folder, rank, world, grad, mesh, {"edp": (rank, world)})


def test_pipeline_stages_of_one_local_name_are_no_copies(tmp_path: Path) -> None:
    """Two stages, each an FSDP2 mesh of 2 ranks, each naming its first layer ``0.weight``;
    no file says its stage. The four shards hold different values: none is counted twice."""
    stages = [_W, -2 * _W]
    for rank in range(4):
        stage, place = divmod(rank, 2)
        _dtensor_file(tmp_path, rank, 4, stages[stage].chunk(2)[place].clone(), place)
    status, document, stderr = _gradstat("norm", tmp_path, "--json")
    assert status == 0 and document is not None, stderr
    assert math.isclose(document["total_norm"], float64_norm(stages, 2.0), rel_tol=1e-12)
    assert document["warnings"] == [] and stderr == ""
    # Copies of one tensor, though, are copies: a file written twice over.
    copies = tmp_path / "copies"
    copies.mkdir()
    for rank in range(4):
        _dtensor_file(copies, rank, 4, _W.chunk(2)[0].clone(), 0)
    status, _, stderr = _gradstat("norm", copies)
    assert status == 2 and "its counted tensors hold 48 elements, 24 more than its 24" in stderr
