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
from pathlib import Path
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
    salt = {"w": 1, "v": 2, "b": 3, "u": 5, "f": 6}[name]
    values = torch.arange(1, 9, dtype=torch.float32) * salt * step / 7
    values[0] = 0.0
    return values.reshape(4, 2)


_NAMES = ("w", "u", "v", "f", "b")


def _shard_of(name: str, rank: int) -> int:
    """Which shard of ``name`` a rank holds: ``w`` and ``u`` are Shard(0) over the second mesh
    dimension (copies over the first), ``v`` Shard(0) on the first dimension's slice (copies
    over the second), ``f`` Replicate on the flattened mesh (a copy on every rank), ``b``
    plain."""
    first, second = divmod(rank, 2)
    return {"w": second, "u": second, "v": first}.get(name, 0)


def _local(case: str, name: str, rank: int, step: int) -> torch.Tensor | None:
    """What ``rank`` holds of ``name`` at ``step``: its shard (:func:`_shard_of`), spiked,
    swapped or missing where the case says."""
    first, second = divmod(rank, 2)
    full = _full(name, step)
    local = full.chunk(2)[_shard_of(name, rank)].clone() if name in "wuv" else full.clone()
    if step >= 2 and case == "swap" and name in "wu" and rank == 3:
        # Rank 3's copies of w and u hold each other's values (replicas that reduced into
        # the wrong parameters): sums over the copies are unchanged.
        return _full("u" if name == "w" else "w", step).chunk(2)[1].clone()
    if step >= 2 and case == "zeros cancel" and rank == 2:
        if name == "w":
            local[0, 1] = 0.0  # one zero more in this copy of w ...
        elif name == "u":
            local[0, 0] = 5.0  # ... and one fewer in this copy of u
    if step >= 2 and case == "flat spike" and name == "f" and rank == 2:
        local = local * 1000.0
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
        for name in _NAMES:
            local = _local(case, name, rank, step)
            if local is not None:
                found.setdefault((name, _shard_of(name, rank)), []).append(local.double())
    return list(found.values())


def _expected(case: str, step: int, p: float) -> float:
    pieces = _pieces(case, step)
    if p == math.inf:
        return max(float(copy.abs().max()) for held in pieces for copy in held)
    sums = [
        max(math.fsum(abs(float(x)) ** p for x in copy.flatten()) for copy in held)
        for held in pieces
    ]
    return float(math.fsum(sums) ** (1.0 / p))


def _expected_zeros(case: str, step: int) -> int:
    return sum(max(int((copy == 0).sum()) for copy in held) for held in _pieces(case, step))


