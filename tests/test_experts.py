"""Experts one by one: ``norm`` and ``zeros`` with ``--by expert``, and audit's expert findings.

A small MoE model (two MoE layers of four experts, on one or two pipeline stages) is sharded
with gradstat.testing in layouts with EP, ETP, EGTP padding and distributed-optimizer
fragments, its experts named the SequentialMLP way (``local_experts.E.linear_fc1.weight``) or
the grouped-GEMM way (``linear_fc1.weightE``). Each expert's expected norm and zero count is
computed here, in float64, from the unsharded gradients of the parameters the test names for
that expert. The audit's findings are planted into the gradients (an expert zeroed, a router
zeroed, gradients dropped) with negative controls, and found in the sample data, whose expert
2 of layer 1 no token reaches.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from gradstat.analysis.experts import ExpertName, expert_label, expert_name, router_layer
from gradstat.cli import app
from gradstat.testing import Layout, ParamLayout, RankParams, shard_gradients, write_snapshot
from tests._cli import SAMPLE_DATA, run_gradstat
from tests._oracle import float64_norm, rel_err, zeros_in

HIDDEN, FFN, EXPERTS, LAYERS = 8, 12, 4, 2
NORM_TYPES = ("2", "1", "inf")
DENSE = "(dense parameters)"
OTHER = "(other expert parameters)"


def _module(layer: int) -> str:
    return f"decoder.layers.{layer}.mlp.experts"


def _router(layer: int) -> str:
    return f"decoder.layers.{layer}.mlp.router.weight"


def _expert_params(naming: str, layer: int, index: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Expert ``index``'s parameters in layer ``layer``: name: (shape, TP split)."""
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "linear_fc1.weight": ((FFN, HIDDEN), "column"),
        "linear_fc2.weight": ((HIDDEN, FFN), "row"),
        "linear_fc2.bias": ((HIDDEN,), "none"),
    }
    if naming == "sequential":
        prefix = f"{_module(layer)}.local_experts.{index}."
        return {prefix + rest: spec for rest, spec in shapes.items()}
    return {f"{_module(layer)}.{rest}{index}": spec for rest, spec in shapes.items()}


def _model(naming: str) -> list[tuple[str, tuple[int, ...], str, int, int | None]]:
    """(name, shape, split, layer, expert) in module order; layer -1: the embedding."""
    params: list[tuple[str, tuple[int, ...], str, int, int | None]] = [
        ("embedding.word_embeddings.weight", (16, HIDDEN), "column", -1, None)
    ]
    for layer in range(LAYERS):
        params.append(
            (f"decoder.layers.{layer}.input_layernorm.weight", (HIDDEN,), "none", layer, None)
        )
        params.append((_router(layer), (EXPERTS, HIDDEN), "none", layer, None))
        for index in range(EXPERTS):
            for name, (shape, split) in _expert_params(naming, layer, index).items():
                params.append((name, shape, split, layer, index))
    return params


def _grads(naming: str) -> dict[str, torch.Tensor]:
    """fp32 gradients with exact zeros (every fifth element), each parameter its own scale."""
    generator = torch.Generator().manual_seed(28)
    grads = {}
    for name, shape, *_ in _model(naming):
        grad = torch.randn(shape, generator=generator) * 10.0 ** float(
            torch.randint(-3, 2, (), generator=generator)
        )
        grad.view(-1)[::5] = 0.0
        grads[name] = grad
    return grads


def _specs(naming: str, pp: int) -> list[ParamLayout]:
    return [
        ParamLayout(
            name,
            split,  # type: ignore[arg-type]
            stage=0 if layer < 0 else layer * pp // LAYERS,
            expert=index,
            num_experts=EXPERTS if index is not None else 0,
            gtp="linear_fc1.weight" in name,  # EGTP pads and shards the experts' fc1
        )
        for name, _, split, layer, index in _model(naming)
    ]


def _write(
    directory: Path,
    naming: str,
    layout: Layout,
    grads: dict[str, torch.Tensor] | None = None,
    plant: Callable[[list[RankParams]], None] | None = None,
) -> Path:
    ranks = shard_gradients(layout, _specs(naming, layout.pp), grads or _grads(naming))
    if plant is not None:
        plant(ranks)
    write_snapshot(directory, layout, ranks, step=3)
    return directory


