"""Megatron ``torch_dist`` checkpoints written by megatron-core itself, read by
gradstat.snapshot.torch_dist: the stacked layers split per layer, the optimizer's two forms.

Once per module, a real Megatron job on 4 gloo CPU ranks (GPTModel, 4 layers, TP2 x PP2, its
DDP and distributed optimizer, one Adam step) saves ``dist_checkpointing.save`` checkpoints of
the model and the optimizer, in the ``dp_reshardable`` and the ``fully_reshardable`` form. Every
parameter first gets values drawn from a seed of its global name, so that no two layers are
alike; each rank brings back its ``param.data`` as saved, and the test process gathers the full
tensors over TP itself. The checkpoint's stacked tensors, read chunk by chunk and split on their
layer axis, must equal those tensors bitwise, layer by global layer.

megatron-core 0.16.1 saves on the CPU but for spots that name CUDA or need psutil:
``FileSystemWriterAsync.preload_tensors`` calls ``torch.cuda.synchronize()``,
``save_state_dict_async_finalize`` allocates on ``torch.cuda.current_device()``, the
fully_reshardable gather calls ``Tensor.cuda()``, and the writer measures memory with psutil.
:func:`_saving_on_cpu` makes those no-ops inside the spawned rank processes only (each a fresh
process, nothing outside changes). The writer's results queue, a ``multiprocessing.Manager``
server that the launcher's ``os._exit`` would leave running, is replaced by an in-process queue
(the save runs synchronously in the rank).
"""

from __future__ import annotations

import importlib.util
import json
import math
import queue
import re
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from gradstat.errors import SnapshotError
from gradstat.snapshot.checkpoint import classify_key
from gradstat.snapshot.dcp import ChunkRef, StorageRef, TensorEntry, open_index, read_chunk
from gradstat.snapshot.torch_dist import (
    expert_rows,
    is_torch_dist,
    layer_rows,
    optimizer_key,
    refuse_dp_reshardable,
)
from gradstat.testing import Case, launch
from tests._megatron import GptSize, megatron_gpt_job

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning"),
]

LAYERS, TP, PP, EP = 4, 2, 2, 2
SIZE = GptSize(LAYERS, 32, 4, 64, 64, 16, 4, 16, 3000)
ITERATION = 10
FORMS = ("dp_reshardable", "fully_reshardable")
OUTPUT_COPY = "output_layer.weight"  # the last stage's tied copy of the embedding: not saved
# The local layer spec's layernorm modules, under the names torch_dist stores them (TE's).
_CHECKPOINT_NAMES = (
    (".input_layernorm.", ".self_attention.linear_qkv.layer_norm_"),
    (".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_"),
)


# --- the Megatron job ---------------------------------------------------------------------------


