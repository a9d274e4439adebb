"""Data-parallel replicas in a real job's life: a gradient None on some ranks only, and a NaN or
a spike on one replica only.

The norm of plain gradients is their union over the replicas: a rank lacking a gradient (None
after ``zero_grad()``, a parameter its batch never used) takes another rank's. Where rank 0
lacks one parameter's gradient and rank 1 another's, no rank's total is that union; the
library matches the lists by place. The flight recorder takes its norm from the statistics'
own pass once it agreed with ``total_norm``: that pass must see every rank's replicas, or a
NaN on rank 1 only is dropped (the recorder counted replicas at data-parallel rank 0).

Expected values are float64 sums over the gradients written here, never gradstat's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import gradstat
from gradstat.testing import Case, launch

pytestmark = [pytest.mark.multiprocess]

_PS = (2.0, 1.0, math.inf, 3.0)
_NAMES = ("0.weight", "0.bias", "1.weight", "1.bias")


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))


def _grad_of(name: str, shape: torch.Size) -> torch.Tensor:
    """A gradient every rank builds alike (replicas), with a zero in each."""
    values = torch.arange(1, math.prod(shape) + 1, dtype=torch.float32) * (_NAMES.index(name) + 1)
    values[0] = 0.0
    return (values / 7).reshape(shape)


def _oracle(grads: list[torch.Tensor], p: float) -> float:
    values = [abs(float(value)) for grad in grads for value in grad.double().flatten()]
    if p == math.inf:
        return max(values)
    return float(sum(value**p for value in values) ** (1.0 / p))


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(b), 1e-300)


# Per rank, the parameters whose gradient is None.
_LACKING = {
    "apart": ({"0.weight"}, {"1.weight"}),
    "rank 0 lacks two": ({"0.bias", "1.bias"}, set()),
    "alike": ({"1.bias"}, {"1.bias"}),
}


def _lacking(rank: int, _world_size: int, case: str) -> dict[str, Any]:
    model = _model()
    for name, param in model.named_parameters():
        missing = name in _LACKING[case][rank]
        param.grad = None if missing else _grad_of(name, param.shape)
    params = list(model.parameters())
    by_attr = [param.grad for param in params]  # None kept in place, as the recorder passes
    return {
        "norms": [gradstat.total_norm(params, p) for p in _PS],
        "norms of gradients": [gradstat.total_norm(by_attr, p) for p in _PS],
        "zeros": gradstat.total_zeros(params),
    }


def _listed_twice(rank: int, _world_size: int, _arg: Any) -> list[float]:
    """A parameter listed twice counts twice, whichever gradients the other rank lacks."""
    model = _model()
    for name, param in model.named_parameters():
        lacking = (rank == 0 and name == "1.weight") or (rank == 1 and name == "1.bias")
        param.grad = None if lacking else _grad_of(name, param.shape)
    params = list(model.parameters())
    return [gradstat.total_norm([params[0], *params], p) for p in _PS]


def _lengths_differ(rank: int, _world_size: int, _arg: Any) -> tuple[float, list[str]]:
    """Rank 0 passes three parameters (one without a gradient), rank 1 two."""
    import warnings

    from gradstat.errors import ReplicaWarning

    model = _model()
    for name, param in model.named_parameters():
        param.grad = None if rank == 0 and name == "0.weight" else _grad_of(name, param.shape)
    params = list(model.parameters())[: 3 if rank == 0 else 2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        norm = gradstat.total_norm(params)
    return norm, [str(w.message) for w in caught if issubclass(w.category, ReplicaWarning)]


def _tp_coords_alone(rank: int, _world_size: int, directory: str) -> list[str]:
    """``coords={"tp": ...}`` beside the data-parallel size found over the world (2) makes 4
    places on 2 ranks: refused in one line by the recorder and dump_rank, not written."""
    model = torch.nn.Linear(2, 2)
    model.weight.grad = torch.ones(2, 2)
    said = []
    for make in (
        lambda: gradstat.Recorder(model, directory, coords={"tp": [rank, 2]}),
        lambda: gradstat.snapshot.dump_rank(directory, model, coords={"tp": [rank, 2]}),
    ):
        try:
            make()
        except (gradstat.GradstatError, ValueError) as error:
            said.append(str(error))
    gradstat.Recorder(model, f"{directory}/whole", coords={"tp": [rank, 2], "dp": [0, 1]})
    return said


def _refused_on_one_rank(rank: int, _world_size: int, _arg: Any) -> list[str]:
    """Rank 1 passes an integer gradient to get_grad_norm_fp32, then both a good one."""
    said = []
    grad = torch.tensor([3, 4]) if rank == 1 else torch.tensor([3.0, 4.0])
    try:
        gradstat.get_grad_norm_fp32([grad])
    except gradstat.GradstatError as error:
        said.append(str(error))
    said.append(repr(gradstat.get_grad_norm_fp32([torch.tensor([6.0, 8.0])])))
    return said


def _zeros_refused_on_one_rank(rank: int, _world_size: int, _arg: Any) -> list[str]:
    """Rank 1 passes count_zeros_fp32 an integer gradient, then a meta-device one, then both
    good ones."""
    from tests._params import param_with

    said = []
    bad = [
        param_with(torch.tensor([0, 4])),
        param_with(torch.zeros(2, device="meta")),
    ]
    for refused in bad:
        try:
            gradstat.count_zeros_fp32([refused if rank == 1 else param_with(torch.zeros(3))], None)
        except gradstat.GradstatError as error:
            said.append(str(error))
    said.append(repr(gradstat.count_zeros_fp32([param_with(torch.tensor([0.0, 2.0, 0.0]))], None)))
    return said


def _replicate_copy_goes_bad(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """A Replicate DTensor ``w`` (counted at mesh coordinate 0) beside a plain ``b``: rank 1's
    copy of ``w`` holds a NaN at step 2 and an Inf at step 3."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.tensor([[3.0, 4.0], [12.0, 0.0]])
    weight = torch.nn.Parameter(DTensor.from_local(full.clone(), mesh, [Replicate()]))
    bias = torch.nn.Parameter(torch.zeros(2))
    recorder = gradstat.Recorder([("w", weight), ("b", bias)], directory, spike=None)
    found: dict[str, Any] = {"recorder": [], "total_norm": [], "triggers": []}
    for step in (1, 2, 3):
        local = full.clone()
        if rank == 1 and step > 1:
            local[0, 0] = math.nan if step == 2 else math.inf
        weight.grad = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
        bias.grad = torch.tensor([0.0, 5.0])
        found["recorder"].append(recorder.step(step))
        found["total_norm"].append(gradstat.total_norm([weight, bias]))
        found["triggers"].append(list(recorder.records[-1].triggers))
    return found