def _cli(*args: Any) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(app, [*map(str, args), "--json"])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def _members(naming: str) -> dict[str, list[str]]:
    """The test's own account of which parameters make up each expert row (by its label)."""
    rows: dict[str, list[str]] = {}
    for layer in range(LAYERS):
        for index in range(EXPERTS):
            label = f"{_module(layer)}[{index}]"
            rows[label] = list(_expert_params(naming, layer, index))
    rows[DENSE] = [name for name, *_, index in _model(naming) if index is None]
    return rows


LAYOUTS = {
    "tp2-ep2-etp2": Layout(tp=2, dp=2, ep=2, etp=2),
    "tp2-pp2-dp2-ep2-distopt": Layout(tp=2, pp=2, dp=2, ep=2, distributed_optimizer=True),
    "gtp2-dp2-ep2-egtp2-padded": Layout(gtp=2, dp=2, ep=2, egtp=2, gtp_align=8),
}


# --- names -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight",
            ExpertName("decoder.layers.1.mlp.experts", 2, "linear_fc1.weight"),
        ),
        (
            "decoder.layers.3.mlp.experts.linear_fc2.weight17",
            ExpertName("decoder.layers.3.mlp.experts", 17, "linear_fc2.weight"),
        ),
        (
            "module.mtp.layers.0.mlp.experts.linear_fc1.bias5",
            ExpertName("module.mtp.layers.0.mlp.experts", 5, "linear_fc1.bias"),
        ),
        ("experts.local_experts.0.w", ExpertName("experts", 0, "w")),
        ("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", None),
        ("decoder.layers.1.mlp.shared_experts.local_experts.0.linear_fc1.weight", None),
        ("decoder.layers.1.mlp.router.weight", None),
        ("decoder.layers.1.mlp.linear_fc1.weight", None),
        ("decoder.layers.1.mlp.experts.weight1", None),  # legacy GroupedMLP: stacked
        ("layers.0.moe.experts.w1", None),  # torch-native stacked [E, ...]
        ("decoder.layers.1.mlp.experts.local_experts.x.linear_fc1.weight", None),
    ],
)
def test_expert_names(name: str, expected: ExpertName | None) -> None:
    assert expert_name(name) == expected


def test_router_names_and_labels() -> None:
    assert router_layer("decoder.layers.1.mlp.router.weight") == "decoder.layers.1.mlp"
    assert router_layer("decoder.layers.1.mlp.router.bias") == "decoder.layers.1.mlp"
    assert router_layer("decoder.layers.1.mlp.router.expert_bias") is None
    assert router_layer("decoder.layers.1.mlp.linear_fc1.weight") is None
    assert expert_label("decoder.layers.1.mlp.experts", 2) == "decoder.layers.1.mlp.experts[2]"


# --- norm and zeros by expert ------------------------------------------------------------------


@pytest.mark.parametrize("naming", ["sequential", "grouped"])
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_norm_by_expert_against_float64(tmp_path: Path, naming: str, layout: Layout) -> None:
    directory = _write(tmp_path, naming, layout)
    grads, members = _grads(naming), _members(naming)
    for norm_type in NORM_TYPES:
        p = float(norm_type)
        code, plain = _cli("norm", directory, "-p", norm_type)
        code_by, by = _cli("norm", directory, "-p", norm_type, "--by", "expert")
        assert code == code_by == 0
        # The totals and the per-parameter rows do not change; only the expert rows are added.
        assert {
            key: value for key, value in by.items() if key not in ("by_expert", "experts_left_out")
        } == plain
        assert "by_expert" not in plain and by["experts_left_out"] == 0
        rows = {row["name"]: row for row in by["by_expert"]}
        assert sorted(rows) == sorted(members)
        for label, names in members.items():
            row, tensors = rows[label], [grads[name] for name in names]
            expected = float64_norm(tensors, p)
            if p == math.inf:
                assert row["norm"] == expected, label  # a max of fp32 values is exact
                assert row["share"] is None
            else:
                assert rel_err(row["norm"], expected) <= 1e-6, (label, norm_type)
            assert row["num_elements"] == sum(tensor.numel() for tensor in tensors)
            assert row["params"] == len(names)
        for layer in range(LAYERS):
            for index in range(EXPERTS):
                row = rows[f"{_module(layer)}[{index}]"]
                assert (row["layer"], row["expert"]) == (_module(layer), index)
        assert (rows[DENSE]["layer"], rows[DENSE]["expert"]) == (None, None)
        if p != math.inf:
            assert abs(sum(row["share"] for row in by["by_expert"]) - 1.0) <= 1e-9
            contributions = [row["norm"] for row in by["by_expert"]]
            assert contributions == sorted(contributions, reverse=True)