def _saving_on_cpu() -> None:
    """megatron-core's dist_checkpointing save path on a CPU-only rank process (see above)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from tests._megatron import _use_cpu_clip_grads, megatron_clip_grads, point_megatron_at_cpu

    if point_megatron_at_cpu():
        _use_cpu_clip_grads(megatron_clip_grads())
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
        torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    if not filesystem_async.HAVE_PSUTIL:
        filesystem_async._process_memory = lambda: 0
    filesystem_async._results_queue = queue.Queue()


def _global_name(local: str, stage: int) -> str:
    return re.sub(
        r"^decoder\.layers\.(\d+)\.",
        lambda m: f"decoder.layers.{int(m[1]) + stage * LAYERS // PP}.",
        local,
    )


def _seeded(name: str, shape: list[int]) -> Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(torch.float32)


def _save_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """One rank: the job built, its parameters set from their global names, one step taken,
    checkpoints saved in both optimizer forms; returns the rank's parameters as saved."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=TP,
        pipeline_model_parallel_size=PP,
        create_gloo_process_groups=False,
    )
    try:
        _saving_on_cpu()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optimizer = megatron_gpt_job(
                SIZE,
                moe=False,
                distributed_optimizer=True,
                tensor_model_parallel_size=TP,
                pipeline_model_parallel_size=PP,
            )
        stage = ps.get_pipeline_model_parallel_rank()
        tp_rank = ps.get_tensor_model_parallel_rank()
        chunk = model[0].module
        for local, param in chunk.named_parameters():
            name = _global_name(local, stage)
            shape = list(param.shape)
            split = getattr(param, "tensor_model_parallel", False)
            if split:
                shape[param.partition_dim] *= TP
            for target, seed in ((param.data, name), (param.main_grad, f"{name}/grad")):
                full = _seeded(seed, shape)
                target.copy_(full.chunk(TP, param.partition_dim)[tp_rank] if split else full)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer.step()
        saved = {
            _global_name(local, stage): (
                param.data.clone(),
                param.partition_dim if getattr(param, "tensor_model_parallel", False) else None,
            )
            for local, param in chunk.named_parameters()
        }
        for form in FORMS:
            directory = Path(root) / form / f"iter_{ITERATION:07d}"
            if rank == 0:
                directory.mkdir(parents=True)
            dist.barrier()
            model_state = chunk.sharded_state_dict()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                optimizer_state = optimizer.sharded_state_dict(
                    model_state, metadata={"distrib_optim_sharding_type": form}
                )
                dist_checkpointing.save(
                    {"model": model_state, "optimizer": optimizer_state, "iteration": ITERATION},
                    str(directory),
                )
        return {"tp": tp_rank, "pp": stage, "params": saved}
    finally:
        ps.destroy_model_parallel()


