"""gradstat.snapshot.dcp on checkpoints written by torch.distributed.checkpoint itself.

Every checkpoint here is saved by the real APIs (``dcp.save`` in one process without a process
group, ``get_state_dict`` for AdamW, a ``grads`` dump in both data formats, and 2 gloo ranks of
FSDP2 with uneven shards, collective and rank-local). Each tensor reassembled from its chunks
must equal the original, every element written once; then edited copies of the metadata
(loaded and re-pickled by the trusted test), cut data files and crafted pickles must be refused
in one line naming the file and the entry, and a crafted pickle must run nothing.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import gradstat.snapshot.dcp as dcp_module
import gradstat.snapshot.dcp_pickle as dcp_pickle
from gradstat.errors import SnapshotError
from gradstat.snapshot.checkpoint import KeyKind, classify_key
from gradstat.snapshot.dcp import (
    DcpIndex,
    is_dcp_directory,
    iter_chunks,
    load_metadata,
    open_index,
    read_chunk,
)
from gradstat.testing import Case, LaunchReport, launch

# dcp.save without a process group saves as a single process, and says so each time.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

# --- Helpers --------------------------------------------------------------------------------


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model after one AdamW step, so moments and gradients are non-zero."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(6, 4)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists as dcp.save names their leaves (keys joined by dots)."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list) and any(isinstance(v, (dict, list, torch.Tensor)) for v in tree):
        items = enumerate(tree)  # a list of plain values is one leaf, as dcp.save keeps it
    else:
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in items:
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _reassemble(index: DcpIndex) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint rebuilt from its chunks, each element written once."""
    full = {fqn: torch.zeros(entry.size, dtype=entry.dtype) for fqn, entry in index.tensors.items()}
    written = {
        fqn: torch.zeros(entry.size, dtype=torch.int64) for fqn, entry in index.tensors.items()
    }
    for fqn, chunk, tensor in iter_chunks(index):
        place = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
        full[fqn][place] = tensor
        written[fqn][place] += 1
    for fqn, counts in written.items():
        assert bool((counts == 1).all()), f"{fqn}: elements written {counts.unique().tolist()}"
    return full


def _rewrite_metadata(path: Path, edit: Callable[[Any], None]) -> None:
    """Load a metadata file the test itself wrote (trusted), edit it, pickle it again."""
    with open(path, "rb") as file:
        metadata = pickle.load(file)
    edit(metadata)
    with open(path, "wb") as file:
        pickle.dump(metadata, file)


def _storage_key(metadata: Any, fqn: str, offsets: tuple[int, ...]) -> Any:
    return next(
        key
        for key in metadata.storage_data
        if key.fqn == fqn and key.offset is not None and tuple(key.offset) == offsets
    )


def _refusal(directory: Path) -> str:
    with pytest.raises(SnapshotError) as caught:
        open_index(directory)
    message = str(caught.value)
    assert "\n" not in message
    return message