@pytest.mark.parametrize("naming", ["sequential", "grouped"])
def test_zeros_by_expert_against_the_unsharded_gradients(tmp_path: Path, naming: str) -> None:
    """Exact zeros per expert, the EGTP padding of the experts' fc1 excluded."""
    layout = LAYOUTS["gtp2-dp2-ep2-egtp2-padded"]
    grads = _grads(naming)
    grads[next(iter(_expert_params(naming, 1, 2)))][:3] = 0.0  # more zeros in one expert
    directory = _write(tmp_path, naming, layout, grads)
    code, plain = _cli("zeros", directory, "--sort", "module")
    code_by, by = _cli("zeros", directory, "--sort", "module", "--by", "expert")
    assert code == code_by == 0
    assert {
        key: value for key, value in by.items() if key not in ("by_expert", "experts_left_out")
    } == plain
    members = _members(naming)
    # Module order: layer 0's experts by index, layer 1's, then the dense row.
    assert [row["name"] for row in by["by_expert"]] == list(members)
    for row in by["by_expert"]:
        tensors = [grads[name] for name in members[row["name"]]]
        assert row["num_zeros"] == zeros_in(tensors), row["name"]
        assert row["num_elements"] == sum(tensor.numel() for tensor in tensors)
    assert sum(row["padding_excluded"] for row in by["by_expert"]) == plain["padding_excluded"] > 0
    _, most = _cli("zeros", directory, "--by", "expert", "--top", "3")
    counts = [row["num_zeros"] for row in most["by_expert"]]
    assert counts == sorted(counts, reverse=True) and len(counts) == 3
    assert most["experts_left_out"] == len(members) - 3


def test_unplaced_expert_parameters_have_a_row_of_their_own(tmp_path: Path) -> None:
    """A stacked expert weight stored flat (legacy GroupedMLP's ``weight1``, [hidden, E * ffn]:
    its shape does not say E) is not split: its norm is in the ``other expert parameters`` row,
    and the rows still add up."""
    stacked = f"{_module(0)}.weight1"
    grads = {
        "embedding.word_embeddings.weight": torch.randn(16, HIDDEN),
        stacked: torch.randn(HIDDEN, 4 * FFN),
    }
    specs = [
        ParamLayout("embedding.word_embeddings.weight", "column"),
        ParamLayout(stacked, "none", expert=0, num_experts=1),
    ]
    layout = Layout(tp=2)
    write_snapshot(tmp_path, layout, shard_gradients(layout, specs, grads), step=1)
    _, report = _cli("norm", tmp_path, "--by", "expert")
    rows = {row["name"]: row for row in report["by_expert"]}
    assert sorted(rows) == [DENSE, OTHER]
    assert rel_err(rows[OTHER]["norm"], float64_norm([grads[stacked]], 2)) <= 1e-6
    table = CliRunner().invoke(
        app, ["norm", str(tmp_path), "--by", "expert"], env={"COLUMNS": "200"}
    )
    assert OTHER in table.stdout and "no expert recognised by name" in table.stdout


def test_tables_show_expert_rows_and_a_bad_by_is_refused(tmp_path: Path) -> None:
    directory = _write(tmp_path, "grouped", LAYOUTS["tp2-ep2-etp2"])
    env = {"COLUMNS": "200"}
    for command in ("norm", "zeros"):
        result = CliRunner().invoke(app, [command, str(directory), "--by", "expert"], env=env)
        assert result.exit_code == 0, result.output
        assert f"{_module(1)}[3]" in result.stdout and DENSE in result.stdout
        assert "linear_fc1.weight3" not in result.stdout  # rows per expert, not per parameter
    result = CliRunner().invoke(app, ["norm", str(directory), "--by", "layer"])
    assert result.exit_code == 2 and "--by 'layer' is not a row kind" in result.output


# --- audit ---------------------------------------------------------------------------------


def _findings(report: dict[str, Any]) -> list[tuple[str, str]]:
    return [(finding["kind"], finding["name"]) for finding in report["findings"]]