def _moe_job(rank: int, world_size: int, root: str) -> dict[str, Tensor]:
    """One rank of an MoE job (EP2 x PP2, four experts): parameters set from their global names
    (layers and experts numbered globally), the model saved; returns its parameters as saved."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        pipeline_model_parallel_size=PP,
        expert_model_parallel_size=EP,
        expert_tensor_parallel_size=1,
        create_gloo_process_groups=False,
    )
    try:
        _saving_on_cpu()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, _ = megatron_gpt_job(
                SIZE,
                moe=True,
                distributed_optimizer=False,
                pipeline_model_parallel_size=PP,
                expert_model_parallel_size=EP,
            )
        stage, ep_rank = ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
        chunk = model[0].module
        saved = {}
        for local, param in chunk.named_parameters():
            name = re.sub(
                r"\.local_experts\.(\d+)\.",
                lambda m: f".local_experts.{int(m[1]) + ep_rank * SIZE.experts // EP}.",
                _global_name(local, stage),
            )
            param.data.copy_(_seeded(name, list(param.shape)))
            saved[name] = param.data.clone()
        directory = Path(root) / "moe" / f"iter_{ITERATION:07d}"
        if rank == 0:
            directory.mkdir(parents=True)
        torch.distributed.barrier()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist_checkpointing.save({"model": chunk.sharded_state_dict()}, str(directory))
        return saved
    finally:
        ps.destroy_model_parallel()


def _stored_name(name: str) -> str:
    for local_name, stored_name in _CHECKPOINT_NAMES:
        name = name.replace(local_name, stored_name)
    return name


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """Both Megatron jobs, one after the other in the same 4 rank processes."""
    root = tmp_path_factory.mktemp("torch_dist")
    run_dir = root / "run"
    run_dir.mkdir()
    cases = [Case("save", _save_job, str(root)), Case("moe", _moe_job, str(root))]
    return root, launch(TP * PP, run_dir, cases, timeout_s=600)


@pytest.fixture(scope="module")
def job(launched: tuple[Path, Any]) -> tuple[Path, dict[str, Tensor]]:
    """The checkpoints' root, and every saved parameter's full tensor under the name the
    checkpoint gives it (layers numbered globally), gathered over TP here."""
    root, report = launched
    shards: dict[str, dict[int, tuple[Tensor, int | None]]] = {}
    for result in report.values("save"):
        for name, (tensor, dim) in result["params"].items():
            shards.setdefault(name, {})[result["tp"]] = (tensor, dim)
    truth = {}
    for name, by_tp in shards.items():
        assert sorted(by_tp) == list(range(TP)), name
        dims = {dim for _, dim in by_tp.values()}
        assert len(dims) == 1, name
        (dim,) = dims
        if dim is None:
            for tensor, _ in by_tp.values():  # replicated over TP: every copy the same
                assert torch.equal(tensor, by_tp[0][0]), name
            full = by_tp[0][0]
        else:
            full = torch.cat([by_tp[tp][0] for tp in range(TP)], dim=dim)
        truth[_stored_name(name)] = full
    return root, truth


@pytest.fixture(scope="module")
def moe(launched: tuple[Path, Any]) -> tuple[Path, dict[str, Tensor]]:
    """The MoE checkpoint, and every parameter under its stored name (dense ones replicated
    over the data-parallel ranks, experts each on one expert-parallel rank)."""
    root, report = launched
    truth: dict[str, Tensor] = {}
    for result in report.values("moe"):
        for name, tensor in result.items():
            name = _stored_name(name)
            if name in truth:
                assert ".local_experts." not in name and torch.equal(truth[name], tensor), name
            truth[name] = tensor
    return root / "moe" / f"iter_{ITERATION:07d}", truth


def _directory(root: Path, form: str) -> Path:
    return root / form / f"iter_{ITERATION:07d}"


def _assembled(directory: Path, entry: TensorEntry) -> Tensor:
    full = torch.full(entry.size, float("nan"), dtype=entry.dtype)
    for chunk in entry.chunks:
        full[chunk.slices] = read_chunk(directory, chunk)
    return full


def _per_layer(directory: Path, fqns: list[str]) -> dict[str, Tensor]:
    """The tensors of ``fqns`` as records: stacked ones split into their layer rows."""
    records: dict[str, Tensor] = {}
    index = open_index(directory)
    for fqn in fqns:
        entry = index.tensors[fqn]
        rows = layer_rows(entry)
        full = _assembled(directory, entry)
        if rows is None:
            records[fqn] = full
            continue
        for name, layer in rows:
            records[name] = full[layer]
    return records


# --- the tests ----------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("form", FORMS)
def test_stacked_layers_split_into_the_models_per_layer_parameters(
    job: tuple[Path, dict[str, Tensor]], form: str
) -> None:
    root, truth = job
    directory = _directory(root, form)
    assert is_torch_dist(directory)
    index = open_index(directory)
    model_keys = [fqn for fqn in index.tensors if classify_key(fqn).kind == "weight"]
    stacked = [fqn for fqn in model_keys if layer_rows(index.tensors[fqn]) is not None]
    # Every decoder-layer parameter is stored stacked, nothing else is.
    assert stacked and all(fqn.startswith("decoder.layers.") for fqn in stacked)
    assert all(index.tensors[fqn].size[0] == LAYERS for fqn in stacked)
    assert {fqn for fqn in model_keys if re.match(r"decoder\.layers\.", fqn)} == set(stacked)
    records = _per_layer(directory, model_keys)
    assert set(records) == set(truth) - {OUTPUT_COPY}
    for name, tensor in records.items():
        assert torch.equal(tensor, truth[name]), name
    # The numbering is global across stages: the layers of stage 1 were written by its ranks.
    for fqn in stacked:
        for chunk in index.tensors[fqn].chunks:
            writer = int(re.match(r"__(\d+)_", chunk.storage.relative_path)[1])  # type: ignore[index]
            assert (writer // TP == 1) == (chunk.offsets[0] >= LAYERS // PP), (fqn, chunk)
    # No two layers alike, so a wrong numbering could not pass unseen.
    rows = [tensor for name, tensor in truth.items() if name.startswith("decoder.layers.")]
    assert len({tensor.sum().item() for tensor in rows}) == len(rows)


@pytest.mark.multiprocess
def test_moe_experts_split_per_layer_and_global_expert(moe: tuple[Path, dict[str, Tensor]]) -> None:
    directory, truth = moe
    index = open_index(directory)
    records: dict[str, Tensor] = {}
    for fqn, entry in index.tensors.items():
        full = _assembled(directory, entry)
        experts, layers = expert_rows(entry), layer_rows(entry)
        if experts is not None:
            assert entry.size[:2] == (LAYERS, SIZE.experts), fqn
            records |= {name: full[layer, expert] for name, layer, expert in experts}
        elif layers is not None:
            records |= {name: full[layer] for name, layer in layers}
        else:
            records[fqn] = full
    assert any(".local_experts.3." in name for name in records)
    assert set(records) == set(truth) - {OUTPUT_COPY}
    for name, tensor in records.items():
        assert torch.equal(tensor, truth[name]), name
    rows = [tensor for name, tensor in truth.items() if ".local_experts." in name]
    assert len({tensor.sum().item() for tensor in rows}) == len(rows) == LAYERS * SIZE.experts * 4


@pytest.mark.multiprocess
def test_dp_reshardable_refused_in_one_line(job: tuple[Path, dict[str, Tensor]]) -> None:
    root, _ = job
    directory = _directory(root, "dp_reshardable")
    index = open_index(directory)
    buckets = [fqn for fqn in index.tensors if fqn.startswith("optimizer.distributed.")]
    assert buckets and all(len(index.tensors[fqn].size) == 1 for fqn in buckets)
    for fqn in buckets:  # neither a layer stack nor a parameter's state
        assert layer_rows(index.tensors[fqn]) is None and optimizer_key(fqn) is None
        assert classify_key(fqn).kind == "other" and classify_key(fqn).param is None
    with pytest.raises(SnapshotError) as refused:
        refuse_dp_reshardable(index)
    message = str(refused.value)
    assert "\n" not in message and str(directory) in message
    assert "'optimizer.distributed." in message and "uninitialised memory" in message
    assert "fully_reshardable" in message


@pytest.mark.multiprocess
def test_fully_reshardable_read_per_parameter(job: tuple[Path, dict[str, Tensor]]) -> None:
    root, truth = job
    directory = _directory(root, "fully_reshardable")
    index = open_index(directory)
    refuse_dp_reshardable(index)  # nothing to refuse
    model_keys = {fqn for fqn in index.tensors if classify_key(fqn).kind == "weight"}
    states: dict[str, set[str]] = {}
    for fqn, entry in index.tensors.items():
        key = optimizer_key(fqn)
        if key is None:
            assert fqn in model_keys, fqn
            continue
        kind, model_key = key
        assert model_key in model_keys and entry.size == index.tensors[model_key].size, fqn
        states.setdefault(fqn.split(".")[2], set()).add(model_key)
        if kind != "other":
            assert classify_key(fqn).kind == kind and classify_key(fqn).param == model_key
    assert states == {stat: model_keys for stat in ("param", "exp_avg", "exp_avg_sq")}
    # Rows of the optimizer's keys are named as the model's rows are, behind the same head;
    # the fp32 master copies (fp32 training) equal the model's weights.
    masters = [fqn for fqn in index.tensors if fqn.startswith("optimizer.state.param.")]
    records = _per_layer(directory, masters)
    expected = {f"optimizer.state.param.{name}" for name in set(truth) - {OUTPUT_COPY}}
    assert set(records) == expected
    for name, tensor in records.items():
        assert optimizer_key(name) == ("other", name.removeprefix("optimizer.state.param."))
        assert torch.equal(tensor, truth[name.removeprefix("optimizer.state.param.")]), name
    for fqn in index.tensors:
        rows = layer_rows(index.tensors[fqn])
        if rows is not None and fqn.startswith("optimizer.state.exp_avg."):
            for name, layer in rows:
                assert classify_key(name).kind == "exp_avg"
                assert classify_key(name).param == fqn.removeprefix(
                    "optimizer.state.exp_avg."
                ).replace("decoder.layers.", f"decoder.layers.{layer}.", 1)


# --- the commands on them ----------------------------------------------------------------------


def _l2(tensor: Tensor) -> float:
    return math.sqrt(math.fsum(tensor.double().reshape(-1).square().tolist()))


def _cli(*args: Any) -> tuple[int, dict[str, Any]]:
    from typer.testing import CliRunner

    from gradstat.cli import app

    result = CliRunner().invoke(app, [*map(str, args), "--json"])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.multiprocess
@pytest.mark.parametrize("form", FORMS)
def test_norm_reads_the_weights_per_layer(job: tuple[Path, dict[str, Tensor]], form: str) -> None:
    """``gradstat norm`` of a torch_dist checkpoint: a row per layer parameter (layers numbered
    globally), each against float64 of the live job's full tensor, in either optimizer form."""
    root, truth = job
    code, report = _cli("norm", _directory(root, form), "--top", "1000")
    assert code == 0 and report["snapshot"]["kind"] == "weight"
    assert report["snapshot"]["source"] == "dcp" and report["snapshot"]["step"] == ITERATION
    expected = {name: tensor for name, tensor in truth.items() if name != OUTPUT_COPY}
    rows = {row["name"]: row["norm"] for row in report["params"]}
    assert set(rows) == set(expected) and f"decoder.layers.{LAYERS - 1}." in " ".join(rows)
    for name, tensor in expected.items():
        assert math.isclose(rows[name], _l2(tensor), rel_tol=1e-12), name
    total = math.sqrt(math.fsum(_l2(tensor) ** 2 for tensor in expected.values()))
    assert math.isclose(report["total_norm"], total, rel_tol=1e-12)