def _expert_replicas(rank: int, _world_size: int, arg: tuple[str, bool]) -> float:
    """A DDP job whose second layer is an expert's (DeepSpeed's and Megatron's
    ``allreduce=False``), on data parallelism alone, or on 2 tensor-parallel ranks given as
    coords (no expert axis named): a snapshot at step 1."""
    directory, tensor_parallel = arg
    model = _model()
    for param in model[1].parameters():
        param.allreduce = False  # type: ignore[attr-defined]
    coords = {"tp": [rank, 2], "dp": [0, 1]} if tensor_parallel else None
    recorder = gradstat.Recorder(model, directory, spike=None, steps=[1], coords=coords)
    for name, param in model.named_parameters():
        param.grad = _grad_of(name, param.shape)
    norm = recorder.step(1)
    recorder.wait()
    return norm


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("replicas")
    (root / "run").mkdir()
    cases = [Case(case, _lacking, case) for case in _LACKING]
    cases += [Case("listed twice", _listed_twice), Case("lengths differ", _lengths_differ)]
    cases += [Case("tp coords", _tp_coords_alone, str(root / "tp"))]
    cases += [Case("refused", _refused_on_one_rank)]
    cases += [Case("zeros refused", _zeros_refused_on_one_rank)]
    cases += [Case("expert replicas", _expert_replicas, (str(root / "experts"), False))]
    cases += [Case("experts beside tp", _expert_replicas, (str(root / "experts-tp"), True))]
    cases += [Case("replicate copy", _replicate_copy_goes_bad, str(root / "replicate"))]
    cases += [
        Case("nan on rank 1", _recorded, ("nan", str(root / "nan"))),
        Case("spike on rank 1", _recorded, ("spike", str(root / "spike"))),
        Case("recorder apart", _recorded, ("apart", str(root / "apart"))),
    ]
    return root, launch(2, root / "run", cases, timeout_s=150)