@pytest.mark.parametrize("naming", ["sequential", "grouped"])
def test_an_expert_no_token_reached_is_found(tmp_path: Path, naming: str) -> None:
    layout = LAYOUTS["tp2-pp2-dp2-ep2-distopt"]
    grads = _grads(naming)
    for name in _expert_params(naming, 1, 1):
        grads[name].zero_()
    code, report = _cli("audit", _write(tmp_path / "planted", naming, layout, grads))
    assert code == 1 and _findings(report) == [("expert_never_routed", f"{_module(1)}[1]")]
    (finding,) = report["findings"]
    assert finding["norm_if_miscounted"] is None and finding["ranks"]
    assert rel_err(report["total_norm"], float64_norm(list(grads.values()), 2)) <= 1e-6
    # Negative controls: the clean model, and a layer where every expert is zero (no batch, or
    # no router: not one expert singled out).
    code, report = _cli("audit", _write(tmp_path / "clean", naming, layout))
    assert code == 0 and report["findings"] == []
    grads = _grads(naming)
    for index in range(EXPERTS):
        for name in _expert_params(naming, 1, index):
            grads[name].zero_()
    code, report = _cli("audit", _write(tmp_path / "all-zero", naming, layout, grads))
    assert code == 0 and report["findings"] == []


def test_a_router_cut_off_from_the_loss_is_found(tmp_path: Path) -> None:
    layout = LAYOUTS["tp2-ep2-etp2"]
    grads = _grads("sequential")
    grads[_router(0)].zero_()
    code, report = _cli("audit", _write(tmp_path / "router", "sequential", layout, grads))
    assert code == 1 and _findings(report) == [("router_zero", _router(0))]
    # Negative control: the router is zero because its layer's experts are too (nothing routed).
    for index in range(EXPERTS):
        for name in _expert_params("sequential", 0, index):
            grads[name].zero_()
    code, report = _cli("audit", _write(tmp_path / "layer", "sequential", layout, grads))
    assert code == 0 and report["findings"] == []


def _drop(names: set[str]) -> Callable[[list[RankParams]], None]:
    def plant(ranks: list[RankParams]) -> None:
        for share in ranks:
            for name, param in share.params:
                if name in names:
                    param.grad = None

    return plant


@pytest.mark.parametrize("naming", ["sequential", "grouped"])
def test_experts_and_parameters_without_any_gradient(tmp_path: Path, naming: str) -> None:
    layout = Layout(tp=2, dp=2, ep=2)
    gone = set(_expert_params(naming, 0, 3))
    frozen = "decoder.layers.1.input_layernorm.weight"  # dense: frozen by choice, no finding
    directory = _write(tmp_path / "gone", naming, layout, plant=_drop(gone | {frozen, _router(1)}))
    code, report = _cli("audit", directory)
    found = _findings(report)
    # The expert once (not its three parameters), then the router; not the dense parameter.
    assert code == 1 and found == [
        ("no_gradient", f"{_module(0)}[3]"),
        ("no_gradient", _router(1)),
    ], found
    by_name = {finding["name"]: finding for finding in report["findings"]}
    assert by_name[_router(1)]["ranks"] == list(range(layout.world_size))  # every rank has it
    holders = {
        share.rank
        for share in shard_gradients(layout, _specs(naming, 1), _grads(naming))
        if any(name in gone for name, _ in share.params)
    }
    assert set(by_name[f"{_module(0)}[3]"]["ranks"]) == holders
    # One parameter of an expert without a gradient is that parameter's finding, not the
    # expert's; the expert's other parameters still count.
    (one,) = sorted(gone)[:1]
    code, report = _cli("audit", _write(tmp_path / "one", naming, layout, plant=_drop({one})))
    assert code == 1 and _findings(report) == [("no_gradient", one)]

    # Negative controls: a frozen dense parameter alone, and a gradient dropped on one of the
    # ranks holding it (the expert's other data-parallel replica still has one).
    def some(ranks: list[RankParams]) -> None:
        holders = [share for share in ranks if any(name in gone for name, _ in share.params)]
        assert len(holders) == 2  # the expert's two expert-data-parallel replicas
        _drop(gone)(holders[1:])

    for plant in (_drop({frozen}), some):
        code, report = _cli("audit", _write(tmp_path / plant.__name__, naming, layout, plant=plant))
        assert code == 0 and report["findings"] == [], plant.__name__


# --- the sample data -------------------------------------------------------------------------


def _sample_script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "make_sample_data", SAMPLE_DATA / "make_sample_data.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


UNREACHED = "decoder.layers.1.mlp.experts[2]"