@pytest.mark.multiprocess
def test_the_optimizers_moments_per_layer_or_refused(job: tuple[Path, dict[str, Tensor]]) -> None:
    """fully_reshardable: each moment per layer parameter, against float64 of the stored rows
    assembled here; dp_reshardable: one line with the reason, while its weights still read."""
    root, truth = job
    directory = _directory(root, "fully_reshardable")
    index = open_index(directory)
    for stat in ("exp_avg", "exp_avg_sq"):
        keys = [fqn for fqn in index.tensors if fqn.startswith(f"optimizer.state.{stat}.")]
        stored = {
            name.removeprefix(f"optimizer.state.{stat}."): tensor
            for name, tensor in _per_layer(directory, keys).items()
        }
        assert set(stored) == set(truth) - {OUTPUT_COPY}
        code, report = _cli("norm", directory, "--kind", stat, "--top", "1000")
        assert code == 0 and report["snapshot"]["kind"] == stat
        rows = {row["name"]: row["norm"] for row in report["params"]}
        assert set(rows) == set(stored)
        for name, tensor in stored.items():
            assert math.isclose(rows[name], _l2(tensor), rel_tol=1e-12), (stat, name)
    from typer.testing import CliRunner

    from gradstat.cli import app

    refused = _directory(root, "dp_reshardable")
    result = CliRunner().invoke(app, ["norm", str(refused), "--kind", "exp_avg"])
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert str(refused) in line and "uninitialised memory" in line