@pytest.mark.parametrize("case", list(_LACKING))
def test_replicas_that_lack_different_gradients_count_their_union(
    two_ranks: Any, case: str
) -> None:
    """total_norm and total_zeros count every gradient some replica holds, once."""
    _, report = two_ranks
    model = _model()
    missing_everywhere = set.intersection(*_LACKING[case])
    union = [
        _grad_of(name, param.shape)
        for name, param in model.named_parameters()
        if name not in missing_everywhere
    ]
    expected = [_oracle(union, p) for p in _PS]
    zeros = sum(int((grad == 0).sum()) for grad in union)
    for found in report.values(case):
        for key in ("norms", "norms of gradients"):
            assert all(map(_close, found[key], expected)), (case, key, found[key], expected)
        assert found["zeros"] == zeros, case


def test_a_parameter_listed_twice_counts_twice_when_replicas_lack_different_gradients(
    two_ranks: Any,
) -> None:
    _, report = two_ranks
    model = _model()
    grads = [_grad_of(name, param.shape) for name, param in model.named_parameters()]
    expected = [_oracle([grads[0], *grads], p) for p in _PS]
    for found in report.values("listed twice"):
        assert all(map(_close, found, expected)), (found, expected)


def test_lists_of_other_lengths_that_lack_gradients_say_they_cannot_be_matched(
    two_ranks: Any,
) -> None:
    """The largest rank's total stands (rank 1's two gradients against rank 0's two of three),
    and rank 0 says so in one warning."""
    _, report = two_ranks
    model = _model()
    grads = {name: _grad_of(name, param.shape) for name, param in model.named_parameters()}
    largest = max(
        _oracle([grads["0.bias"], grads["1.weight"]], 2.0),
        _oracle([grads["0.weight"], grads["0.bias"]], 2.0),
    )
    (norm0, said0), (norm1, said1) = report.values("lengths differ")
    assert _close(norm0, largest) and _close(norm1, largest)
    assert len(said0) == 1 and "lists of 2 to 3 items" in said0[0] and said1 == []


def _recorded(rank: int, _world_size: int, arg: tuple[str, str]) -> dict[str, Any]:
    """Five steps of a replicated 2-layer model through the recorder; what goes wrong on rank
    1 only from step 3 (after the statistics' pass agreed with total_norm at steps 1 and 2)."""
    kind, directory = arg
    model = _model()
    listed = {"apart": [5], "spike": [4]}.get(kind, [])
    recorder = gradstat.Recorder(model, directory, spike=None, steps=listed)
    passes = []
    counted = recorder._gradients.norm

    def norm(*args: Any, **kwargs: Any) -> float:
        passes.append(len(recorder.records) + 1)
        return counted(*args, **kwargs)

    recorder._gradients.norm = norm  # type: ignore[method-assign]
    for step in range(1, 6):
        for name, param in model.named_parameters():
            param.grad = _grad_of(name, param.shape) * step
        if step >= 3 and rank == 1:
            grad = model.get_parameter("0.weight").grad
            assert grad is not None
            if kind == "nan":
                grad[1, 1] = math.nan
            elif kind == "spike":
                grad.mul_(1000.0)
        if step == 5 and kind == "apart":
            lacking = "0.weight" if rank == 0 else "1.weight"
            model.get_parameter(lacking).grad = None
        recorder.step(step)
    recorder.wait()
    assert recorder.params is not None
    return {
        "rows": recorder.params.total(),
        "row nan": dict(zip(recorder.params.layout.names, recorder.params.nan, strict=True)),
        "norms": [record.norm for record in recorder.records],
        "triggers": [list(record.triggers) for record in recorder.records],
        "passes": passes,
    }


def _replica_norms(step: int, spiked: bool) -> float:
    model = _model()
    grads = []
    for name, param in model.named_parameters():
        grad = _grad_of(name, param.shape) * step
        grads.append(grad * 1000.0 if spiked and name == "0.weight" else grad)
    return _oracle(grads, 2.0)


