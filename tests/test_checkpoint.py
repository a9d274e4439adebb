"""PyTorch distributed checkpoints read as snapshots, held to float64 truth (issue 29).

Every checkpoint here is written by the real APIs on 4 gloo CPU ranks, in one launch: FSDP2
(``fully_shard``, uneven shards) with AdamW through ``get_state_dict`` then ``dcp.save``, twice a
step apart; its gradients through ``dcp.save({"grads": ...})`` beside a gradient snapshot of the
same gradients written by the docs' capture recipe; HSDP on a 2 x 2 mesh (DCP keeps one of the
two replicas); TP x FSDP2; and a ``use_collectives=False`` save whose plain tensor every rank
keeps a copy of. Each statistic ``gradstat`` prints is held against float64 statistics of the
full tensors the live job held (``full_tensor()``), each tensor of the kind read once, computed
here with ``math.fsum`` and never with gradstat or ``torch.linalg.vector_norm``. Then torchrun's
split, and bad input at the command line: a pickle that would run code, a kind the checkpoint
lacks, a cut data file.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from gradstat.cli import app
from gradstat.testing import Case, LaunchReport, launch
from tests import _torch_native as native
from tests._cli import recipe, run_gradstat
from tests._oracle import rel_err

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    # dcp.save without a process group saves as a single process, and says so each time.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

REL = 1e-6
LR = 0.05
# The plain tensor of the rank-local save: the same values on every rank.
SHARED = "shared"
# The FSDP2 job's checkpoints after steps 1 and 2, in torchtitan's folder names.
STEP_A, STEP_B = "fsdp2/step-1", "fsdp2/step-2"
# Non-finite values planted in the FSDP2 job's weights, by rank.
PLANTED, PLANTS = "layers.1.attention.wv.weight", {1: math.nan, 3: math.inf}

Tensors = dict[str, torch.Tensor]


# --- The live jobs (run on every rank) ------------------------------------------------------------


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor in float64 (a collective for a DTensor)."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().to(torch.float64).clone()


def _state_truth(model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> dict[str, Tensors]:
    """What a ``{"model": msd, "optimizer": osd}`` save holds, as full float64 tensors: by kind,
    each named by its parameter (every model key, each parameter's two Adam moments), and
    ``all``, every floating-point tensor but the step counters by its checkpoint key."""
    truth: dict[str, Tensors] = {"weight": {}, "exp_avg": {}, "exp_avg_sq": {}, "all": {}}
    for name, value in model_sd.items():
        truth["weight"][native.logical_name(name)] = truth["all"][f"model.{name}"] = _full(value)
    for name, state in optim_sd["state"].items():
        for stat, value in state.items():
            if stat in ("exp_avg", "exp_avg_sq"):
                truth[stat][native.logical_name(name)] = _full(value)
            if value.is_floating_point() and stat != "step":
                truth["all"][f"optimizer.state.{name}.{stat}"] = _full(value)
    return truth


def _save_state(model: torch.nn.Module, optimizer: Any, directory: str) -> dict[str, Tensors]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=directory)
    # Taken now: the state dict's tensors are the live parameters, which the next step changes.
    return _state_truth(model_sd, optim_sd)


def _save_grads(model: torch.nn.Module, root: str, job: str) -> dict[str, Any]:
    """The gradients two ways: ``dcp.save`` of a ``grads`` tree, and the docs' capture recipe;
    their full float64 values, and this rank's unreduced local L2 norm."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    grads = {native.logical_name(name): p.grad for name, p in model.named_parameters()}
    dcp.save({"grads": grads}, checkpoint_id=f"{root}/{job}-grads")
    # The other data format: each rank's chunks as one safetensors blob in its .distcp file.
    writer = FileSystemWriter(
        f"{root}/{job}-grads-safetensors", serialization_format=SerializationFormat.SAFETENSORS
    )
    dcp.save({"grads": grads}, storage_writer=writer)
    exec(recipe("capture"), {"directory": f"{root}/{job}-snapshot", "model": model, "step": 1})
    local = [grad.to_local().double() for grad in grads.values()]
    return {
        "grad": {name: _full(grad) for name, grad in grads.items()},
        "local_l2": math.sqrt(math.fsum(_squares(tensor) for tensor in local)),
    }


def _fsdp2_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """FSDP2 with AdamW: the gradients of step 1 (a DCP dump and a gradient snapshot), the
    state after step 1 (A, and a rank-local copy) and after step 2 (B)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model, _ = native.build("fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    native.loss_of(model).backward()
    truth = _save_grads(model, root, "fsdp2")
    optimizer.step()
    truth["a"] = _save_state(model, optimizer, f"{root}/{STEP_A}")
    # Rank-local metadata; the plain tensor is every rank's (each keeps its copy).
    shared = torch.linspace(-2.0, 3.0, 15).reshape(3, 5)
    dcp.save(
        {"model": get_model_state_dict(model), SHARED: shared},
        checkpoint_id=f"{root}/fsdp2-local",
        use_collectives=False,
    )
    truth["local"] = {**truth["a"]["weight"], SHARED: shared.double()}
    # Rank-local again, each rank's copy of one tensor its own: rank r's is r + 1 throughout.
    dcp.save(
        {"grads": {SHARED: torch.full((3, 5), rank + 1.0)}},
        checkpoint_id=f"{root}/local-apart",
        use_collectives=False,
    )
    optimizer.zero_grad()
    native.loss_of(model).backward()
    optimizer.step()
    truth["b"] = _save_state(model, optimizer, f"{root}/{STEP_B}")
    # Rank 1's shard of one weight gets a NaN, rank 3's an inf, in a model-only save.
    planted = dict(model.named_parameters())[PLANTED].to_local()
    with torch.no_grad():
        if rank in PLANTS:
            planted[0, 0] = PLANTS[rank]
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=f"{root}/fsdp2-nonfinite")
    dist.barrier()
    return truth


def _state_job(rank: int, world_size: int, arg: tuple[str, str]) -> dict[str, Any]:
    """``job`` (native.build's): its gradients saved, then one AdamW step and its model and
    optimizer state saved."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    job, root = arg
    model, _ = native.train_step(job)
    truth = _save_grads(model, root, job)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    optimizer.step()
    truth["state"] = _save_state(model, optimizer, f"{root}/{job}")
    if job == "hsdp":
        # Rank-local metadata: nothing deduplicates the dp_replicate copies when saving, so
        # two data files store each chunk.
        dcp.save(
            {"model": get_model_state_dict(model)},
            checkpoint_id=f"{root}/hsdp-local",
            use_collectives=False,
        )
    dist.barrier()
    return truth


class _Tiny(torch.nn.Module):
    """Rows fewer than the ranks: FSDP2 gives ranks 2 and 3 empty shards of ``narrow``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(native.SEED)
        self.narrow = torch.nn.Linear(5, 2)
        self.wide = torch.nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.wide(torch.tanh(self.narrow(x)))
        return result


def _empty_shards_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """FSDP2 of :class:`_Tiny` after one AdamW step: empty chunks in the data files."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _Tiny()
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model.narrow, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    torch.manual_seed(native.SEED + 2)
    model(torch.randn(4, 5)).square().sum().backward()
    optimizer.step()
    truth = _save_state(model, optimizer, f"{root}/empty-shards")
    truth["local_rows"] = {
        name: int(param.to_local().shape[0]) for name, param in model.named_parameters()
    }
    dist.barrier()
    return truth


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One launch of 4 ranks for every checkpoint; rank 0's truth (every rank's is the same)."""
    root = tmp_path_factory.mktemp("checkpoint")
    cases = [
        Case("fsdp2", _fsdp2_job, str(root)),
        Case("hsdp", _state_job, ("hsdp", str(root))),
        Case("tp_fsdp2", _state_job, ("tp_fsdp2", str(root))),
        Case("empty-shards", _empty_shards_job, str(root)),
    ]
    report: LaunchReport = launch(4, root, cases, timeout_s=300, pg_timeout_s=60)
    assert not report.problems, report.problems
    truth = {case.case_id: report.values(case.case_id)[0] for case in cases}
    truth["empty-shards"]["local_rows"] = [
        value["local_rows"] for value in report.values("empty-shards")
    ]
    return root, truth


# --- The oracle -----------------------------------------------------------------------------------


def _squares(tensor: torch.Tensor) -> float:
    return math.fsum(tensor.square().reshape(-1).tolist())


def _l2(tensors: Tensors) -> float:
    return math.sqrt(math.fsum(_squares(tensor) for tensor in tensors.values()))


def _max_abs(tensors: Tensors) -> float:
    return max(float(tensor.abs().max()) for tensor in tensors.values() if tensor.numel())


def _zeros(tensors: Tensors) -> int:
    return sum(int((tensor == 0).sum()) for tensor in tensors.values())


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.stdout, (result.exit_code, result.stderr)
    return result.exit_code, json.loads(result.stdout)


def _check_norms(directory: Path, tensors: Tensors, *kind: str) -> None:
    """``norm`` (2 and inf, every parameter) and ``zeros`` of ``directory`` against ``tensors``."""
    code, result = _cli("norm", str(directory), *kind, "--top", "1000")
    assert code == 0
    assert rel_err(result["total_norm"], _l2(tensors)) <= REL, (result["total_norm"], _l2(tensors))
    assert result["params_left_out"] == 0
    # Nothing of the kind read is left out unsaid: AdamW's float32 step counters are no
    # tensor of a dtype gradstat does not read (``--kind all`` warned so).
    assert result["warnings"] == []
    assert sorted(row["name"] for row in result["params"]) == sorted(tensors)
    for row in result["params"]:
        expected = math.sqrt(_squares(tensors[row["name"]]))
        if expected == 0:  # a zero-initialised bias or running mean
            assert row["norm"] == 0.0, row
        else:
            assert rel_err(row["norm"], expected) <= REL, (row, expected)
        assert row["num_elements"] == tensors[row["name"]].numel(), row
    code, result = _cli("norm", str(directory), *kind, "--norm-type", "inf")
    assert code == 0 and result["total_norm"] == _max_abs(tensors)
    code, result = _cli("zeros", str(directory), *kind)
    assert code == 0
    assert result["num_zeros"] == _zeros(tensors)
    assert result["num_elements"] == sum(tensor.numel() for tensor in tensors.values())


# --- 1. FSDP2 model and AdamW state ---------------------------------------------------------------


def test_the_fsdp2_checkpoint_has_uneven_shards(jobs: tuple[Path, dict[str, Any]]) -> None:
    """The precondition of the numbers below: 37 vocabulary rows and 22 hidden rows over 4 ranks
    are cut 10 + 10 + 10 + 7 and 6 + 6 + 6 + 4, one chunk per data file."""
    from torch.distributed.checkpoint import FileSystemReader

    root, _ = jobs
    metadata = FileSystemReader(str(root / STEP_A)).read_metadata()
    for key, rows in (
        ("model.tok_embeddings.weight", [10, 10, 10, 7]),
        ("model.layers.0.feed_forward.w1.weight", [6, 6, 6, 4]),
    ):
        chunks = sorted(metadata.state_dict_metadata[key].chunks, key=lambda c: c.offsets[0])
        assert [chunk.sizes[0] for chunk in chunks] == rows
    assert len(list((root / STEP_A).glob("*.distcp"))) == 4


@pytest.mark.parametrize("kind", ["weight", "exp_avg", "exp_avg_sq"])
def test_fsdp2_state_gives_the_full_tensors_numbers(
    kind: str, jobs: tuple[Path, dict[str, Any]]
) -> None:
    root, truth = jobs
    tensors = truth["fsdp2"]["a"][kind]
    # Weights are read by default: the checkpoint has no grads tree.
    options = () if kind == "weight" else ("--kind", kind)
    _check_norms(root / STEP_A, tensors, *options)
    code, result = _cli("norm", str(root / STEP_A), *options)
    assert code == 0 and result["snapshot"]["kind"] == kind
    assert result["snapshot"]["world_size"] == 4 and result["snapshot"]["step"] == 1
    # The tied output layer: get_state_dict keeps both model keys and DCP stores both (each its
    # own bytes), so the weights count it twice; the optimizer holds one state for the pair.
    assert ("output.weight" in tensors) == (kind == "weight")


def test_every_floating_point_tensor_by_its_key(jobs: tuple[Path, dict[str, Any]]) -> None:
    """``--kind all``: weights and moments, each named by its key; AdamW's float32 step
    counters are no statistic's."""
    root, truth = jobs
    tensors = truth["fsdp2"]["a"]["all"]
    assert len(tensors) == 3 * len(truth["fsdp2"]["a"]["exp_avg"]) + 1  # and the tied copy
    _check_norms(root / STEP_A, tensors, "--kind", "all")


def test_empty_shards(jobs: tuple[Path, dict[str, Any]]) -> None:
    root, truth = jobs
    state = truth["empty-shards"]
    assert [rows["narrow.weight"] for rows in state["local_rows"]] == [1, 1, 0, 0]
    for kind in ("weight", "exp_avg", "exp_avg_sq"):
        _check_norms(root / "empty-shards", state[kind], "--kind", kind)


def test_fsdp2_audit_and_inspect(jobs: tuple[Path, dict[str, Any]]) -> None:
    root, truth = jobs
    code, audit = _cli("audit", str(root / STEP_A))
    assert code == 0 and audit["findings"] == [], audit["findings"]
    assert rel_err(audit["total_norm"], _l2(truth["fsdp2"]["a"]["weight"])) <= REL
    code, inspect = _cli("inspect", str(root / STEP_A), "--kind", "exp_avg_sq")
    assert code == 0
    assert sorted(row["name"] for row in inspect["params"]) == sorted(
        truth["fsdp2"]["a"]["exp_avg_sq"]
    )


# --- 2. Gradients through dcp.save ----------------------------------------------------------------


GRAD_JOBS = ("fsdp2", "hsdp", "tp_fsdp2")


@pytest.mark.parametrize("data_format", ["", "-safetensors"])
@pytest.mark.parametrize("job", GRAD_JOBS)
def test_a_grads_dump_gives_the_full_gradients_numbers(
    job: str, data_format: str, jobs: tuple[Path, dict[str, Any]]
) -> None:
    root, truth = jobs
    grads = truth[job]["grad"]
    assert _zeros(grads) == len(native.UNUSED_TOKENS) * native.DIM  # the unused rows
    directory = root / f"{job}-grads{data_format}"
    _check_norms(directory, grads)  # grad, by default
    code, result = _cli("norm", str(directory))
    assert code == 0 and result["snapshot"]["kind"] == "grad"


@pytest.mark.parametrize("job", GRAD_JOBS)
def test_a_grads_dump_and_a_gradient_snapshot_agree_name_by_name(
    job: str, jobs: tuple[Path, dict[str, Any]]
) -> None:
    root, truth = jobs
    grads = truth[job]["grad"]
    code, result = _cli("compare", str(root / f"{job}-grads"), str(root / f"{job}-snapshot"))
    assert result["mismatches"] == [] and code == 0, result["mismatches"]
    assert not result["updates"]
    assert sorted(row["name"] for row in result["params"]) == sorted(grads)
    for row in result["params"]:
        expected = math.sqrt(_squares(grads[row["name"]]))
        assert rel_err(row["norm_a"], expected) <= REL and rel_err(row["norm_b"], expected) <= REL
        assert row["max_abs_diff"] == 0.0, row  # the same bits, rebuilt on both sides


def test_explain_names_a_data_files_local_norm(jobs: tuple[Path, dict[str, Any]]) -> None:
    """A norm logged unreduced on rank 0 of the FSDP2 job is rank 0's data file's."""
    root, truth = jobs
    logged = truth["fsdp2"]["local_l2"]
    assert rel_err(logged, _l2(truth["fsdp2"]["grad"])) > 0.1  # a shard's, not the whole
    code, found = _cli("explain", str(root / "fsdp2-grads"), "--logged", repr(logged))
    assert code == 0 and found["best"] == "rank_0_local", found["rows"][:3]
    assert rel_err(found["rows"][0]["value"], logged) <= REL
    code, found = _cli(
        "explain", str(root / "fsdp2-grads"), "--logged", repr(_l2(truth["fsdp2"]["grad"]))
    )
    assert code == 0 and found["best"] == "exact", found["rows"][:3]


# --- 3. HSDP and 4. TP x FSDP2 --------------------------------------------------------------------


def test_hsdp_replicas_count_once(jobs: tuple[Path, dict[str, Any]]) -> None:
    """DCP keeps one of the two dp_replicate copies: the norm is the full tensor's, not
    sqrt(2) times it."""
    from torch.distributed.checkpoint import FileSystemReader

    root, truth = jobs
    metadata = FileSystemReader(str(root / "hsdp")).read_metadata()
    for fqn, entry in metadata.state_dict_metadata.items():
        if fqn.startswith("model."):  # two dp_shard chunks, each stored once
            stored = [key for key in metadata.storage_data if key.fqn == fqn]
            assert len(entry.chunks) == len(stored) == 2, fqn
    _check_norms(root / "hsdp", truth["hsdp"]["state"]["weight"])
    _check_norms(root / "hsdp", truth["hsdp"]["state"]["exp_avg"], "--kind", "exp_avg")


def test_hsdp_replicas_in_rank_local_files_count_once(jobs: tuple[Path, dict[str, Any]]) -> None:
    """Saved without collectives, both dp_replicate ranks store their chunks: each is read once."""
    root, truth = jobs
    directory = root / "hsdp-local"
    stored: dict[tuple[int, ...], int] = {}
    for path in sorted(directory.glob("__*.metadata")):
        with open(path, "rb") as file:
            metadata = pickle.load(file)  # trusted: this test's own job wrote it
        for key in metadata.storage_data:
            if key.fqn == "model.tok_embeddings.weight":
                stored[tuple(key.offset)] = stored.get(tuple(key.offset), 0) + 1
    assert stored == {(0, 0): 2, (19, 0): 2}  # each chunk in two data files
    _check_norms(directory, truth["hsdp"]["state"]["weight"])


def test_tp_fsdp2_state_gives_the_full_tensors_numbers(jobs: tuple[Path, dict[str, Any]]) -> None:
    root, truth = jobs
    _check_norms(root / "tp_fsdp2", truth["tp_fsdp2"]["state"]["weight"])
    _check_norms(
        root / "tp_fsdp2", truth["tp_fsdp2"]["state"]["exp_avg_sq"], "--kind", "exp_avg_sq"
    )


# --- 5. Two checkpoints a step apart --------------------------------------------------------------


def test_compare_two_checkpoints_a_step_apart(jobs: tuple[Path, dict[str, Any]]) -> None:
    """Between two checkpoints' weights the update is expected: nothing is flagged (every
    weight moved), the rows come largest ``||B - A||`` first, each measured in float64."""
    root, truth = jobs
    before, after = truth["fsdp2"]["a"]["weight"], truth["fsdp2"]["b"]["weight"]
    code, result = _cli("compare", str(root / STEP_A), str(root / STEP_B))
    assert code == 0 and result["updates"] and result["mismatches"] == []
    assert sorted(row["name"] for row in result["params"]) == sorted(before)
    for row in result["params"]:
        name = row["name"]
        assert rel_err(row["norm_a"], math.sqrt(_squares(before[name]))) <= REL, row
        assert rel_err(row["norm_b"], math.sqrt(_squares(after[name]))) <= REL, row
        update = after[name] - before[name]
        expected = float(update.abs().max())
        assert expected > 0 and rel_err(row["max_abs_diff"], expected) <= REL, (row, expected)
        assert rel_err(row["diff_norm"], math.sqrt(_squares(update))) <= REL, row
        assert row["flags"] == [], row
    updates = [row["diff_norm"] for row in result["params"]]
    assert updates == sorted(updates, reverse=True)
    totals = {row["measure"]: row for row in result["totals"]}
    assert rel_err(totals["total_norm"]["a"], _l2(before)) <= REL
    assert rel_err(totals["total_norm"]["b"], _l2(after)) <= REL


@pytest.mark.parametrize("kind", ["weight", "exp_avg_sq"])
@pytest.mark.parametrize("other", ["hsdp", "tp_fsdp2"])
def test_compare_places_every_chunk_across_layouts(
    other: str, kind: str, jobs: tuple[Path, dict[str, Any]]
) -> None:
    """The same model after the same step, saved by FSDP2 and by another layout: element by
    element, each parameter's largest difference and ``||B - A||`` are the full tensors'
    (a chunk placed at the wrong offset would make them as large as the values)."""
    root, truth = jobs
    a, b = truth["fsdp2"]["a"][kind], truth[other]["state"][kind]
    code, result = _cli("compare", str(root / STEP_A), str(root / other), "--kind", kind)
    assert code in (0, 1)  # flags depend on rounding; the numbers do not
    assert sorted(row["name"] for row in result["params"]) == sorted(a) == sorted(b)
    for row in result["params"]:
        difference = b[row["name"]] - a[row["name"]]
        largest, norm = float(difference.abs().max()), math.sqrt(_squares(difference))
        assert float(a[row["name"]].abs().max()) > 1e3 * largest  # rounding apart, no more
        for got, expected in ((row["max_abs_diff"], largest), (row["diff_norm"], norm)):
            assert got == expected if expected == 0 else rel_err(got, expected) <= REL, row


def test_compare_flags_a_checkpoint_against_itself_as_unchanged(
    jobs: tuple[Path, dict[str, Any]],
) -> None:
    """The negative control: the same weights twice are bitwise unchanged, every one flagged."""
    root, truth = jobs
    code, result = _cli("compare", str(root / STEP_A), str(root / STEP_A))
    assert result["updates"]
    assert sorted(result["mismatches"]) == sorted(truth["fsdp2"]["a"]["weight"])
    assert code == 1
    for row in result["params"]:
        assert row["max_abs_diff"] == 0.0 and row["flags"] == ["unchanged"], row


@pytest.mark.parametrize("order", ["snapshot first", "checkpoint first"])
def test_compare_refuses_gradients_against_weights(
    jobs: tuple[Path, dict[str, Any]], order: str
) -> None:
    """A gradient snapshot against a checkpoint's weights (or Adam moments) would flag every
    parameter for differing, which says nothing: one line, exit 2, naming both kinds."""
    root, _ = jobs
    pair = [str(root / "fsdp2-snapshot"), str(root / STEP_A)]
    if order == "checkpoint first":
        pair.reverse()
    line = _one_error_line("compare", *pair)
    assert "model weights" in line and "gradients" in line and pair[1] in line, line
    line = _one_error_line("compare", str(root / STEP_A), str(root / STEP_B), "--kind", "grad")
    assert "--kind" in line, line  # the checkpoint holds no gradients: said as before
    # A checkpoint's gradients (its grads tree) against a gradient snapshot: the same kind.
    code, result = _cli("compare", str(root / "fsdp2-grads"), str(root / "fsdp2-snapshot"))
    assert code == 0 and result["mismatches"] == []


# --- 6. Under torchrun ----------------------------------------------------------------------------


def test_under_torchrun_the_numbers_are_the_same(jobs: tuple[Path, dict[str, Any]]) -> None:
    root, truth = jobs
    command = ["norm", str(root / STEP_A), "--top", "1000", "--json"]
    alone = run_gradstat(*command, timeout=240)
    launched = run_gradstat(*command, nproc=2, timeout=240)
    assert alone.returncode == launched.returncode == 0, launched.stderr[-2000:]
    assert launched.stdout == alone.stdout
    total = json.loads(alone.stdout)["total_norm"]
    assert rel_err(total, _l2(truth["fsdp2"]["a"]["weight"])) <= REL


# --- 7. Bad input at the command line -------------------------------------------------------------


class _RunsACommand:
    """What a crafted ``.metadata`` holds: unpickling it would call ``os.system``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


def _one_error_line(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gradstat: error: "), lines
    return lines[0]


@pytest.mark.parametrize(
    ("checkpoint", "metadata"), [(STEP_A, ".metadata"), ("fsdp2-local", "__2.metadata")]
)
def test_a_metadata_pickle_that_would_run_code_runs_nothing(
    checkpoint: str, metadata: str, jobs: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, _ = jobs
    directory = tmp_path / "crafted"
    shutil.copytree(root / checkpoint, directory)
    marker, control = tmp_path / "MARKER", tmp_path / "CONTROL"
    pickle.loads(pickle.dumps(_RunsACommand(f"touch {control}")))
    assert control.exists()  # the payload is live: a plain unpickler runs it
    (directory / metadata).write_bytes(pickle.dumps(_RunsACommand(f"touch {marker}")))
    line = _one_error_line("norm", str(directory))
    assert str(directory / metadata) in line, line
    assert not marker.exists()


def test_a_kind_the_checkpoint_lacks_names_what_it_holds(
    jobs: tuple[Path, dict[str, Any]],
) -> None:
    root, _ = jobs
    line = _one_error_line("norm", str(root / STEP_A), "--kind", "grad")
    assert str(root / STEP_A) in line and "no gradients" in line
    for held in ("model weights", "exp_avg", "exp_avg_sq"):
        assert held in line, line


def test_a_cut_data_file_is_named(jobs: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    root, _ = jobs
    directory = tmp_path / "cut"
    shutil.copytree(root / STEP_A, directory)
    cut = directory / "__2_0.distcp"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    line = _one_error_line("norm", str(directory))
    assert "__2_0.distcp" in line, line


# --- Non-finite values ----------------------------------------------------------------------------


def test_nonfinite_weights_are_named_with_the_rank_that_saved_them(
    jobs: tuple[Path, dict[str, Any]],
) -> None:
    root, _ = jobs
    directory = str(root / "fsdp2-nonfinite")
    code, result = _cli("norm", directory)
    assert code == 1 and result["total_norm"] == "nan"  # JSON's spelling of NaN
    found = sorted(
        (row["rank"], row["name"], row["nan"], row["inf"]) for row in result["nonfinite"]
    )
    assert found == [(1, PLANTED, 1, 0), (3, PLANTED, 0, 1)]
    code, audit = _cli("audit", directory)
    assert code == 1
    (finding,) = audit["findings"]
    assert finding["kind"] == "nonfinite" and finding["name"] == PLANTED, finding
    assert sorted(finding["ranks"]) == [1, 3], finding


# --- 8. A rank-local save of a tensor every rank holds --------------------------------------------


def test_a_rank_local_copy_on_every_rank_counts_once(jobs: tuple[Path, dict[str, Any]]) -> None:
    root, truth = jobs
    directory = root / "fsdp2-local"
    assert not (directory / ".metadata").exists()
    copies = []
    for path in sorted(directory.glob("__*.metadata")):
        with open(path, "rb") as file:
            metadata = pickle.load(file)  # trusted: this test's own job wrote it
        copies += [
            info.relative_path for key, info in metadata.storage_data.items() if key.fqn == SHARED
        ]
    assert copies == [f"__{rank}_0.distcp" for rank in range(4)]  # each rank stored its copy
    tensors = truth["fsdp2"]["local"]
    _check_norms(directory, tensors)
    # Against four copies, the norm would be sqrt(4 - 1) x the shared tensor's square sum more.
    assert _squares(tensors[SHARED]) > 0
    code, audit = _cli("audit", str(directory))
    assert code == 0 and audit["findings"] == [], audit["findings"]  # the copies were compared


def test_rank_local_copies_that_differ_are_an_audit_finding(
    jobs: tuple[Path, dict[str, Any]],
) -> None:
    """The first copy is the one read; audit said "no findings: every copy ... agrees" without
    comparing the others."""
    root, _ = jobs
    directory = str(root / "local-apart")
    code, result = _cli("norm", directory)
    assert code == 0 and rel_err(result["total_norm"], math.sqrt(15.0)) <= REL  # rank 0's: 1s
    code, audit = _cli("audit", directory)
    assert code == 1
    (finding,) = audit["findings"]
    assert finding["kind"] == "stored_copies_differ" and finding["name"] == SHARED, finding
    assert finding["max_abs_diff"] == 3.0  # rank 3's 4 against rank 0's 1
    for rank in (1, 2, 3):
        assert f"__{rank}_0.distcp" in finding["detail"], finding
    # Counting rank 3's copy instead: 15 elements of 4 against 15 of 1.
    assert rel_err(finding["norm_if_miscounted"], math.sqrt(15 * 16.0)) <= REL, finding


# --- Buffers that are not floating point ---------------------------------------------------------


class _WithBuffers(torch.nn.Module):
    """Model buffers that are no float: BatchNorm's int64 ``num_batches_tracked`` and a
    persistent complex64 RoPE table (torchtitan's Llama registers ``freqs_cis`` so)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(native.SEED)
        self.linear = torch.nn.Linear(4, 3)
        self.batch_norm = torch.nn.BatchNorm1d(3)
        angles = torch.outer(torch.arange(4.0), torch.tensor([1.0, 0.1]))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.batch_norm(self.linear(x))
        return result


def test_a_model_with_integer_and_complex_buffers(tmp_path: Path) -> None:
    """A model's state holds buffers besides its weights; those that are no floating-point
    tensor hold no statistic (as ``--kind all`` leaves them out) and must not stop the
    floating-point ones from being read (``inspect`` names them as not read)."""
    import torch.distributed.checkpoint as dcp

    model = _WithBuffers()
    model(torch.randn(5, 4)).sum().backward()
    state = model.state_dict()
    assert {state["batch_norm.num_batches_tracked"].dtype, state["freqs_cis"].dtype} == {
        torch.int64,
        torch.complex64,
    }
    dcp.save({"model": state}, checkpoint_id=tmp_path / "ckpt")
    floating = {name: value.double() for name, value in state.items() if value.is_floating_point()}
    _check_norms(tmp_path / "ckpt", floating)
    code, report = _cli("inspect", str(tmp_path / "ckpt"))
    assert code == 0 and "2 tensors of that kind not read" in report["notes"][1], report["notes"]
    assert "model.batch_norm.num_batches_tracked" in report["notes"][1]
