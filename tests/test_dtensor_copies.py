"""DTensor shards held on several ranks (HSDP's replicate dimension, a module left out of a TP
plan) whose copies differ: a spike on one replica group, a gradient the rank at coordinate 0
does not hold. The norm counts each shard by its largest copy, so no copy's fault is hidden
(it counted the copy at coordinate 0 alone: a 1000x spike elsewhere was in no norm, a gradient
None at coordinate 0 was dropped).

Four gloo ranks on a 2 x 2 mesh. Every rank's gradients are built here from formulas; the
expected values are float64 sums over them, each shard by its largest copy, never gradstat's.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import gradstat
from gradstat.core import copies
from gradstat.testing import Case, launch

pytestmark = [pytest.mark.multiprocess]

_PS = (2.0, 1.0, 3.0, math.inf)
_WORLD = 4  # mesh (2, 2): rank = 2 * first coordinate + second
_STEPS = (1, 2, 3, 4)


def _full(name: str, step: int) -> torch.Tensor:
    """The gradient every copy of ``name`` holds at ``step`` (a zero in each)."""
    salt = {"w": 1, "v": 2, "b": 3}[name]
    values = torch.arange(1, 9, dtype=torch.float32) * salt * step / 7
    values[0] = 0.0
    return values.reshape(4, 2)


def _local(case: str, name: str, rank: int, step: int) -> torch.Tensor | None:
    """What ``rank`` holds of ``name`` at ``step``: its shard (``w``: Shard(0) over the second
    mesh dimension, a copy over the first; ``v``: on the first dimension's slice, a copy
    over the second; ``b``: plain), spiked or missing where the case says."""
    first, second = divmod(rank, 2)
    full = _full(name, step)
    local = full if name == "b" else full.chunk(2)[second if name == "w" else first].clone()
    if step >= 2 and case == "spike" and name == "w" and (first, second) == (1, 1):
        local = local * 1000.0  # replica group 1's copy of shard 1
    if step >= 2 and case == "slice spike" and name == "v" and (first, second) == (0, 1):
        local = local * 1000.0  # the TP-left-out module's copy on the second tp rank
    if step == 3 and case == "none at 0" and name == "w" and first == 0:
        return None  # replica group 0 holds no gradient of w; group 1 does
    if step == 4 and case == "none at 0" and name in ("w", "v") and rank == ("w", "v").index(name):
        return None  # each of two copies lacks another gradient
    return local


def _pieces(case: str, step: int) -> list[list[torch.Tensor]]:
    """Every shard of the job, as the copies the ranks hold of it."""
    found: dict[tuple[str, int], list[torch.Tensor]] = {}
    for rank in range(_WORLD):
        first, second = divmod(rank, 2)
        for name, shard in (("w", second), ("v", first), ("b", 0)):
            local = _local(case, name, rank, step)
            if local is not None:
                found.setdefault((name, shard), []).append(local.double())
    return list(found.values())


def _expected(case: str, step: int, p: float) -> float:
    pieces = _pieces(case, step)
    if p == math.inf:
        return max(float(copy.abs().max()) for held in pieces for copy in held)
    sums = [
        max(math.fsum(abs(float(x)) ** p for x in copy.flatten()) for copy in held)
        for held in pieces
    ]
    return math.fsum(sums) ** (1.0 / p)


def _expected_zeros(case: str, step: int) -> int:
    return sum(max(int((copy == 0).sum()) for copy in held) for held in _pieces(case, step))


def _run(rank: int, world_size: int, arg: tuple[str, str]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    case, directory = arg
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    w_place, v_mesh = [Replicate(), Shard(0)], mesh["dp"]

    def dtensor(local: torch.Tensor, on: Any, placements: list[Any]) -> Any:
        return DTensor.from_local(local, on, placements, run_check=False)

    w = torch.nn.Parameter(dtensor(_full("w", 1).chunk(2)[0], mesh, w_place))
    v = torch.nn.Parameter(dtensor(_full("v", 1).chunk(2)[0], v_mesh, [Shard(0)]))
    b = torch.nn.Parameter(torch.zeros(4, 2))
    recorder = gradstat.Recorder([("w", w), ("v", v), ("b", b)], directory, spike=None)
    gathered = []
    largest = copies.largest_copies

    def counted_largest(*args: Any, **kwargs: Any) -> Any:
        gathered.append(len(recorder.records))
        return largest(*args, **kwargs)

    copies.largest_copies = counted_largest  # type: ignore[assignment]
    found: dict[str, Any] = {"norms": [], "zeros": [], "recorder": [], "gathered": gathered}
    for step in _STEPS:
        held = {name: _local(case, name, rank, step) for name in ("w", "v", "b")}
        w.grad = None if held["w"] is None else dtensor(held["w"], mesh, w_place)
        v.grad = None if held["v"] is None else dtensor(held["v"], v_mesh, [Shard(0)])
        b.grad = held["b"]
        found["recorder"].append(recorder.step(step))
        found["norms"].append([gradstat.total_norm([w, v, b], p) for p in _PS])
        found["zeros"].append(gradstat.total_zeros([w, v, b]))
    recorder.wait()
    copies.largest_copies = largest  # type: ignore[assignment]
    return found


_CASES = ("agree", "spike", "slice spike", "none at 0")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("copies")
    (root / "run").mkdir()
    cases = [Case(case, _run, (case, str(root / case.replace(" ", "-")))) for case in _CASES]
    return launch(_WORLD, root / "run", cases, timeout_s=200)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(b), 1e-300)


@pytest.mark.parametrize("case", _CASES)
def test_each_shard_counts_by_its_largest_copy(four_ranks: Any, case: str) -> None:
    for found in four_ranks.values(case):
        for step, norms, zeros in zip(_STEPS, found["norms"], found["zeros"], strict=True):
            for p, norm in zip(_PS, norms, strict=True):
                assert _close(norm, _expected(case, step, p)), (case, step, p, norm)
            assert zeros == _expected_zeros(case, step), (case, step, zeros)


@pytest.mark.parametrize("case", _CASES)
def test_the_recorder_norm_counts_each_shard_by_its_largest_copy(
    four_ranks: Any, case: str
) -> None:
    for found in four_ranks.values(case):
        for step, norm in zip(_STEPS, found["recorder"], strict=True):
            assert _close(norm, _expected(case, step, 2.0)), (case, step, norm)


def test_copies_that_agree_are_told_without_gathering(four_ranks: Any) -> None:
    """The agreeing job never gathers; the spiked one does, only where its copies differ."""
    for found in four_ranks.values("agree"):
        assert found["gathered"] == [], found["gathered"]
    for found in four_ranks.values("spike"):
        assert found["gathered"] and 0 not in found["gathered"], found["gathered"]


def test_the_spike_changes_the_norm_it_was_hidden_from() -> None:
    """The scenario means something: counting coordinate 0 alone gives another norm."""
    step = 2
    at_zero = math.sqrt(sum(float((_full(n, step).double() ** 2).sum()) for n in ("w", "v", "b")))
    assert _expected("spike", step, 2.0) > 100 * at_zero
    assert _expected("slice spike", step, 2.0) > 100 * at_zero