# --- One process: model + AdamW, a grads dump -----------------------------------------------


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A checkpoint of a model and its AdamW state through get_state_dict, without a process
    group (dcp.save then runs as a single process), with the flattened originals."""
    directory = tmp_path_factory.mktemp("plain") / "step-1"
    model, optimizer = _trained()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd, "extra": {"note": "hi", "seen": 3}}
    dcp.save(state, checkpoint_id=directory)
    return directory, _flatten(state)


def test_plain_save_reassembles_to_the_originals(plain: tuple[Path, dict[str, Any]]) -> None:
    directory, originals = plain
    index = open_index(directory)
    tensors = {fqn: value for fqn, value in originals.items() if isinstance(value, torch.Tensor)}
    assert set(index.tensors) == set(tensors)
    assert set(index.bytes_entries) == set(originals) - set(tensors)
    assert "optimizer.param_groups.0.lr" in index.bytes_entries
    assert [path.name for path in index.metadata_files] == [".metadata"]
    full = _reassemble(index)
    for fqn, original in tensors.items():
        entry = index.tensors[fqn]
        assert entry.size == tuple(original.shape) and entry.dtype == original.dtype
        assert torch.equal(full[fqn], original), fqn
    assert any(fqn.endswith(".exp_avg_sq") for fqn in full)
    assert float(full["optimizer.state.0.weight.exp_avg"].abs().sum()) > 0


def test_reading_opens_each_file_once_in_offset_order(
    plain: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, originals = plain
    index = open_index(directory)
    opened: list[str] = []
    real_open = dcp_module.open_regular

    def counting_open(path: Path) -> int:
        opened.append(Path(path).name)
        return real_open(path)

    monkeypatch.setattr(dcp_module, "open_regular", counting_open)
    seen = [
        (chunk.storage.relative_path, chunk.storage.offset) for _, chunk, _ in iter_chunks(index)
    ]
    assert len(seen) == len(index.tensors) and opened == sorted({path for path, _ in seen})
    assert seen == sorted(seen)
    opened.clear()
    only = "model.0.weight"
    picked = list(
        iter_chunks(index, fqns=[only], files=[index.tensors[only].chunks[0].storage.relative_path])
    )
    assert [fqn for fqn, _, _ in picked] == [only] and len(opened) == 1
    assert torch.equal(picked[0][2], originals[only])
    assert list(iter_chunks(index, files=["__7_0.distcp"])) == []


def test_read_chunk_reads_one_chunk(plain: tuple[Path, dict[str, Any]]) -> None:
    directory, originals = plain
    index = open_index(directory)
    chunk = index.tensors["optimizer.state.2.bias.exp_avg_sq"].chunks[0]
    assert torch.equal(read_chunk(directory, chunk), originals["optimizer.state.2.bias.exp_avg_sq"])
    assert is_dcp_directory(directory) and not is_dcp_directory(directory / "__0_0.distcp")
    escaping = dataclasses.replace(
        chunk, storage=dataclasses.replace(chunk.storage, relative_path="../step-1/__0_0.distcp")
    )
    with pytest.raises(SnapshotError, match="climbs out"):
        read_chunk(directory, escaping)


def test_file_cut_after_indexing(plain: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(plain[0], directory)
    index = open_index(directory)
    last = max(
        (chunk for entry in index.tensors.values() for chunk in entry.chunks),
        key=lambda chunk: chunk.storage.offset,
    )
    with open(directory / last.storage.relative_path, "r+b") as file:
        file.truncate(last.storage.offset + 10)
    with pytest.raises(SnapshotError) as caught:
        list(iter_chunks(index))
    message = str(caught.value)
    assert "truncated" in message and f"'{last.fqn}'" in message and "\n" not in message


@pytest.mark.parametrize("data_format", list(SerializationFormat))
def test_grads_dump_in_either_data_format(tmp_path: Path, data_format: SerializationFormat) -> None:
    model, _ = _trained(seed=1)
    grads = {name: param.grad for name, param in model.named_parameters()}
    # A bytes entry first, so a safetensors blob starts after it, not at byte 0.
    writer = FileSystemWriter(tmp_path / "grads", serialization_format=data_format)
    dcp.save({"grads": grads, "note": {"step": 7}}, storage_writer=writer)
    index = open_index(tmp_path / "grads")
    assert set(index.tensors) == {f"grads.{name}" for name in grads}
    assert set(index.bytes_entries) == {"note.step"}
    if data_format == SerializationFormat.SAFETENSORS:
        assert {c.storage.offset for e in index.tensors.values() for c in e.chunks} != {0}
    full = _reassemble(index)
    for name, grad in grads.items():
        assert torch.equal(full[f"grads.{name}"], grad)
        assert classify_key(f"grads.{name}") == KeyKind("grad", name)


def test_safetensors_record_against_the_metadata(tmp_path: Path) -> None:
    """A safetensors data file whose records contradict the metadata is refused at reading."""
    model, _ = _trained(seed=2)
    grads = {name: param.grad for name, param in model.named_parameters()}
    writer = FileSystemWriter(tmp_path / "g", serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save({"grads": grads}, storage_writer=writer)

    def relabel(metadata: Any) -> None:  # 2.weight is [3, 5]: call it [5, 3]
        entry = metadata.state_dict_metadata["grads.2.weight"]
        entry.size = torch.Size([5, 3])
        entry.chunks[0].sizes = torch.Size([5, 3])

    _rewrite_metadata(tmp_path / "g" / ".metadata", relabel)
    index = open_index(tmp_path / "g")
    with pytest.raises(SnapshotError, match=r"'grads.2.weight'.*holds \[3, 5\]") as caught:
        list(iter_chunks(index))
    assert "__0_0.distcp" in str(caught.value)


# --- Kinds ----------------------------------------------------------------------------------


def test_kinds_of_a_get_state_dict_save(plain: tuple[Path, dict[str, Any]]) -> None:
    directory, _ = plain
    index = open_index(directory)
    model, _ = _trained()
    params = [name for name, _ in model.named_parameters()]
    expected = {f"model.{name}": ("weight", name) for name in params}
    for name in params:
        for stat, kind in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("step", "step")):
            expected[f"optimizer.state.{name}.{stat}"] = (kind, name)
    got = {fqn: (classify_key(fqn).kind, classify_key(fqn).param) for fqn in index.tensors}
    assert got == expected
    for fqn in index.bytes_entries:  # param_groups, extra
        assert classify_key(fqn).kind == "other", fqn


def test_kinds_of_a_torchtitan_style_save(tmp_path: Path) -> None:
    """Model keys at the top level, the optimizer flattened as state.<fqn>.<stat>."""
    model, optimizer = _trained()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    dcp.save(
        {**model_sd, "optimizer": optim_sd, "lr_scheduler": {"last_epoch": 1}},
        checkpoint_id=tmp_path / "t",
    )
    dcp.save({**model_sd, **optim_sd}, checkpoint_id=tmp_path / "bare")
    names = [name for name, _ in model.named_parameters()]
    for directory, prefix in ((tmp_path / "t", "optimizer."), (tmp_path / "bare", "")):
        index = open_index(directory)
        kinds = {fqn: classify_key(fqn) for fqn in index.tensors}
        for name in names:
            assert kinds[name] == KeyKind("weight", name)
            for stat in ("exp_avg", "exp_avg_sq", "step"):
                assert kinds[f"{prefix}state.{name}.{stat}"] == KeyKind(stat, name)
        assert all(classify_key(fqn).kind == "other" for fqn in index.bytes_entries)
        assert len(kinds) == 4 * len(names)


@pytest.mark.parametrize(
    ("fqn", "kind", "param"),
    [
        (
            "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight",
            "exp_avg",
            "decoder.layers.mlp.linear_fc1.weight",
        ),
        (
            "optimizer.state.exp_avg_sq.embedding.word_embeddings.weight",
            "exp_avg_sq",
            "embedding.word_embeddings.weight",
        ),
        (
            "optimizer.state.fp32_param.decoder.final_layernorm.weight",
            "other",
            "decoder.final_layernorm.weight",
        ),
        ("optimizer.state.0.weight.max_exp_avg_sq", "other", "0.weight"),
        (
            "decoder.layers.self_attention.linear_qkv.weight",
            "weight",
            "decoder.layers.self_attention.linear_qkv.weight",
        ),
        ("param_groups.layers.0.weight.lr", "other", "layers.0.weight"),
        ("train_state.step", "other", None),
        ("optimizer", "other", None),
    ],
)
def test_kinds_of_other_layouts(fqn: str, kind: str, param: str | None) -> None:
    assert classify_key(fqn) == KeyKind(kind, param)


# --- Two gloo ranks of FSDP2 ----------------------------------------------------------------


def _fsdp_job(rank: int, world_size: int, root: str) -> dict[str, torch.Tensor]:
    """FSDP2 over 2 ranks: rows 5 and 1 shard unevenly (3 + 2, and 1 + an empty shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 1))
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    model(torch.randn(3, 4)).square().sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    grads = {name: param.grad for name, param in model.named_parameters()}
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=f"{root}/ckpt")
    dcp.save({"grads": grads}, checkpoint_id=f"{root}/grads")
    # Rank-local metadata; the plain tensor is every rank's, kept twice (no deduplication).
    shared = torch.arange(6.0).reshape(2, 3)
    dcp.save(
        {"model": model_sd, "shared": shared},
        checkpoint_id=f"{root}/local",
        use_collectives=False,
    )
    full = _flatten({"model": model_sd, "optimizer": optim_sd, "grads": grads})
    return {
        fqn: value.full_tensor() if hasattr(value, "full_tensor") else value
        for fqn, value in full.items()
        if isinstance(value, torch.Tensor)
    } | {"shared": shared}


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("fsdp")
    report: LaunchReport = launch(2, root, [Case("fsdp", _fsdp_job, str(root))], timeout_s=120)
    assert not report.problems, report.problems
    return root, report.values("fsdp")[0]