def _run(rank: int, world_size: int, arg: tuple[str, str]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    case, directory = arg
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat = mesh["dp", "tp"]._flatten("world")
    places: dict[str, tuple[Any, list[Any]]] = {
        "w": (mesh, [Replicate(), Shard(0)]),
        "u": (mesh, [Replicate(), Shard(0)]),
        "v": (mesh["dp"], [Shard(0)]),
        "f": (flat, [Replicate()]),
    }

    def grad_of(name: str, local: torch.Tensor | None) -> Any:
        if local is None or name not in places:
            return local
        on, placements = places[name]
        return DTensor.from_local(local, on, placements, run_check=False)

    params = {
        name: torch.nn.Parameter(grad_of(name, _local("agree", name, rank, 1)).detach())
        for name in _NAMES
    }
    recorder = gradstat.Recorder(list(params.items()), directory, spike=None)
    gathered = []
    largest = copies.largest_copies

    counting = [True]  # the recorder's and the aligned list's calls only

    def counted_largest(*args: Any, **kwargs: Any) -> Any:
        if counting[0]:
            gathered.append(len(recorder.records))
        return largest(*args, **kwargs)

    copies.largest_copies = counted_largest
    found: dict[str, Any] = {"norms": [], "zeros": [], "recorder": [], "gathered": gathered}
    found["directory"] = directory
    found |= {"filtered": [], "reordered": []}
    listed = list(params.values())
    # Replica group 1 lists the parameters the other way round.
    reordered = listed[::-1] if rank >= 2 else listed
    for step in _STEPS:
        for name, param in params.items():
            param.grad = grad_of(name, _local(case, name, rank, step))
        found["recorder"].append(recorder.step(step))
        if case == "none at 0":  # a snapshot of each step, for the command line
            gradstat.snapshot.dump_rank(f"{directory}/dump-{step}", list(params.items()))
        found["norms"].append([gradstat.total_norm(listed, p) for p in _PS])
        found["zeros"].append(gradstat.total_zeros(listed))
        # The usual list of gradients: a None on some ranks shortens theirs. Lists that do
        # not line up gather (they cannot be told from copies that differ).
        counting[0] = False
        grads = [param.grad for param in listed if param.grad is not None]
        found["filtered"].append([gradstat.total_norm(grads, p) for p in _PS])
        if case in _REORDERABLE:
            found["reordered"].append([gradstat.total_norm(reordered, p) for p in _PS])
        counting[0] = True
    recorder.wait()
    copies.largest_copies = largest
    return found


_CASES = ("agree", "spike", "slice spike", "none at 0", "swap", "zeros cancel", "flat spike")
# Where copies of two parameters of the same shapes differ (swap, zeros cancel), lists in other
# orders cannot tell which copy is which: those cases keep one order.
_REORDERABLE = ("agree", "spike", "slice spike", "none at 0", "flat spike")


# Per rank, its copy of a float64 gradient of four replicas, in units of 2**260: the copies'
# sums of squares (8, 10, 6, 8 units squared) add up to three times the first's, and their
# squares overflow float64.
_HUGE = ([2.0, 2.0, 0.0], [3.0, 1.0, 0.0], [2.0, 1.0, 1.0], [2.0, 2.0, 0.0])


def _huge(rank: int, world_size: int, _arg: Any) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (world_size,))
    local = torch.tensor(_HUGE[rank], dtype=torch.float64) * 2.0**260
    return gradstat.total_norm([DTensor.from_local(local, mesh, [Replicate()], run_check=False)])


def _partial_then_reduced(rank: int, world_size: int, directory: str) -> list[Any]:
    """A recorder's steps before the gradient's reduction (Partial), then one after; whether
    its per-parameter statistics came back."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (world_size,))
    local = torch.tensor([3.0, 4.0])
    weight = torch.nn.Parameter(DTensor.from_local(local, mesh, [Replicate()]))
    recorder = gradstat.Recorder([("w", weight)], directory, spike=None)
    norms = []
    for step, placement in ((1, Partial()), (2, Partial()), (3, Replicate())):
        weight.grad = DTensor.from_local(local.clone(), mesh, [placement], run_check=False)
        norms.append(recorder.step(step))
    recorder.wait()
    steps = []
    if rank == 0:
        from gradstat.analysis.history import read_history

        steps = read_history(Path(directory)).steps
    return [*norms, recorder.params is not None, steps]


_STAGE_NAMES = ("pp", "PP", "pipe", "stage")


def _stage_layer(stage: int) -> torch.Tensor:
    """Pipeline stage ``stage``'s layer: the same shape on every stage, other values."""
    return torch.arange(1, 9, dtype=torch.float32).reshape(4, 2) * (stage + 1) / 3