def test_a_nan_on_one_replica_is_every_steps_norm_and_fires_nonfinite(two_ranks: Any) -> None:
    _, report = two_ranks
    for found in report.values("nan on rank 1"):
        norms = found["norms"]
        assert all(_close(norms[index], _replica_norms(index + 1, False)) for index in (0, 1))
        assert all(math.isnan(norm) for norm in norms[2:]), norms
        assert found["triggers"][2:] == [["nonfinite"]] * 3, found["triggers"]
        # The rows name the parameter, though they count rank 0's copy.
        assert found["row nan"] == {"0.weight": 1, "0.bias": 0, "1.weight": 0, "1.bias": 0}


def test_a_snapshot_taken_for_a_nan_on_an_uncounted_replica_says_so(two_ranks: Any) -> None:
    """gradstat norm counts data-parallel rank 0's copy, which is finite: it says the NaN is in
    a copy it does not count, exit status 1, where it printed a finite norm with status 0."""
    import json

    from gradstat.recorder import complete_snapshots
    from tests._cli import run_gradstat

    root, _ = two_ranks
    (step, snapshot), *_ = complete_snapshots(root / "nan")
    assert step == 3
    done = run_gradstat("norm", snapshot, "--json")
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert report["nonfinite_not_counted"] is True and report["nonfinite"] == []
    assert report["recorded_norm"] == "nan" and report["recorded_norm_differs"] is False
    assert _close(report["total_norm"], _replica_norms(3, False))
    text = run_gradstat("norm", snapshot)
    assert text.returncode == 1 and "yet every counted copy is finite" in text.stdout