@pytest.mark.multiprocess
def test_fsdp2_uneven_shards_reassemble(fsdp: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, full = fsdp
    checkpoint = open_index(root / "ckpt")
    weight = checkpoint.tensors["model.0.weight"]
    assert [(c.offsets, c.sizes) for c in weight.chunks] == [((0, 0), (3, 4)), ((3, 0), (2, 4))]
    assert [c.sizes for c in checkpoint.tensors["model.2.weight"].chunks] == [(1, 5), (0, 5)]
    assert {c.storage.relative_path for c in weight.chunks} == {"__0_0.distcp", "__1_0.distcp"}
    for directory in ("ckpt", "grads"):
        index = open_index(root / directory)
        rebuilt = _reassemble(index)
        assert rebuilt.keys() <= full.keys() and rebuilt
        for fqn, tensor in rebuilt.items():
            assert torch.equal(tensor, full[fqn]), fqn
    assert {classify_key(fqn).kind for fqn in open_index(root / "grads").tensors} == {"grad"}


@pytest.mark.multiprocess
def test_rank_local_metadata_merged(fsdp: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, full = fsdp
    assert not (root / "local" / ".metadata").exists()
    index = open_index(root / "local")
    assert [path.name for path in index.metadata_files] == ["__0.metadata", "__1.metadata"]
    # Each file alone describes half of every sharded tensor.
    alone = load_metadata(root / "local" / "__1.metadata")
    assert [c.offsets for c in alone.tensors["model.0.weight"].chunks] == [(3, 0)]
    shared = index.tensors["shared"]
    assert len(shared.chunks) == 1 and shared.chunks[0].copies == 2
    assert shared.chunks[0].storage.relative_path == "__0_0.distcp"
    rebuilt = _reassemble(index)
    assert set(rebuilt) == {fqn for fqn in full if fqn.startswith("model.")} | {"shared"}
    for fqn, tensor in rebuilt.items():
        assert torch.equal(tensor, full[fqn]), fqn


@pytest.mark.multiprocess
def test_rank_local_files_that_disagree(
    fsdp: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    directory = tmp_path / "local"
    shutil.copytree(fsdp[0] / "local", directory)

    def grow(metadata: Any) -> None:
        metadata.state_dict_metadata["model.0.weight"].size = torch.Size([6, 4])

    _rewrite_metadata(directory / "__1.metadata", grow)
    message = _refusal(directory)
    assert "__1.metadata" in message and "'model.0.weight'" in message and "disagree" in message
    os.remove(directory / "__1.metadata")  # rank 1's half is now missing: a gap
    message = _refusal(directory)
    assert "'model.0.weight'" in message and "gap" in message


# --- Damaged and edited checkpoints ---------------------------------------------------------

FQN = "model.0.weight"  # chunks ((0, 0), (3, 4)) on rank 0 and ((3, 0), (2, 4)) on rank 1


def _path_to(target: str) -> Callable[[Any, Path], None]:
    def edit(metadata: Any, directory: Path) -> None:
        key = _storage_key(metadata, FQN, (3, 0))
        info = metadata.storage_data[key]
        outside = directory.parent / "outside.distcp"
        shutil.copyfile(directory / info.relative_path, outside)
        if target == "symlink":
            os.symlink(outside, directory / "link.distcp")
            info.relative_path = "link.distcp"
        elif target == "absolute":
            info.relative_path = str(outside)
        else:
            info.relative_path = target

    return edit


def _transformed(metadata: Any, directory: Path) -> None:
    metadata.storage_data[_storage_key(metadata, FQN, (3, 0))].transform_descriptors = ["zstd"]


def _overlapping(metadata: Any, directory: Path) -> None:
    metadata.state_dict_metadata[FQN].chunks[0].sizes = torch.Size([4, 4])


def _gap(metadata: Any, directory: Path) -> None:
    del metadata.state_dict_metadata[FQN].chunks[1]


def _outside(metadata: Any, directory: Path) -> None:
    metadata.state_dict_metadata[FQN].chunks[1].sizes = torch.Size([3, 4])


def _no_storage(metadata: Any, directory: Path) -> None:
    del metadata.storage_data[_storage_key(metadata, FQN, (3, 0))]


def _truncated(metadata: Any, directory: Path) -> None:
    info = metadata.storage_data[_storage_key(metadata, FQN, (3, 0))]
    with open(directory / info.relative_path, "r+b") as file:
        file.truncate(info.offset + info.length - 1)


def _missing_file(metadata: Any, directory: Path) -> None:
    os.remove(directory / "__1_0.distcp")


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (_path_to("../outside.distcp"), "climbs out with '..'"),
        (_path_to("sub/../../outside.distcp"), "climbs out with '..'"),
        (_path_to("absolute"), "is absolute"),
        (_path_to("symlink"), "through a symlink"),
        (_transformed, "stored transformed (zstd)"),
        (_overlapping, "overlap"),
        (_gap, "a gap"),
        (_outside, "outside the global shape"),
        (_no_storage, "has no storage entry"),
        (_truncated, "truncated"),
        (_missing_file, "is missing"),
    ],
    ids=[
        "dotdot",
        "nested-dotdot",
        "absolute",
        "symlink",
        "transform",
        "overlap",
        "gap",
        "outside",
        "no-storage",
        "truncated",
        "missing-file",
    ],
)
def test_damaged_checkpoint_refused(
    fsdp: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    edit: Callable[[Any, Path], None],
    expected: str,
) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(fsdp[0] / "ckpt", directory)
    open_index(directory)  # the copy is sound before the edit
    _rewrite_metadata(directory / ".metadata", lambda metadata: edit(metadata, directory))
    message = _refusal(directory)
    assert expected in message
    assert FQN in message
    assert str(directory) in message


GRID = [((0, 0), (3, 2)), ((0, 2), (3, 2)), ((3, 0), (2, 2)), ((3, 2), (2, 2))]


@pytest.mark.parametrize(
    ("cells", "expected"),
    [
        (GRID, None),
        ([((0, 0), (5, 2)), ((0, 2), (3, 2)), ((3, 2), (2, 2))], None),
        ([((0, 0), (3, 3)), *GRID[1:]], "overlap"),
        ([((0, 0), (5, 2)), *GRID[1:]], "overlap"),
        (GRID[:3], "a gap"),
        ([*GRID[:3], ((3, 2), (2, 3))], "outside the global shape"),
    ],
    ids=["grid", "uneven-grid", "overlap-in-columns", "overlap-in-rows", "gap", "outside"],
)
def test_grid_chunks_must_tile(
    plain: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    cells: list[tuple[tuple[int, int], tuple[int, int]]],
    expected: str | None,
) -> None:
    """A 2-D grid of chunks (as TP x FSDP saves them) against the coverage checks; the index is
    built from the metadata alone, so every cell's storage is the one record of the tensor."""
    directory = tmp_path / "ckpt"
    shutil.copytree(plain[0], directory)
    fqn = "model.0.weight"  # [5, 4]

    def regrid(metadata: Any) -> None:
        entry = metadata.state_dict_metadata[fqn]
        key = _storage_key(metadata, fqn, (0, 0))
        info = metadata.storage_data.pop(key)
        entry.chunks = []
        for offsets, sizes in cells:
            entry.chunks.append(_chunk(offsets, sizes))
            metadata.storage_data[type(key)(fqn, offsets)] = info

    _rewrite_metadata(directory / ".metadata", regrid)
    if expected is None:
        chunks = open_index(directory).tensors[fqn].chunks
        assert [(c.offsets, c.sizes) for c in chunks] == sorted(cells)
    else:
        message = _refusal(directory)
        assert expected in message and f"'{fqn}'" in message


def _chunk(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))