@pytest.mark.multiprocess
def test_moe_experts_read_one_by_one(moe: tuple[Path, dict[str, Tensor]]) -> None:
    """The stacked experts read as each expert's parameters (numbered globally): their norms,
    and ``--by expert`` rows, against float64 of the live experts."""
    directory, truth = moe
    code, report = _cli("norm", directory, "--top", "1000", "--by", "expert")
    assert code == 0
    rows = {row["name"]: row["norm"] for row in report["params"]}
    expected = {name: tensor for name, tensor in truth.items() if name != OUTPUT_COPY}
    assert set(rows) == set(expected)
    for name, tensor in expected.items():
        assert math.isclose(rows[name], _l2(tensor), rel_tol=1e-12), name
    experts: dict[str, list[Tensor]] = {}
    for name, tensor in expected.items():
        match = re.match(r"^(.*\.experts)\.local_experts\.(\d+)\.", name)
        if match:
            experts.setdefault(f"{match[1]}[{match[2]}]", []).append(tensor)
    by_expert = {row["name"]: row["norm"] for row in report["by_expert"]}
    assert len(experts) == LAYERS * SIZE.experts
    for label, tensors in experts.items():
        expected_norm = math.sqrt(math.fsum(_l2(tensor) ** 2 for tensor in tensors))
        assert math.isclose(by_expert[label], expected_norm, rel_tol=1e-12), label