@pytest.mark.parametrize("kind", ["nan", "spike"])
def test_history_from_snapshots_says_where_the_recorders_norm_differs(
    two_ranks: Any, kind: str
) -> None:
    """``history --source snapshots`` of a run whose NaN (spike) was on the replica snapshots
    do not count: calm totals, no NaN, exit status 0. It now says which snapshot's counted
    copies are not what the recorder saw, and exits 1."""
    import json

    from gradstat.recorder import complete_snapshots
    from tests._cli import run_gradstat

    root, _ = two_ranks
    (step, snapshot), *_ = complete_snapshots(root / kind)
    done = run_gradstat("history", root / kind, "--source", "snapshots", "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    (kept,) = [row for row in report["snapshots"] if row["step"] == step]
    assert kept["recorder_differs"] is True
    assert any(
        line.startswith(f"{snapshot}: the recorder's norm of step") for line in report["problems"]
    )
    assert report["warnings"] == report["problems"]


@pytest.mark.parametrize("kind", ["spike", "apart"])
def test_gradstat_norm_of_a_recorded_snapshot_says_where_the_recorders_norm_differs(
    two_ranks: Any, kind: str
) -> None:
    """A snapshot counts data-parallel rank 0's replica, the recorder's norm the largest: the
    spike on rank 1 was in the recorder's norm and not in the snapshot's, which printed a calm
    norm with status 0. Replicas that lack different gradients agree with it (their union)."""
    import json

    from gradstat.recorder import complete_snapshots
    from tests._cli import run_gradstat

    root, report = two_ranks
    (step, snapshot), *_ = complete_snapshots(root / kind)
    recorded = report.values("spike on rank 1" if kind == "spike" else "recorder apart")[0]
    done = run_gradstat("norm", snapshot, "--json")
    found = json.loads(done.stdout)
    assert _close(found["recorded_norm"], recorded["norms"][step - 1])
    if kind == "apart":
        assert done.returncode == 0 and found["recorded_norm_differs"] is False, done.stdout
        assert _close(found["total_norm"], recorded["norms"][step - 1])
        return
    assert done.returncode == 1 and found["recorded_norm_differs"] is True, done.stdout
    assert _close(found["total_norm"], _replica_norms(step, False))
    assert _close(found["recorded_norm"], _replica_norms(step, True))
    text = run_gradstat("norm", snapshot, "--norm-type", "1")
    assert text.returncode == 0, text.stdout  # the recorder took an L2 norm: nothing to compare
    text = run_gradstat("norm", snapshot)
    assert text.returncode == 1 and "flight recorder's norm of this step" in text.stdout


def test_a_spike_on_one_replica_is_the_norm_and_one_pass_serves(two_ranks: Any) -> None:
    """The norm is the largest replica's, as total_norm gives it, while the recorder computes
    it from the statistics' pass alone (total_norm at the first step only)."""
    _, report = two_ranks
    for found in report.values("spike on rank 1"):
        expected = [_replica_norms(step, spiked=step >= 3) for step in range(1, 6)]
        assert all(map(_close, found["norms"], expected)), (found["norms"], expected)
        assert found["passes"] == [1], found["passes"]


def test_the_recorder_counts_the_union_when_replicas_lack_different_gradients(
    two_ranks: Any,
) -> None:
    _, report = two_ranks
    model = _model()
    union = [_grad_of(name, param.shape) * 5 for name, param in model.named_parameters()]
    for found in report.values("recorder apart"):
        assert _close(found["norms"][4], _oracle(union, 2.0)), found["norms"]
        assert _close(found["rows"], _oracle(union, 2.0)), "the rows count the union too"


# --- a snapshot of such a job: gradstat norm counts the first replica holding each gradient --

# tp2 x dp4 (dense: rank = tp + 2 dp), experts ep2 x edp4 over the same ranks (ep = tp).
_TP, _DP = 2, 4
# (tp, dp): the parameters whose gradient that rank lacks.
_SNAPSHOT_LACKING = {
    (0, 0): {"w", "b", "experts.w"},
    (0, 1): {"b"},
    (1, 0): {"w"},
    (1, 1): {"experts.w"},
    (1, 2): {"experts.w"},
}


def _full(name: str, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    values = torch.arange(1, math.prod(shape) + 1, dtype=torch.float32) * (salt + 1) / 3
    values[1] = 0.0
    return values.reshape(shape)


def _snapshot_grads(tp: int) -> dict[str, tuple[torch.Tensor, dict[str, Any]]]:
    """A TP rank's gradients (every data-parallel replica holds the same) and attributes."""
    weight = _full("w", (4, 3), 0).chunk(_TP)[tp]
    return {
        "w": (weight, {"tensor_model_parallel": True, "partition_dim": 0}),
        "b": (_full("b", (3,), 1), {}),
        "experts.w": (_full("experts.w", (2, 2), 2 + tp), {"allreduce": False}),
        "frozen": (_full("frozen", (2,), 9), {}),
    }


def _dump_lacking_replicas(directory: Path) -> None:
    from gradstat.snapshot import save_rank
    from tests._params import param_with

    for rank in range(_TP * _DP):
        tp, dp = rank % _TP, rank // _TP
        lacking = _SNAPSHOT_LACKING.get((tp, dp), set()) | {"frozen"}
        pairs = [
            (name, param_with(None if name in lacking else grad, **attrs))
            for name, (grad, attrs) in _snapshot_grads(tp).items()
        ]
        coords = {"tp": [tp, _TP], "dp": [dp, _DP], "ep": [tp, _TP], "edp": [dp, _DP]}
        save_rank(directory, pairs, rank=rank, world_size=_TP * _DP, coords=coords)


@pytest.mark.parametrize("processes", [None, 3])
def test_a_snapshot_counts_the_first_replica_that_holds_each_gradient(
    tmp_path: Path, processes: int | None
) -> None:
    """Rank 0 lacks three gradients other replicas hold: one process and three under torchrun
    count each once, at the first replica holding it; a gradient no replica holds is none."""
    import json

    from tests._cli import run_gradstat

    _dump_lacking_replicas(tmp_path)
    union = {
        "w": _full("w", (4, 3), 0),
        "b": _full("b", (3,), 1),
        "experts.w": torch.cat([_full("experts.w", (2, 2), 2 + tp) for tp in range(_TP)]),
    }
    norm = run_gradstat("norm", tmp_path, "--json", nproc=processes, timeout=240)
    zeros = run_gradstat("zeros", tmp_path, "--json", nproc=processes, timeout=240)
    assert norm.returncode == 0 and zeros.returncode == 0, norm.stderr + zeros.stderr
    found = json.loads(norm.stdout)
    assert _close(found["total_norm"], _oracle(list(union.values()), 2.0)), found["total_norm"]
    by_name = {row["name"]: row for row in found["params"]}
    assert set(by_name) == set(union), sorted(by_name)
    for name, grad in union.items():
        assert _close(by_name[name]["norm"], _oracle([grad], 2.0)), name
    counted = json.loads(zeros.stdout)
    assert counted["num_zeros"] == sum(int((grad == 0).sum()) for grad in union.values())
    assert counted["num_elements"] == sum(grad.numel() for grad in union.values())


def test_coordinates_that_describe_more_places_than_ranks_are_refused_before_any_write(
    two_ranks: Any,
) -> None:
    root, report = two_ranks
    for said in report.values("tp coords"):
        assert len(said) == 2, said
        assert all("describe 4 places" in line and "has 2 ranks" in line for line in said)
        assert all("\n" not in line for line in said)
    assert not (root / "tp").exists() or not list((root / "tp").glob("rank-*"))


@pytest.mark.parametrize("processes", [None, 3])
@pytest.mark.parametrize("rank_zero", ["lacks it", "lists it not"])
def test_replicas_that_list_different_parameters_are_refused_in_one_line(
    tmp_path: Path, processes: int | None, rank_zero: str
) -> None:
    """dp3: rank 1 lists no ``w`` at all, rank 2 holds it; rank 0 holds no gradient of it, or
    lists it not either. Which copy counts is unknown: one line, exit 2, in one process and
    under torchrun (rank 1 was taken for the holder, or rank 0's missing copy for the counted
    one: norm 1 for sqrt(26))."""
    from gradstat.snapshot import save_rank
    from tests._cli import run_gradstat
    from tests._params import param_with

    for rank in range(3):
        pairs = [("b", param_with(torch.ones(1)))]
        if rank == 2 or (rank == 0 and rank_zero == "lacks it"):
            pairs.append(("w", param_with(torch.tensor([3.0, 4.0]) if rank == 2 else None)))
        save_rank(tmp_path, pairs, rank=rank, world_size=3, coords={"dp": [rank, 3]})
    done = run_gradstat("norm", tmp_path, "--json", nproc=processes, timeout=240)
    assert done.returncode != 0 and done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if line.startswith("gradstat")]
    assert lines and "replicas" in lines[0] and "list different parameters" in lines[0], lines


def test_inspect_describes_a_parameter_by_a_replica_that_holds_its_gradient(
    tmp_path: Path,
) -> None:
    """Rank 0 lacks three gradients other replicas hold: inspect says they have one (counted
    elsewhere), and only the parameter no replica holds has none."""
    import json

    from tests._cli import run_gradstat

    _dump_lacking_replicas(tmp_path)
    done = run_gradstat("inspect", tmp_path, "--json")
    assert done.returncode == 0, done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)["params"]}
    assert {name: row["no_grad"] for name, row in rows.items()} == {
        "w": False,
        "b": False,
        "experts.w": False,
        "frozen": True,
    }
    assert rows["w"]["dtype"] == "float32" and rows["w"]["local_shape"] == [2, 3]