@pytest.mark.multiprocess
def test_chunk_stored_twice_counts_once(
    fsdp: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(fsdp[0] / "ckpt", directory)

    def twice(metadata: Any) -> None:
        chunks = metadata.state_dict_metadata[FQN].chunks
        chunks.append(type(chunks[0])(offsets=chunks[0].offsets, sizes=chunks[0].sizes))

    _rewrite_metadata(directory / ".metadata", twice)
    index = open_index(directory)
    assert [c.copies for c in index.tensors[FQN].chunks] == [2, 1]
    assert torch.equal(_reassemble(index)[FQN], fsdp[1][FQN])


@pytest.mark.multiprocess
@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_chunk_unlike_its_metadata_refused_when_read(
    fsdp: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, change: str
) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(fsdp[0] / "ckpt", directory)

    def edit(metadata: Any) -> None:
        if change == "dtype":
            metadata.state_dict_metadata[FQN].properties.dtype = torch.float64
            return
        # Swap the two chunks' byte ranges: each now holds the other's shape.
        first, second = (_storage_key(metadata, FQN, offsets) for offsets in ((0, 0), (3, 0)))
        storage = metadata.storage_data
        storage[first], storage[second] = storage[second], storage[first]

    _rewrite_metadata(directory / ".metadata", edit)
    index = open_index(directory)  # the metadata alone is consistent
    with pytest.raises(SnapshotError) as caught:
        list(iter_chunks(index, fqns=[FQN]))
    message = str(caught.value)
    assert "\n" not in message and f"'{FQN}'" in message and ".distcp" in message
    # Files in path order: __0_0.distcp now holds the [3, 4] chunk where [2, 4] is expected.
    assert (
        "holds [3, 4] torch.float32, the metadata says [2, 4]"
        if change == "shape"
        else "says [3, 4] torch.float64"
    ) in message


def test_paths_come_from_the_storage_entries(
    plain: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Data files renamed (as Megatron prefixes them) are found through the metadata; a decoy
    under DCP's default name is never read."""
    directory = tmp_path / "ckpt"
    shutil.copytree(plain[0], directory)
    os.rename(directory / "__0_0.distcp", directory / "model_part__0_0.distcp")
    (directory / "__0_0.distcp").write_bytes(b"decoy" * 10_000)

    def rename(metadata: Any) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = "model_part__0_0.distcp"

    _rewrite_metadata(directory / ".metadata", rename)
    full = _reassemble(open_index(directory))
    for fqn, tensor in full.items():
        assert torch.equal(tensor, plain[1][fqn]), fqn


def test_megatron_extras_become_inert(
    plain: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Megatron's metadata subclass, its cached plans (DCP planner records) and its own objects
    in planner_data load as stand-ins: none of their code runs."""
    import types

    from torch.distributed.checkpoint.filesystem import _StoragePrefix
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    marker = tmp_path / "marker"
    module = types.ModuleType("megatron.core.dist_checkpointing.strategies.torch")

    class MCoreMetadata(Metadata):
        def __setstate__(self, state: Any) -> None:  # would run if the real class were used
            marker.touch()
            self.__dict__.update(state)

    class ShardedTensor:
        def __init__(self, key: str) -> None:
            self.key = key

        def __setstate__(self, state: Any) -> None:
            marker.touch()

    class ShardedObject:
        __slots__ = ("key",)  # pickled as (None, {"key": ...})

        def __init__(self, key: str) -> None:
            self.key = key

    for cls in (MCoreMetadata, ShardedTensor, ShardedObject):
        cls.__module__ = module.__name__
        cls.__qualname__ = cls.__name__
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with open(plain[0] / ".metadata", "rb") as file:
        real = pickle.load(file)
    entry = real.state_dict_metadata["model.0.weight"]
    plan = SavePlan(
        items=[
            WriteItem(
                index=MetadataIndex("model.0.weight", (0, 0)),
                type=WriteItemType.TENSOR,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size([0, 0]), entry.size),
                    properties=entry.properties,
                    size=entry.size,
                ),
            )
        ],
        storage_data=_StoragePrefix("__0_"),
    )
    megatron = MCoreMetadata(
        state_dict_metadata=real.state_dict_metadata,
        planner_data={"sharded": ShardedTensor("model.0.weight"), "object": ShardedObject("o")},
        storage_data=real.storage_data,
        storage_meta=real.storage_meta,
        version=real.version,
    )
    megatron.all_local_plans = [plan]  # type: ignore[attr-defined]
    directory = tmp_path / "ckpt"
    shutil.copytree(plain[0], directory)
    with open(directory / ".metadata", "wb") as file:
        pickle.dump(megatron, file)
    loaded = load_metadata(directory / ".metadata")
    inert = loaded.planner_data["sharded"]
    assert isinstance(inert, dcp_pickle.Inert) and inert.key == "model.0.weight"
    assert inert._origin == f"{module.__name__}.ShardedTensor"
    assert loaded.planner_data["object"].key == "o"
    assert set(loaded.tensors) == set(open_index(plain[0]).tensors)
    full = _reassemble(open_index(directory))
    assert torch.equal(full["model.0.weight"], plain[1]["model.0.weight"])
    assert not marker.exists()


# --- Crafted and broken pickles -------------------------------------------------------------


class _Payload:
    """Pickles as a call of ``function(*args)``: what a crafted .metadata would run."""

    def __init__(self, function: Any, *args: Any) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.function, self.args


def _crafted(kind: str, marker: Path) -> bytes:
    if kind == "os.system":  # written by hand: pickle itself would name posix.system
        return b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    if kind == "posix.system":
        return pickle.dumps(_Payload(os.system, f"touch {marker}"))
    if kind == "builtins.exec":
        return pickle.dumps(_Payload(exec, f"open({str(marker)!r}, 'w').close()"))
    if kind == "subprocess.check_call":
        return pickle.dumps(_Payload(subprocess.check_call, ["touch", str(marker)]))
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["os.system", "posix.system", "builtins.exec", "subprocess.check_call"]
)
@pytest.mark.parametrize("nested", [False, True], ids=["whole", "in-planner-data"])
def test_crafted_metadata_runs_nothing(
    plain: tuple[Path, dict[str, Any]], tmp_path: Path, kind: str, nested: bool
) -> None:
    marker = tmp_path / "marker"
    payload = _crafted(kind, marker)
    pickle.loads(payload)  # the payload is live: plain pickle runs it
    assert marker.exists()
    marker.unlink()
    directory = tmp_path / "ckpt"
    shutil.copytree(plain[0], directory)
    named = kind
    if nested:  # deep inside a real Metadata, after the records it holds
        with open(directory / ".metadata", "rb") as file:
            metadata = pickle.load(file)
        metadata.planner_data = {"x": [_Payload(*_payload_call(kind, marker))]}
        with open(directory / ".metadata", "wb") as file:
            pickle.dump(metadata, file)
        named = "posix.system" if kind == "os.system" else kind
    else:
        (directory / ".metadata").write_bytes(payload)
    for attempt in (lambda: load_metadata(directory / ".metadata"), lambda: open_index(directory)):
        with pytest.raises(SnapshotError) as caught:
            attempt()
        message = str(caught.value)
        assert "\n" not in message
        assert str(directory / ".metadata") in message
        assert f"refused to unpickle {named}" in message
    assert not marker.exists()


def _payload_call(kind: str, marker: Path) -> tuple[Any, ...]:
    if kind in ("os.system", "posix.system"):
        return (os.system, f"touch {marker}")
    if kind == "builtins.exec":
        return (exec, f"open({str(marker)!r}, 'w').close()")
    return (subprocess.check_call, ["touch", str(marker)])


def test_bytes_entries_are_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    model, _ = _trained()
    state = {
        "model": dict(model.state_dict()),
        "hook": _Payload(*_payload_call("builtins.exec", marker)),
    }
    dcp.save(state, checkpoint_id=tmp_path / "ckpt")
    assert not marker.exists()
    index = open_index(tmp_path / "ckpt")
    assert set(index.bytes_entries) == {"hook"}
    _reassemble(index)
    assert not marker.exists()
    storage = index.bytes_entries["hook"].storage
    assert storage is not None
    with open(tmp_path / "ckpt" / storage.relative_path, "rb") as file:
        file.seek(storage.offset)
        record = file.read(storage.length)
    torch.load(io.BytesIO(record), weights_only=False)  # the stored object is live
    assert marker.exists()


def test_truncated_and_garbage_metadata(plain: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    good = (plain[0] / ".metadata").read_bytes()
    path = tmp_path / ".metadata"
    torch.manual_seed(3)
    noise = bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).tolist())
    step = max(1, len(good) // 97)
    cases = [good[:cut] for cut in range(0, len(good) - 1, step)]
    cases += [noise, b"\x80\x04garbage", struct.pack("<Q", 2**60) + b"{}"]
    cases += [pickle.dumps([1, 2, 3]), pickle.dumps({"state_dict_metadata": {}})]
    cases += [
        b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x05torch\x8c\x04Size\x93\x8c\x03abc\x85R."
    ]
    for content in cases:
        path.write_bytes(content)
        with pytest.raises(SnapshotError) as caught:
            load_metadata(path)
        message = str(caught.value)
        assert "\n" not in message and str(path) in message, message
    path.write_bytes(good)
    assert set(load_metadata(path).tensors) == set(open_index(plain[0]).tensors)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    assert "no .metadata" in _refusal(tmp_path)
    assert "not a directory" in _refusal(tmp_path / "absent")
    with pytest.raises(SnapshotError, match="no such file"):
        load_metadata(tmp_path / ".metadata")