def test_metadata_json_decides_torch_dist(tmp_path: Path) -> None:
    assert not is_torch_dist(tmp_path)  # no metadata.json: a plain DCP directory
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    assert not is_torch_dist(tmp_path)
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    assert is_torch_dist(tmp_path)
    for broken in ("{not json", "[1, 2]"):
        (tmp_path / "metadata.json").write_text(broken)
        with pytest.raises(SnapshotError, match=r"metadata\.json: .*sharded_backend") as refused:
            is_torch_dist(tmp_path)
        assert "\n" not in str(refused.value)


def _entry(fqn: str, size: tuple[int, ...], chunk_rows: list[tuple[int, int]]) -> TensorEntry:
    chunks = tuple(
        ChunkRef(fqn, (start, 0), (rows, size[1]), torch.float32, StorageRef("__0_0.distcp", 0, 1))
        for start, rows in chunk_rows
    )
    return TensorEntry(fqn, size, torch.float32, chunks)


def test_layer_rows_recognises_stacks_by_key_and_chunks() -> None:
    stacked = _entry("decoder.layers.mlp.linear_fc2.bias", (3, 8), [(0, 1), (1, 1), (2, 1)])
    assert layer_rows(stacked) == [(f"decoder.layers.{i}.mlp.linear_fc2.bias", i) for i in range(3)]
    moment = _entry("optimizer.state.exp_avg_sq.decoder.layers.x.w", (2, 4), [(0, 1), (1, 1)])
    assert layer_rows(moment) == [
        ("optimizer.state.exp_avg_sq.decoder.layers.0.x.w", 0),
        ("optimizer.state.exp_avg_sq.decoder.layers.1.x.w", 1),
    ]
    for not_stacked in ("decoder.layers.3.mlp.linear_fc2.bias", "decoder.final_layernorm.weight"):
        assert layer_rows(_entry(not_stacked, (3, 8), [(0, 3)])) is None
    fqn = "decoder.layers.mlp.experts.experts.fc.bias"
    storage = StorageRef("__0_0.distcp", 0, 1)
    one_each = [
        ChunkRef(fqn, (i, e), (1, 1), torch.float32, storage) for i in (0, 1) for e in (0, 1, 2)
    ]
    experts = TensorEntry(fqn, (2, 3), torch.float32, tuple(one_each))
    assert expert_rows(experts) == [
        (f"decoder.layers.{i}.mlp.experts.local_experts.{e}.fc.bias", i, e)
        for i in range(2)
        for e in range(3)
    ]
    assert expert_rows(stacked) is None and expert_rows(moment) is None
    with pytest.raises(SnapshotError, match="spans 3 experts"):
        expert_rows(_entry(fqn, (2, 3), [(0, 1), (1, 1)]))
    with pytest.raises(SnapshotError, match="spans 2 layers") as refused:
        layer_rows(_entry("decoder.layers.mlp.linear_fc2.bias", (3, 8), [(0, 2), (2, 1)]))
    assert "'decoder.layers.mlp.linear_fc2.bias'" in str(refused.value)