def _pipeline_stages(rank: int, world_size: int, name: str) -> float:
    """Two pipeline stages (the first mesh dimension, named ``name``) each holding its own
    layer, sharded over data parallelism (the second): a slice of the root mesh whose left-out
    dimension holds other layers, not copies."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(name, "dp"))
    stage, shard = divmod(rank, 2)
    local = _stage_layer(stage).chunk(2)[shard].clone()
    return gradstat.total_norm([DTensor.from_local(local, mesh["dp"], [Shard(0)])])


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("copies")
    (root / "run").mkdir()
    cases = [Case(case, _run, (case, str(root / case.replace(" ", "-")))) for case in _CASES]
    cases.append(Case("huge", _huge))
    cases += [Case(f"stages {name}", _pipeline_stages, name) for name in _STAGE_NAMES]
    cases.append(Case("partial", _partial_then_reduced, str(root / "partial")))
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
def test_a_list_of_the_gradients_held_counts_the_same(four_ranks: Any, case: str) -> None:
    """``[p.grad for p in params if p.grad is not None]``: with a gradient None on some ranks,
    the lists' places no longer lined up and shards were matched with other shards' copies
    (0.weight against 1.weight: one counted twice, the other not at all)."""
    for found in four_ranks.values(case):
        for step, norms in zip(_STEPS, found["filtered"], strict=True):
            for p, norm in zip(_PS, norms, strict=True):
                assert _close(norm, _expected(case, step, p)), (case, step, p, norm)


@pytest.mark.parametrize("case", _REORDERABLE)
def test_lists_in_another_order_count_the_same(four_ranks: Any, case: str) -> None:
    """Replica group 1 listing the parameters in another order: equal copies at other places
    counted as copies that differ, the largest of two parameters counted for both."""
    for found in four_ranks.values(case):
        for step, norms in zip(_STEPS, found["reordered"], strict=True):
            for p, norm in zip(_PS, norms, strict=True):
                assert _close(norm, _expected(case, step, p)), (case, step, p, norm)


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


def test_copies_whose_squares_overflow_are_still_told_apart(four_ranks: Any) -> None:
    """Sums over the copies agree and their squares leave float64: the largest copy, sqrt(10)
    units, was given as the first's, sqrt(8)."""
    largest = max(math.fsum(x * x for x in copy) for copy in _HUGE)
    expected = math.sqrt(largest) * 2.0**260
    for norm in four_ranks.values("huge"):
        assert _close(norm, expected), (norm, expected)


def test_the_recorder_goes_on_through_a_step_that_has_no_norm(four_ranks: Any) -> None:
    """A Partial gradient (the recorder called before the reduction) has no norm: the step
    raised out of the training loop; now it is NaN, said once, and the next step is whole."""
    for rank, (first, second, third, rows, steps) in enumerate(four_ranks.values("partial")):
        assert math.isnan(first) and math.isnan(second) and _close(third, 5.0)
        assert rows, "the per-parameter statistics stopped for good at the Partial steps"
        assert rank != 0 or steps == [1, 2, 3], steps  # the log held step 3 alone


@pytest.mark.parametrize("name", _STAGE_NAMES)
def test_pipeline_stages_hold_other_layers_whatever_the_case_of_their_name(
    four_ranks: Any, name: str
) -> None:
    """A mesh dimension named PP, pipe or stage was taken for one holding copies: the larger
    stage's layer stood for both (83.51 for 84.08 in the probe)."""
    layers = [_stage_layer(stage).double() for stage in (0, 1)]
    expected = math.sqrt(math.fsum(float(x) ** 2 for layer in layers for x in layer.flatten()))
    for norm in four_ranks.values(f"stages {name}"):
        assert _close(norm, expected), (name, norm, expected)


@pytest.mark.parametrize("p", _PS)
def test_a_snapshot_counts_a_shard_by_a_copy_where_coordinate_0_holds_none(
    four_ranks: Any, tmp_path_factory: pytest.TempPathFactory, p: float
) -> None:
    """dump_rank's snapshot of a step where replica group 0 held no gradient of ``w``: every
    command counted the copy at coordinate 0 alone, so ``w`` lost half its elements (3.70 for
    3.76 in the probe, exit 0, and audit found nothing)."""
    import json

    from tests._cli import run_gradstat

    root = Path(four_ranks.values("none at 0")[0]["directory"])
    for step in (3, 4):
        flag = "inf" if p == math.inf else str(p)
        done = run_gradstat("norm", root / f"dump-{step}", "--json", "-p", flag)
        assert done.returncode == 0, done.stdout + done.stderr
        norm = json.loads(done.stdout)["total_norm"]
        assert _close(norm, _expected("none at 0", step, p)), (step, p, norm)
    if p == 2.0:  # under torchrun each process reads a share: the records travel apart
        shared = run_gradstat("norm", root / "dump-3", "--json", nproc=2)
        assert shared.returncode == 0, shared.stdout + shared.stderr
        norm = json.loads(shared.stdout)["total_norm"]
        assert _close(norm, _expected("none at 0", 3, 2.0)), norm