@pytest.mark.parametrize(
    "sample",
    [
        "tp2-pp2-dp2-ep2-distopt",
        "gtp2-pp2-dp2-ep2",
        "tp2-pp2-dp2-ep2-distopt-nan",
        "tp2-gtp2-pp2-ep2-bugs",
    ],
)
def test_the_sample_datas_unreached_expert_is_found(sample: str) -> None:
    """Expert 2 of layer 1 gets no token in every sample snapshot: audit says so once, and
    nothing else of experts or routers (the router's row for expert 2 is zero, not all of it)."""
    _, report = _cli("audit", SAMPLE_DATA / sample)
    expert_kinds = {"expert_never_routed", "no_gradient", "router_zero"}
    found = [item for item in _findings(report) if item[0] in expert_kinds]
    assert found == [("expert_never_routed", UNREACHED)]


def test_the_sample_datas_experts_against_float64() -> None:
    script = _sample_script()
    grads = script.full_gradients().grads
    _, report = _cli("norm", SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt", "--by", "expert")
    _, zeros = _cli("zeros", SAMPLE_DATA / "gtp2-pp2-dp2-ep2", "--by", "expert")
    norms = {row["name"]: row for row in report["by_expert"]}
    counts = {row["name"]: row for row in zeros["by_expert"]}
    for index in range(script.EXPERTS):
        prefix = f"decoder.layers.{script.MOE_LAYER}.mlp.experts.local_experts.{index}."
        tensors = [grad for name, grad in grads.items() if name.startswith(prefix)]
        label = f"decoder.layers.{script.MOE_LAYER}.mlp.experts[{index}]"
        expected = float64_norm(tensors, 2)
        if index == script.UNREACHED_EXPERT:
            assert norms[label]["norm"] == expected == 0.0
        else:
            assert rel_err(norms[label]["norm"], expected) <= 1e-6, label
        assert counts[label]["num_zeros"] == zeros_in(tensors), label
    dense = [grad for name, grad in grads.items() if ".experts." not in name]
    assert rel_err(norms[DENSE]["norm"], float64_norm(dense, 2)) <= 1e-6


def test_the_json_schema_documents_the_expert_rows(tmp_path: Path) -> None:
    directory = _write(tmp_path, "sequential", LAYOUTS["tp2-ep2-etp2"])
    text = (SAMPLE_DATA.parent / "docs" / "cli.md").read_text()
    schema = text[text.index("## JSON schema") :]
    for command in ("norm", "zeros"):
        entry = re.search(rf"^- `{command}`: (.*?)(?=^- )", schema, re.S | re.M)
        assert entry, command
        documented = set(re.findall(r'"(\w+)"', entry.group(1)))
        _, document = _cli(command, directory, "--by", "expert")
        keys = set(document) | {key for row in document["by_expert"] for key in row}
        # The snapshot object and "warnings" are documented once, for every document.
        assert '"warnings"' in schema.split("\n- ")[0]
        assert keys <= documented | {"snapshot", "warnings"}, (command, keys - documented)
        assert {"by_expert", "experts_left_out"} <= documented


@pytest.mark.multiprocess
@pytest.mark.slow
def test_under_torchrun_the_expert_rows_and_findings_are_one_processs(tmp_path: Path) -> None:
    """2 processes over the sample's 8 rank files print byte for byte what one prints."""
    sample = SAMPLE_DATA / "tp2-gtp2-pp2-ep2-bugs"
    for args in (["norm", "--by", "expert"], ["zeros", "--by", "expert"], ["audit"]):
        alone = run_gradstat(*args[:1], sample, *args[1:], "--json")
        launched = run_gradstat(*args[:1], sample, *args[1:], "--json", nproc=2)
        assert launched.returncode == alone.returncode, launched.stderr
        assert launched.stdout == alone.stdout, args
    assert UNREACHED in alone.stdout


# --- stacked [E, ...] expert tensors ----------------------------------------------------------

STACKED_EXPERTS = 4
STACKED_MODULE = "layers.0.moe.experts"


def _stacked_grads() -> dict[str, torch.Tensor]:
    """torchtitan's GroupedExperts: w1, w2 of shape [E, ...]; expert 3 never routed (zero)."""
    generator = torch.Generator().manual_seed(30)
    grads = {
        "tok_embeddings.weight": torch.randn(16, HIDDEN, generator=generator),
        "layers.0.moe.router.gate.weight": torch.randn(
            STACKED_EXPERTS, HIDDEN, generator=generator
        ),
        f"{STACKED_MODULE}.w1": torch.randn(STACKED_EXPERTS, 6, HIDDEN, generator=generator),
        f"{STACKED_MODULE}.w2": torch.randn(STACKED_EXPERTS, HIDDEN, 6, generator=generator),
    }
    for name in (f"{STACKED_MODULE}.w1", f"{STACKED_MODULE}.w2"):
        grads[name][::2].mul_(1e3)  # even experts dominate, so a swapped index shows
        grads[name][3].zero_()
        grads[name].view(-1)[::7] = 0.0
    return grads


def _check_stacked_rows(directory: Path, grads: dict[str, torch.Tensor]) -> None:
    """norm/zeros --by expert give each stacked expert its row, against float64 of the rows;
    the totals and parameter rows are those of --by param; audit finds expert 3."""
    stacked = [name for name in grads if name.startswith(STACKED_MODULE)]
    for norm_type in NORM_TYPES:
        p = float(norm_type)
        _, plain = _cli("norm", directory, "-p", norm_type)
        _, by = _cli("norm", directory, "-p", norm_type, "--by", "expert")
        assert {key: by[key] for key in plain} == plain
        rows = {row["name"]: row for row in by["by_expert"]}
        assert sorted(rows) == sorted([DENSE, *(f"{STACKED_MODULE}[{e}]" for e in range(4))])
        for index in range(STACKED_EXPERTS):
            row = rows[f"{STACKED_MODULE}[{index}]"]
            expected = float64_norm([grads[name][index] for name in stacked], p)
            if index == 3:
                assert row["norm"] == expected == 0.0
            else:
                assert rel_err(row["norm"], expected) <= 1e-6, (index, norm_type)
            assert row["params"] == 2 and row["expert"] == index
    _, zeros = _cli("zeros", directory, "--by", "expert")
    by_label = {row["name"]: row for row in zeros["by_expert"]}
    for index in range(STACKED_EXPERTS):
        expected = sum(zeros_in(grads[name][index]) for name in stacked)
        assert by_label[f"{STACKED_MODULE}[{index}]"]["num_zeros"] == expected
    code, report = _cli("audit", directory)
    assert code == 1 and _findings(report) == [("expert_never_routed", f"{STACKED_MODULE}[3]")]


def test_stacked_expert_tensors_split_per_expert_on_ep_ranks(tmp_path: Path) -> None:
    """Plain tensors on 2 EP ranks, each holding 2 experts' rows: EP rank e's row r is
    expert 2e + r."""
    from gradstat.snapshot import save_rank
    from tests._params import param_with

    grads = _stacked_grads()
    for rank in range(2):
        named = []
        for name, grad in grads.items():
            if name.startswith(STACKED_MODULE):
                named.append((name, param_with(grad.chunk(2)[rank].clone(), allreduce=False)))
            else:
                named.append((name, param_with(grad.clone())))
        coords = {"dp": [rank, 2], "ep": [rank, 2]}
        save_rank(tmp_path, named, rank=rank, world_size=2, coords=coords, step=1)
    _check_stacked_rows(tmp_path, grads)


def _stacked_dtensor_job(rank: int, world_size: int, directory: str) -> None:
    """w1 Shard(0) over the 2 ranks (experts 0-1 and 2-3), w2 Shard(1) (every expert on both
    ranks, half of each row), the rest replicated; dumped with dump_rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from gradstat.snapshot import dump_rank

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    named = []
    for name, grad in _stacked_grads().items():
        placement = {"w1": Shard(0), "w2": Shard(1)}.get(name.rpartition(".")[2], Replicate())
        sharded = distribute_tensor(grad, mesh, [placement], src_data_rank=None)
        param = torch.nn.Parameter(torch.zeros_like(sharded))
        param.grad = sharded
        named.append((name, param))
    dump_rank(directory, named, step=1)


@pytest.mark.multiprocess
def test_stacked_expert_dtensors_split_by_their_row_offsets(tmp_path: Path) -> None:
    from gradstat.testing import Case, launch

    directory = tmp_path / "snapshot"
    report = launch(2, tmp_path, [Case("stacked", _stacked_dtensor_job, str(directory))])
    assert not report.problems, report.problems
    report.values("stacked")
    _check_stacked_rows(directory, _stacked_grads())
