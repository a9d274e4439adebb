"""Snapshots: save_rank on every rank of a layout, read back, statistics of the unsharded model."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import gradstat
from gradstat.analysis.stats import snapshot_stats
from gradstat.core.axes import AXES
from gradstat.core.groups import AxisPlace
from gradstat.core.placements import MeshPlacement
from gradstat.errors import SnapshotError
from gradstat.snapshot import Snapshot, save_rank
from gradstat.snapshot.format import (
    ATTRIBUTE_KINDS,
    DTYPES,
    FORMAT_VERSION,
    GRAD_ATTRS,
    ParamRecord,
    RankHeader,
    parse_header,
)
from gradstat.snapshot.repeats import KnownParams
from tests._cli import SAMPLE_DATA
from tests._jobs import (
    NORM_TYPES,
    OUTPUT_COPY,
    Job,
    dump_layout,
    full_grads,
    model_specs,
)
from tests._oracle import float64_norm, rel_err, zeros_in
from tests._params import param_with
from tests._schema import errors as schema_errors

LAYOUTS = [
    Job("single"),
    Job("tp2", tp=2),
    Job("tp2_pp2_tied", tp=2, pp=2),
    Job("tp2_dp2_plain", tp=2, dp=2),
    Job("tp2_dp2_distopt", tp=2, dp=2, distopt=True),
    Job("pp2_dp2_distopt_tied", pp=2, dp=2, distopt=True),
    Job("tp2_dp2_ep2_etp2_moe", tp=2, dp=2, ep=2, etp=2, moe=True),
    Job("gtp4_spill", gtp=4, align=8),
    Job("gtp2_dp2_distopt", gtp=2, dp=2, distopt=True),
    Job("gtp2_dp2_ep2_egtp2_moe_spill", gtp=2, dp=2, ep=2, egtp=2, moe=True, align=8),
    Job("tp2_pp2_dp2_ep2_moe_distopt", tp=2, pp=2, dp=2, ep=2, moe=True, distopt=True),
    Job("tp2_gtp2_dp2_plain", tp=2, gtp=2, dp=2),
    Job("gtp4_dp2_distopt_spill", gtp=4, dp=2, align=8, distopt=True),
    Job("tp2_dp4_ep4_etp2_moe_distopt", tp=2, dp=4, ep=4, etp=2, moe=True, distopt=True),
    # Context parallelism: CP ranks hold copies (plain optimizer), or fragments of DP x CP.
    Job("tp2_cp2_plain", tp=2, cp=2),
    Job("cp2_dp2_pp2_distopt_tied", cp=2, dp=2, pp=2, distopt=True),
    Job("tp2_cp2_dp2_ep4_moe_distopt", tp=2, cp=2, dp=2, ep=4, moe=True, distopt=True),
    Job("gtp2_cp2_ep2_egtp2_moe_spill", gtp=2, cp=2, ep=2, egtp=2, moe=True, align=8),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_snapshot_statistics_equal_the_unsharded_model(layout: Job, tmp_path: Path) -> None:
    dump_layout(layout, tmp_path)
    snapshot = Snapshot.open(tmp_path)
    assert snapshot.world_size == layout.world_size
    stats = snapshot_stats(snapshot, NORM_TYPES)
    grads = full_grads(layout.moe)
    names = [spec.name for spec in model_specs(layout.moe)]
    everything = [grads[name] for name in names]
    for norm_type in NORM_TYPES:
        expected = float64_norm(everything, norm_type)
        got = stats.norm(norm_type)
        assert got == expected if norm_type == math.inf else rel_err(got, expected) <= 1e-6
    assert stats.zeros == zeros_in(everything)
    assert stats.numel == sum(grad.numel() for grad in everything)
    # Per parameter: each logical parameter once, under its own name, shards aggregated.
    by_name = {param.name: param for param in stats.params}
    assert sorted(by_name) == sorted(names)
    assert OUTPUT_COPY not in by_name
    for name in names:
        assert by_name[name].zeros == zeros_in([grads[name]]), name
        expected = float64_norm([grads[name]], 2)
        assert math.isclose(by_name[name].norm(2), expected, rel_tol=1e-6), name


def test_gtp_padding_is_recorded_and_excluded(tmp_path: Path) -> None:
    layout = Job("gtp4_spill", gtp=4, align=8)
    dump_layout(layout, tmp_path)
    stats = snapshot_stats(Snapshot.open(tmp_path))
    assert stats.pad_zeros > 0
    on_disk = sum(
        tensor.numel()
        for path in tmp_path.glob("*.safetensors")
        for tensor in _read_with_safetensors(path)[0].values()
    )
    assert on_disk > stats.numel  # padding is in the files, not in the statistics


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_a_1d_gtp_shards_padding_is_excluded_with_either_optimizer(
    tmp_path: Path, distributed_optimizer: bool
) -> None:
    """A 1-D gradient split over (E)GTP ranks: a plain optimizer's whole shards counted their
    padding as zero gradients (3 zeros of 8 elements, where a distributed optimizer's stamped
    fragments of the same gradient gave 1 of 6), and audit said it was subtracted."""
    from gradstat.testing import Layout, ParamLayout, shard_gradients, write_snapshot

    name = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.bias"
    grad = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    layout = Layout(gtp=2, egtp=2, gtp_align=4, distributed_optimizer=distributed_optimizer)
    spec = ParamLayout(name, "none", expert=0, num_experts=1, gtp=True)
    write_snapshot(tmp_path, layout, shard_gradients(layout, [spec], {name: grad}))
    stats = snapshot_stats(Snapshot.open(tmp_path))
    assert (stats.zeros, stats.numel, stats.pad_zeros) == (zeros_in([grad]), grad.numel(), 2)


def _read_with_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as file:
        return {key: file.get_tensor(key) for key in file.keys()}, file.metadata()  # noqa: SIM118


def test_a_rank_file_is_plain_safetensors(tmp_path: Path) -> None:
    grads = {
        "a.weight": torch.randn(5, 3),
        "b.weight": torch.randn(7).bfloat16(),
        "c.bias": torch.randn(3).half(),
        "e.empty": torch.zeros(0, 4),
    }
    params = [(name, param_with(grad, tensor_model_parallel=True)) for name, grad in grads.items()]
    params.append(("d.frozen", param_with(None)))
    path = save_rank(
        tmp_path, params, rank=1, world_size=2, coords={"tp": [1, 2]}, step=3, grad_attr="grad"
    )
    assert path == tmp_path / "rank-00001.safetensors"
    tensors, metadata = _read_with_safetensors(path)
    assert sorted(tensors) == sorted(grads)
    for name, grad in grads.items():
        assert tensors[name].dtype == grad.dtype
        assert torch.equal(tensors[name], grad)
    header = json.loads(metadata["gradstat"])
    assert header["rank"] == 1 and header["world_size"] == 2 and header["step"] == 3
    assert header["coords"]["tp"] == [1, 2] and header["coords"]["egtp"] == [0, 1]
    frozen = next(entry for entry in header["params"] if entry["name"] == "d.frozen")
    assert frozen["grad"] is False


def test_main_grad_and_decoupled_grad_are_read(tmp_path: Path) -> None:
    param = param_with(None)
    param.main_grad = torch.full((4,), 2.0)
    save_rank(tmp_path, [("w", param)], rank=0, world_size=1, coords={}, grad_attr="main_grad")
    stats = snapshot_stats(Snapshot.open(tmp_path))
    assert stats.norm(2) == pytest.approx(4.0, rel=1e-12)


def test_existing_rank_file_is_never_overwritten(tmp_path: Path) -> None:
    first = param_with(torch.ones(3))
    path = save_rank(tmp_path, [("w", first)], rank=0, world_size=1, coords={})
    before = path.read_bytes()
    with pytest.raises(SnapshotError, match="rank file exists; pass overwrite=True"):
        save_rank(tmp_path, [("w", param_with(torch.zeros(3)))], rank=0, world_size=1, coords={})
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["rank-00000.safetensors"]  # no temporary left
    save_rank(
        tmp_path,
        [("w", param_with(torch.zeros(3)))],
        rank=0,
        world_size=1,
        coords={},
        overwrite=True,
    )
    assert path.read_bytes() != before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 2, "world_size": 2, "coords": {}}, "rank 2 is outside world size 2"),
        ({"rank": 0, "world_size": 1, "coords": {"tp": [2, 2]}}, r"coords\['tp'\]"),
        ({"rank": 0, "world_size": 1, "coords": {"xp": [0, 1]}}, "unknown axis 'xp'"),
        ({"rank": 0, "world_size": 1, "coords": {}, "grad_attr": "g"}, "grad_attr must be"),
    ],
)
def test_bad_save_arguments(kwargs: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        save_rank(tmp_path, [("w", param_with(torch.ones(2)))], **kwargs)


def test_duplicate_names_and_unsupported_dtypes_are_refused(tmp_path: Path) -> None:
    twice = [("w", param_with(torch.ones(2))), ("w", param_with(torch.ones(2)))]
    with pytest.raises(ValueError, match="'w' appears twice"):
        save_rank(tmp_path, twice, rank=0, world_size=1, coords={})
    integer = [("i", param_with(torch.ones(2, dtype=torch.int32)))]
    with pytest.raises(ValueError, match="int32 is not supported; supported: float32"):
        save_rank(tmp_path, integer, rank=0, world_size=1, coords={})
    assert list(tmp_path.iterdir()) == []


def _two_ranks(directory: Path, **overrides: Any) -> None:
    for rank in range(2):
        options: dict[str, Any] = {"rank": rank, "world_size": 2, "coords": {"tp": [rank, 2]}}
        if rank == 1:
            options.update(overrides)
        save_rank(
            directory, [("w", param_with(torch.ones(4), tensor_model_parallel=True))], **options
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"step": 8}, "step 8 differs from None"),
        ({"world_size": 3, "rank": 2, "coords": {"tp": [1, 3]}}, "world size 3 differs from 2"),
        ({"coords": {"tp": [0, 2]}}, "same coordinates as rank 0"),
        ({"distributed_optimizer": True}, "distributed_optimizer True differs"),
        (
            {"coords": {"tp": [1, 2], "dp": [0, 2]}},
            r"axis dp has size 2, but 1 in rank-00000\.safetensors",
        ),
    ],
)
def test_inconsistent_rank_files_are_rejected(
    overrides: dict[str, Any], message: str, tmp_path: Path
) -> None:
    _two_ranks(tmp_path, **overrides)
    with pytest.raises(SnapshotError, match=message):
        Snapshot.open(tmp_path)


def test_missing_and_duplicate_ranks(tmp_path: Path) -> None:
    _two_ranks(tmp_path)
    (tmp_path / "rank-00001.safetensors").rename(tmp_path / "spare.safetensors.bak")
    with pytest.raises(SnapshotError, match=r"1 of 2 rank files missing \(rank 1\)"):
        Snapshot.open(tmp_path)
    (tmp_path / "spare.safetensors.bak").rename(tmp_path / "rank-00001.safetensors")
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes((tmp_path / "rank-00000.safetensors").read_bytes())
    with pytest.raises(SnapshotError, match="rank 0 is also in"):
        Snapshot.open(tmp_path)


def test_truncated_file_is_named(tmp_path: Path) -> None:
    _two_ranks(tmp_path)
    path = tmp_path / "rank-00001.safetensors"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(SnapshotError, match=r"rank-00001\.safetensors: file is truncated"):
        Snapshot.open(tmp_path)


def test_pad_length_beyond_the_shard_is_rejected(tmp_path: Path) -> None:
    shard = param_with(
        torch.zeros(4, 3),
        is_gtp_weight_remat=True,
        pad_length=9,
        group=gradstat.AxisPlace(1, 2),
    )
    save_rank(tmp_path, [("w", shard)], rank=0, world_size=1, coords={"gtp": [1, 2]})
    with pytest.raises(SnapshotError, match="pad_length 9 is larger than the padded tensor"):
        Snapshot.open(tmp_path)


@pytest.mark.parametrize("shape", [(4, 3), (12,)])
def test_a_negative_pad_length_is_refused_as_such(tmp_path: Path, shape: tuple[int, ...]) -> None:
    """It was refused as "larger than the padded tensor" (a whole shard), or read (a flat
    fragment) until the padding count refused it as exceeding the rows."""
    shard = param_with(
        torch.zeros(shape),
        is_gtp_weight_remat=True,
        pad_length=-3,
        group=gradstat.AxisPlace(1, 2),
    )
    save_rank(tmp_path, [("w", shard)], rank=0, world_size=1, coords={"gtp": [1, 2]})
    with pytest.raises(SnapshotError, match="pad_length -3 is negative"):
        Snapshot.open(tmp_path)


def test_gtp_group_must_match_the_coordinates(tmp_path: Path) -> None:
    shard = param_with(
        torch.zeros(4, 3), is_gtp_weight_remat=True, pad_length=2, group=gradstat.AxisPlace(1, 2)
    )
    save_rank(tmp_path, [("w", shard)], rank=0, world_size=1, coords={"gtp": [0, 4]})
    with pytest.raises(SnapshotError, match=r"GTP group \[1, 2\] does not match .* \[0, 4\]"):
        Snapshot.open(tmp_path)


def test_short_fragments_of_gtp_shards_are_valid(tmp_path: Path) -> None:
    """A distributed-optimizer fragment shorter than the padding is still a valid record."""
    from gradstat.testing import Layout, ParamLayout, shard_gradients, write_snapshot

    gen = torch.Generator().manual_seed(2)
    grads = {"w": torch.randn(16, 4, generator=gen), "b": torch.randn(118, generator=gen)}
    specs = [ParamLayout("w", gtp=True), ParamLayout("b")]
    layout = Layout(gtp=2, dp=2, gtp_align=32, distributed_optimizer=True)
    write_snapshot(tmp_path, layout, shard_gradients(layout, specs, grads))
    stats = snapshot_stats(Snapshot.open(tmp_path), (2.0,))
    assert stats.pad_zeros == 48 * 4
    assert rel_err(stats.norm(2), float64_norm(list(grads.values()), 2)) <= 1e-6


def test_rank_files_get_the_usual_file_mode(tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        path = save_rank(
            tmp_path, [("w", param_with(torch.ones(2)))], rank=0, world_size=1, coords={}
        )
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == 0o644


# --- the header's JSON Schema ---------------------------------------------------------------

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "docs" / "snapshot-header.schema.json"


def _schema() -> dict[str, Any]:
    return dict(json.loads(SCHEMA_PATH.read_text()))


def test_the_schema_names_what_the_format_names() -> None:
    schema = _schema()
    definitions = schema["$defs"]
    assert tuple(schema["properties"]["coords"]["properties"]) == AXES
    assert schema["properties"]["grad_attr"]["enum"] == list(GRAD_ATTRS)
    assert definitions["param"]["properties"]["dtype"]["enum"] == [*DTYPES, None]
    assert set(definitions["attrs"]["properties"]) == set(ATTRIBUTE_KINDS)
    assert schema["properties"]["version"]["const"] == FORMAT_VERSION


def _headers_written(tmp_path: Path) -> list[dict[str, Any]]:
    """Headers as gradstat writes them: the sample data, a rank file with every attribute and
    triggers, and a DTensor record."""
    headers = [
        json.loads(_read_with_safetensors(path)[1]["gradstat"])
        for path in sorted(SAMPLE_DATA.glob("*/*.safetensors"))
    ]
    fragment = param_with(
        torch.randn(6),
        tensor_model_parallel=True,
        partition_dim=0,
        is_gtp_weight_remat=True,
        pad_length=2,
        gtp_pad_zeros=1,
        fragment_offset=4,
        fragment_shape=[5, 2],
        allreduce=False,
        group=AxisPlace(1, 2),
    )
    path = save_rank(
        tmp_path,
        [("w", fragment), ("frozen", param_with(None))],
        rank=0,
        world_size=1,
        coords={"egtp": [1, 2]},
        distributed_optimizer=True,
        triggers=("spike",),
    )
    headers.append(json.loads(_read_with_safetensors(path)[1]["gradstat"]))
    placement = MeshPlacement(
        mesh_shape=(2, 2),
        coordinate=(1, 0),
        placements=("S(0)", "R"),
        global_shape=(8, 4),
        mesh_dim_names=("dp_shard", "tp"),
        global_offset=(4, 0),
        copies=(("pp", 0, 2),),
    )
    record = ParamRecord("d", True, (4, 4), "bfloat16", (8, 4), {}, placement)
    coords = {axis: (0, 1) for axis in AXES}
    header = RankHeader(0, 4, 7, coords, False, "grad", (record,))
    headers.append(json.loads(header.to_json()))
    return headers


def test_every_header_gradstat_writes_follows_the_schema(tmp_path: Path) -> None:
    headers = _headers_written(tmp_path)
    assert len(headers) > 30
    for header in headers:
        assert schema_errors(_schema(), header) == [], header["rank"]
    # The checker can fail: what the reader refuses, the schema refuses too.
    broken = json.loads(json.dumps(headers[-2]))
    broken["params"][0]["attrs"]["bogus"] = 1
    broken["coords"]["tp"] = [0]
    broken["grad_attr"] = "grad_of_grad"
    found = schema_errors(_schema(), broken)
    assert len(found) == 3, found


def test_rank_files_gradstat_writes_have_their_parameter_list_last(tmp_path: Path) -> None:
    """The reader checks a parameter list once per distinct text when the list is the metadata's
    last member, as gradstat writes it (triggers included): every file read so, to the same
    header as a whole parse gives."""
    path = save_rank(
        tmp_path,
        [("w", param_with(torch.randn(3)))],
        rank=0,
        world_size=1,
        coords={},
        triggers=("spike",),
    )
    written = [path, *sorted(SAMPLE_DATA.glob("*/*.safetensors"))]
    for path in written:
        text = _read_with_safetensors(path)[1]["gradstat"]
        known = KnownParams()
        assert parse_header(path, text, known) == parse_header(path, text), path
        assert known.by_text or known.by_template, path  # split off and kept


def test_a_folder_renamed_between_link_and_cleanup_leaves_one_name_and_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flight recorder's rank 0 renames the snapshot folder once every rank file is
    there, which may fall right after another rank's link: that rank said it could not dump
    and left its temporary name behind (a second link to the file)."""
    from gradstat.snapshot import writer

    folder, renamed = tmp_path / ".step-5.partial", tmp_path / "step-5"
    real_link = os.link

    def link_then_rename(*args: Any, **kwargs: Any) -> None:
        real_link(*args, **kwargs)
        os.rename(folder, renamed)

    monkeypatch.setattr(writer.os, "link", link_then_rename)
    grad = torch.arange(6, dtype=torch.float32)
    save_rank(folder, [("w", param_with(grad))], rank=0, world_size=1, coords={})
    assert [path.name for path in renamed.iterdir()] == ["rank-00000.safetensors"]
    assert (renamed / "rank-00000.safetensors").stat().st_nlink == 1