def test_expert_copies_at_the_same_expert_coordinates_are_refused(tmp_path: Path) -> None:
    """dp2 with experts and no edp given: each rank's expert copy sits at edp 0 and would be
    counted twice (sqrt(50) for 5)."""
    from gradstat.snapshot import save_rank
    from tests._cli import run_gradstat
    from tests._params import param_with

    for rank in range(2):
        expert = param_with(torch.tensor([3.0, 4.0]), allreduce=False)
        pairs = [("b", param_with(torch.ones(1))), ("experts.w", expert)]
        save_rank(tmp_path, pairs, rank=rank, world_size=2, coords={"dp": [rank, 2]})
    done = run_gradstat("norm", tmp_path, "--json")
    assert done.returncode == 2 and done.stdout == ""
    assert "same expert coordinates" in done.stderr and "edp" in done.stderr


def test_a_rank_that_refuses_its_gradients_makes_every_rank_raise_and_stay_in_step(
    two_ranks: Any,
) -> None:
    """get_grad_norm_fp32 with an integer gradient on rank 1: rank 1 said so alone and rank 0's
    all-reduce paired with rank 1's next call (40.05 on both, for 5 and then 14.14)."""
    _, report = two_ranks
    (said0, norm0), (said1, norm1) = report.values("refused")
    assert "another rank refused" in said0 and "int64" in said1, (said0, said1)
    expected = repr(math.sqrt(2 * (6.0**2 + 8.0**2)))
    assert norm0 == norm1 == expected, (norm0, norm1)


def test_a_rank_that_refuses_its_gradients_to_count_zeros_makes_every_rank_raise(
    two_ranks: Any,
) -> None:
    """count_zeros_fp32 with an integer gradient, then a meta-device one, on rank 1: rank 1
    raised alone and rank 0 waited in its all-reduce until gloo's timeout (30 minutes by
    default). Both raise at once, and the next call (2 zeros a rank) is in step."""
    _, report = two_ranks
    (*said0, count0), (*said1, count1) = report.values("zeros refused")
    assert len(said0) == len(said1) == 2, (said0, said1)
    assert all("another rank refused" in line and "zero count" in line for line in said0)
    assert "int64" in said1[0] and "meta" in said1[1], said1
    assert count0 == count1 == repr(4.0), (count0, count1)


def test_replicas_that_list_the_same_parameters_in_another_order_are_replicas(
    tmp_path: Path,
) -> None:
    """Refused as "different parameters" before: the names, not their order, are compared."""
    import json

    from gradstat.snapshot import save_rank
    from tests._cli import run_gradstat
    from tests._params import param_with

    weight, bias = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
    for rank in range(2):
        pairs = [("w", param_with(None if rank == 0 else weight)), ("b", param_with(bias))]
        save_rank(tmp_path, pairs[:: 1 if rank == 0 else -1], rank=rank, world_size=2,
                  coords={"dp": [rank, 2]})  # fmt: skip
    done = run_gradstat("norm", tmp_path, "--json")
    assert done.returncode == 0, done.stderr
    assert _close(json.loads(done.stdout)["total_norm"], 13.0)


def test_none_in_the_megatron_api_is_a_parameter_without_a_gradient() -> None:
    """get_grad_norm_fp32 and GradNorm raised AttributeError ('NoneType' ... 'is_meta')."""
    grad = torch.tensor([3.0, 4.0])
    assert gradstat.get_grad_norm_fp32([grad, None]) == 5.0
    assert gradstat.GradNorm([grad, None])() == 5.0


def test_a_nan_or_inf_on_a_replicate_copy_counted_elsewhere_is_every_ranks_norm(
    two_ranks: Any,
) -> None:
    """The copy at coordinate 0 is finite, rank 1's is not: the norm was the finite one's
    (13.93), no trigger fired."""
    _, report = two_ranks
    finite = math.sqrt(3.0**2 + 4.0**2 + 12.0**2 + 5.0**2)
    for found in report.values("replicate copy"):
        for key in ("recorder", "total_norm"):
            first, second, third = found[key]
            assert _close(first, finite) and math.isnan(second) and third == math.inf, key
        assert found["triggers"] == [[], ["nonfinite"], ["nonfinite"]], found["triggers"]


@pytest.mark.parametrize(
    ("case", "directory"), [("expert replicas", "experts"), ("experts beside tp", "experts-tp")]
)
def test_expert_parameters_without_expert_axes_are_laid_out_as_the_others(
    two_ranks: Any, case: str, directory: str
) -> None:
    """Without expert axes, both ranks' experts sat at one expert coordinate: every command
    refused the snapshot, and the per-parameter statistics stopped. A job that names no expert
    axis lays its experts out as its other parameters: replicas over dp, and over tp (not
    split there) duplicates of tensor-parallel rank 0's, counted once."""
    import json

    from gradstat.recorder import complete_snapshots
    from tests._cli import run_gradstat

    root, report = two_ranks
    model = _model()
    grads = [_grad_of(name, param.shape) for name, param in model.named_parameters()]
    expected = _oracle(grads, 2.0)
    assert all(_close(norm, expected) for norm in report.values(case))
    (_, snapshot), *_ = complete_snapshots(root / directory)
    done = run_gradstat("norm", snapshot, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    found = json.loads(done.stdout)
    assert _close(found["total_norm"], expected) and found["recorded_norm_differs"] is False
    assert _close(found["expert_norm"], _oracle(grads[2:], 2.0))
