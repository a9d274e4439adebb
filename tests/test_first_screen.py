"""A newcomer's first screen (issue 25 item 16), run as a user runs it.

Names are never broken, whatever the width; `zeros` takes `--top` and `--sort`; the trigger
that took a snapshot is shown; a DTensor snapshot says nothing of optimizers or experts it does
not have, and a mesh dimension of size 1 shards nothing; counts are singular or plural; the
inf norm's column is no share; compare gives B/A; a run directory is named with its
snapshots; history's zero-count rule follows a change, not a high count; and the docs say what
the tool does (the JSON keys of every command, the options of every command, DTensor compare).
Every run is ``python -m gradstat`` in a subprocess, parsed as JSON where there is JSON.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from gradstat.cli.app import app
from gradstat.snapshot import save_rank
from gradstat.testing.spawn import spawn
from tests._cli import ROOT, SAMPLE_DATA, run_gradstat
from tests._oracle import float64_norm
from tests._params import param_with

CLI_MD = ROOT / "docs" / "cli.md"
# A name as deep as a wrapped model's gets (activation checkpointing, compile, LoRA): longer,
# with its table, than the 160 columns a pipe gets.
LONG = (
    "_orig_mod._checkpoint_wrapped_module.model.language_model.encoder.layers.23."
    "self_attention.query_key_value.lora_adapter.lora_A.default.weight"
)
OTHER = "model.language_model.encoder.layers.23.post_attention_layernorm.weight"


def _gradstat(*args: Any, columns: int | None = 80) -> Any:
    """The command in this process (Typer's runner: stdout a pipe, COLUMNS as given)."""
    env = {"COLUMNS": str(columns) if columns is not None else None}
    return CliRunner().invoke(app, [str(arg) for arg in args], env=env)


def _lines(result: Any) -> list[str]:
    return list(result.stdout.splitlines())


def _table_lines(result: Any) -> list[str]:
    return [line for line in _lines(result) if line[:1] in "┏┃┡│└"]


def _json(*args: Any) -> tuple[int, Any]:
    result = _gradstat(*args, "--json")
    assert result.exit_code in (0, 1), result.stderr
    return result.exit_code, json.loads(result.stdout)


def _write(
    directory: Path,
    grads: dict[str, list[torch.Tensor]],
    step: int | None = 7,
    triggers: tuple[str, ...] = (),
) -> Path:
    """A snapshot of replicated parameters over TP ranks: ``grads[name][r]`` is rank r's copy."""
    tp = len(next(iter(grads.values())))
    for rank in range(tp):
        params = [(name, param_with(copies[rank].clone())) for name, copies in grads.items()]
        save_rank(
            directory,
            params,
            rank=rank,
            world_size=tp,
            coords={"tp": [rank, tp]},
            step=step,
            triggers=triggers,
        )
    return directory


def _grads(scale: float = 1.0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(25)
    return {
        LONG: torch.randn(6, 4, generator=generator) * scale,
        OTHER: torch.randn(8, generator=generator) * scale,
        "bias": torch.tensor([0.0, 0.0, 0.0, 1.5]) * scale,
    }


# ---------------------------------------------------------------------------------------------
# Names are never broken
# ---------------------------------------------------------------------------------------------


def _whole_on_a_line(name: str, stdout: str) -> bool:
    return any(name in line for line in stdout.splitlines())


@pytest.mark.parametrize("columns", [80, None])
def test_no_table_breaks_a_parameter_name(tmp_path: Path, columns: int | None) -> None:
    """At 80 columns (COLUMNS) and in a pipe (160): norm, zeros, inspect, compare, audit."""
    grads = _grads()
    a = _write(tmp_path / "a", {name: [grad, grad] for name, grad in grads.items()})
    # B: every parameter doubled, and rank 1's copy of LONG off (an audit finding).
    off = grads[LONG] * 2 + 1
    b = _write(
        tmp_path / "b",
        {name: [grad * 2, off if name == LONG else grad * 2] for name, grad in grads.items()},
    )
    runs = {
        "norm": _gradstat("norm", a, columns=columns),
        "zeros": _gradstat("zeros", a, columns=columns),
        "inspect": _gradstat("inspect", a, columns=columns),
        "compare": _gradstat("compare", a, b, columns=columns),
        "audit": _gradstat("audit", b, columns=columns),
    }
    for command, result in runs.items():
        assert result.exit_code in (0, 1), (command, result.stderr)
        for name in (LONG,) if command == "audit" else (LONG, OTHER):  # one finding: LONG's
            assert _whole_on_a_line(name, result.stdout), (command, name, result.stdout)
        assert "…" not in result.stdout, (command, result.stdout)
    # Tables that fit are drawn as rich draws them, within the width.
    small = _write(tmp_path / "small", {"w": [torch.ones(3)]})
    table = [line for line in _gradstat("norm", small).stdout.splitlines() if line[:1] in "┏┃┡│└"]
    assert table and max(len(line) for line in table) <= 80


def test_a_long_number_is_not_broken_either(tmp_path: Path) -> None:
    """The columns beside a long name keep their numbers whole (rich cut them with '…')."""
    grads = {LONG: torch.full((3,), 1.2345678e-7), OTHER: torch.full((2,), 9.87654e5)}
    a = _write(tmp_path / "a", {name: [grad] for name, grad in grads.items()})
    result = _gradstat("norm", a)
    norms = {name: float64_norm([grad], 2) for name, grad in grads.items()}
    for name, norm in norms.items():
        row = next(line for line in result.stdout.splitlines() if name in line)
        assert f"{norm:.6g}" in row, row


# ---------------------------------------------------------------------------------------------
# zeros: --top and --sort, as norm's --top
# ---------------------------------------------------------------------------------------------


def _sparse_grads() -> dict[str, torch.Tensor]:
    """Five parameters: zero counts 0, 3, 1, 6, 2 of sizes 4, 4, 2, 12, 8."""

    def with_zeros(size: int, zeros: int) -> torch.Tensor:
        grad = torch.arange(1.0, size + 1.0)
        grad[:zeros] = 0.0
        return grad

    return {
        "p0": with_zeros(4, 0),
        "p1": with_zeros(4, 3),
        "p2": with_zeros(2, 1),
        "p3": with_zeros(12, 6),
        "p4": with_zeros(8, 2),
    }


def test_zeros_top_and_sort(tmp_path: Path) -> None:
    grads = _sparse_grads()
    snapshot = _write(tmp_path / "s", {name: [grad] for name, grad in grads.items()})
    counts = {name: int((grad == 0).sum()) for name, grad in grads.items()}
    sparsity = {name: counts[name] / grad.numel() for name, grad in grads.items()}
    _, every = _json("zeros", snapshot)
    assert [row["name"] for row in every["params"]] == sorted(counts, key=lambda n: -counts[n])
    assert every["params_left_out"] == 0 and every["sort"] == "zeros"
    assert every["num_zeros"] == sum(counts.values())
    _, top = _json("zeros", snapshot, "--top", "2", "--sort", "sparsity")
    # 3/4, then 1/2 twice (p2 and p3, in module order)
    assert [row["name"] for row in top["params"]] == sorted(sparsity, key=lambda n: -sparsity[n])[
        :2
    ]
    assert top["params_left_out"] == 3
    assert top["num_zeros"] == sum(counts.values())  # the totals are the whole snapshot's
    _, module = _json("zeros", snapshot, "--sort", "module")
    assert [row["name"] for row in module["params"]] == list(grads)
    table = _gradstat("zeros", snapshot, "--top", "3")
    assert "(3 of 5 shown)" in table.stdout
    assert re.findall(r"\bp\d\b", table.stdout) == ["p3", "p1", "p4"]
    bad = _gradstat("zeros", snapshot, "--sort", "size")
    assert bad.exit_code == 2 and bad.stderr.count("\n") == 1
    assert "--sort 'size'" in bad.stderr and "zeros, sparsity, module" in bad.stderr


# ---------------------------------------------------------------------------------------------
# The trigger that took a snapshot
# ---------------------------------------------------------------------------------------------


def test_the_trigger_is_shown_by_norm_inspect_and_history(tmp_path: Path) -> None:
    grads = _grads()
    run = tmp_path / "run"
    _write(run / "step-00000005", {n: [g] for n, g in grads.items()}, 5, ("every",))
    _write(run / "step-00000009", {n: [g * 30] for n, g in grads.items()}, 9, ("spike", "every"))
    _write(run / "step-00000010", {n: [g] for n, g in grads.items()}, 10, ("every",))
    spiked = run / "step-00000009"
    for command in ("norm", "inspect", "zeros", "audit"):
        _, document = _json(command, spiked)
        assert document["snapshot"]["triggers"] == ["spike", "every"], command
        header = _gradstat(command, spiked).stdout.splitlines()[0]
        assert header.endswith("step 9, triggers: spike, every"), (command, header)
    header = _gradstat("norm", run / "step-00000005").stdout.splitlines()[0]
    assert header.endswith("step 5, trigger: every")
    _, history = _json("history", run)
    assert [entry["triggers"] for entry in history["snapshots"]] == [
        ["every"],
        ["spike", "every"],
        ["every"],
    ]
    text = _gradstat("history", run).stdout
    assert "taken by the flight recorder's triggers: every at 5, 9, 10; spike at 9" in text
    # A snapshot dumped by hand has none, and says none.
    hand = _write(tmp_path / "hand", {n: [g] for n, g in grads.items()})
    _, document = _json("norm", hand)
    assert document["snapshot"]["triggers"] == []
    assert _lines(_gradstat("norm", hand))[0] == f"{hand}: 1 rank, plain optimizer, step 7"


# ---------------------------------------------------------------------------------------------
# DTensor snapshots: no optimizer, no experts, no shards over a size-1 dimension
# ---------------------------------------------------------------------------------------------


def _dtensor_job(rank: int, world_size: int, root: str) -> int:
    """FSDP2 on a (2,) mesh and HSDP on a (2, 1) mesh: the same model and data."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradstat.snapshot import dump_rank

    meshes = {
        "fsdp2": ((world_size,), ("dp_shard",)),
        "hsdp": ((world_size, 1), ("dp_replicate", "dp_shard")),
    }
    for job, (shape, names) in meshes.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
        fully_shard(model, mesh=init_device_mesh("cpu", shape, mesh_dim_names=names))
        model(torch.arange(8.0).reshape(2, 4)).sum().backward()
        dump_rank(f"{root}/{job}", model, step=3)
    return rank


@pytest.fixture(scope="module")
def dtensor_snapshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dtensor")
    assert spawn(2, _dtensor_job, str(root), timeout_s=300) == [0, 1]
    return root


@pytest.mark.multiprocess
def test_dtensor_snapshots_say_only_what_applies(dtensor_snapshots: Path) -> None:
    for job in ("fsdp2", "hsdp"):
        snapshot = dtensor_snapshots / job
        for command in ("norm", "zeros", "inspect", "audit"):
            text = _gradstat(command, snapshot).stdout
            header = text.splitlines()[0]
            assert header == f"{snapshot}: 2 ranks, DTensor gradients, step 3", (command, text)
            assert "optimizer" not in text, (command, text)
            assert "expert" not in text, (command, text)
        _, document = _json("norm", snapshot)
        assert document["snapshot"]["dtensor"] is True and document["has_experts"] is False
        compare = _gradstat("compare", snapshot, snapshot).stdout
        assert "expert" not in compare and "optimizer" not in compare, compare


@pytest.mark.multiprocess
def test_a_mesh_dimension_of_size_1_shards_nothing(dtensor_snapshots: Path) -> None:
    """HSDP 2x1: every rank holds a whole replica; FSDP2 over 2 ranks holds shards."""
    _, hsdp = _json("inspect", dtensor_snapshots / "hsdp")
    assert hsdp["notes"] == []
    assert "note:" not in _gradstat("inspect", dtensor_snapshots / "hsdp").stdout
    _, fsdp2 = _json("inspect", dtensor_snapshots / "fsdp2")
    assert len(fsdp2["notes"]) == 1 and "4 DTensor gradients are sharded" in fsdp2["notes"][0]


@pytest.mark.multiprocess
def test_dtensor_snapshots_compare_element_by_element(dtensor_snapshots: Path) -> None:
    """What docs/cli.md says: DTensor shards are placed by their offsets and compared element
    by element (FSDP2's shards against HSDP's whole replicas, the same gradients)."""
    code, report = _json("compare", dtensor_snapshots / "fsdp2", dtensor_snapshots / "hsdp")
    assert code == 0 and report["mismatches"] == []
    for param in report["params"]:
        assert param["not_rebuilt"] is None and param["max_abs_diff"] is not None, param
        assert param["shape_a"] == param["shape_b"] is not None
    text = CLI_MD.read_text()
    assert "DTensor and Megatron-FSDP\nshards are compared by norm only" not in text
    assert "DTensor shards are placed by their `global_offset`" in " ".join(text.split())


# ---------------------------------------------------------------------------------------------
# Singular and plural
# ---------------------------------------------------------------------------------------------


def test_one_is_singular(tmp_path: Path) -> None:
    grads = {"w": torch.tensor([1.0, 2.0])}
    one = _write(tmp_path / "one", {name: [grad] for name, grad in grads.items()})
    header = _gradstat("norm", one).stdout.splitlines()[0]
    assert header == f"{one}: 1 rank, plain optimizer, step 7"
    inspect = _gradstat("inspect", one).stdout
    assert "1 file," in inspect and "1 files" not in inspect
    audit = _gradstat("audit", one).stdout
    assert "1 parameter checked" in audit
    # One finding: rank 1's copy of a replicated parameter differs.
    two = _write(tmp_path / "two", {"w": [grads["w"], grads["w"] + 1], "v": [torch.ones(2)] * 2})
    result = _gradstat("audit", two)
    assert result.exit_code == 1
    assert re.search(r"\b1 finding\b", result.stdout) and "1 findings" not in result.stdout
    assert "2 parameters checked" in result.stdout
    # Three TP ranks, one of which says allreduce=False: an attribute on 1 rank.
    odd = tmp_path / "odd"
    for rank in range(3):
        param = param_with(torch.ones(2), **({"allreduce": False} if rank == 2 else {}))
        save_rank(odd, [("w", param)], rank=rank, world_size=3, coords={"tp": [rank, 3]})
    _, report = _json("audit", odd)
    (attribute,) = report["findings"]
    assert attribute["kind"] == "attributes" and attribute["ranks"] == [2]
    assert "on 1 rank but" in attribute["detail"], attribute["detail"]
    # The planted sample: one GTP padding element of 1024 is not zero.
    _, planted = _json("audit", SAMPLE_DATA / "tp2-gtp2-pp2-ep2-bugs")
    (padding,) = [item for item in planted["findings"] if item["kind"] == "gtp_padding_nonzero"]
    assert padding["detail"].startswith("1 of 1024 GTP padding elements is not zero:")


# ---------------------------------------------------------------------------------------------
# The inf norm: no share that sums past 100%
# ---------------------------------------------------------------------------------------------


def test_the_inf_norm_shows_no_share(tmp_path: Path) -> None:
    grads = _grads()
    snapshot = _write(tmp_path / "s", {name: [grad] for name, grad in grads.items()})
    _, report = _json("norm", snapshot, "-p", "inf")
    total = max(float64_norm([grad], math.inf) for grad in grads.values())
    assert report["total_norm"] == total
    for row in report["params"]:
        assert row["share"] is None
        assert row["ratio"] == pytest.approx(float64_norm([grads[row["name"]]], math.inf) / total)
    text = "\n".join(_table_lines(_gradstat("norm", snapshot, "-p", "inf", columns=None)))
    assert "share" not in text and "|g|" in text  # "max |g| / total", maybe over two lines
    percents = [float(value) for value in re.findall(r"([\d.]+)%", text)]
    assert len(percents) == 3 and max(percents) == 100.0 and sum(percents) > 100.0
    # The L2 shares are shares: they sum to 1.
    _, l2 = _json("norm", snapshot)
    assert math.isclose(sum(row["share"] for row in l2["params"]), 1.0, rel_tol=1e-9)
    for row in l2["params"]:
        expected = float64_norm([grads[row["name"]]], 2) / float64_norm(list(grads.values()), 2)
        assert row["ratio"] == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# compare: B/A
# ---------------------------------------------------------------------------------------------


def test_compare_gives_b_over_a(tmp_path: Path) -> None:
    grads = _grads()
    a = _write(tmp_path / "a", {name: [grad] for name, grad in grads.items()})
    b_grads = {**grads, OTHER: grads[OTHER] * 100.0, "bias": grads["bias"] * 10.0}
    b = _write(tmp_path / "b", {name: [grad] for name, grad in b_grads.items()})
    code, report = _json("compare", a, b)
    assert code == 1
    rows = {row["name"]: row for row in report["params"]}
    for name in grads:
        expected = float64_norm([b_grads[name]], 2) / float64_norm([grads[name]], 2)
        assert rows[name]["ratio"] == pytest.approx(expected, rel=1e-6), name
    assert rows[OTHER]["rel_diff"] == pytest.approx(0.99, abs=1e-6)  # saturated: 100x
    assert rows["bias"]["rel_diff"] == pytest.approx(0.9, abs=1e-6)  # 10x
    totals = {total["measure"]: total for total in report["totals"]}
    expected = float64_norm(list(b_grads.values()), 2) / float64_norm(list(grads.values()), 2)
    assert totals["total_norm"]["ratio"] == pytest.approx(expected, rel=1e-6)
    text = _gradstat("compare", a, b, columns=None).stdout
    assert "B/A" in text
    assert re.search(rf"{re.escape(OTHER)} .*│\s+100x │", text), text
    assert re.search(r"bias .*│\s+10x │", text), text


# ---------------------------------------------------------------------------------------------
# A run directory where a snapshot is wanted
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["norm", "zeros", "inspect", "audit", "compare"])
def test_a_run_directory_is_named_with_its_snapshots(tmp_path: Path, command: str) -> None:
    grads = {"w": [torch.ones(2)]}
    run = tmp_path / "run"
    for step in (9, 17, 20):
        _write(run / f"step-{step:08d}", grads, step)
    (run / ".step-00000021.partial").mkdir()
    args = [run, run] if command == "compare" else [run]
    result = _gradstat(command, *args)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == (
        f"gradstat: error: {run} holds 3 snapshots (step-00000009, step-00000017, "
        f"step-00000020), not rank files; pass one of them, or use gradstat history {run}\n"
    )


# ---------------------------------------------------------------------------------------------
# history: zeros jump on a change, findings by kind
# ---------------------------------------------------------------------------------------------


def test_history_zero_rule_ignores_an_embeddings_unseen_rows(tmp_path: Path) -> None:
    """An embedding whose unseen rows are 20-40% of it every step, a layer whose norm jumps 50x
    at step 6, and a bias that goes all zero at step 4 (a real change of its zero count)."""
    generator = torch.Generator().manual_seed(5)
    unseen = {1: 8, 2: 5, 3: 7, 4: 5, 5: 8, 6: 4, 7: 6}  # of 20 rows
    for step, rows in unseen.items():
        embedding = torch.randn(20, 3, generator=generator)
        embedding[:rows] = 0.0
        layer = torch.randn(4, 4, generator=generator) * (50.0 if step == 6 else 1.0)
        bias = torch.zeros(4) if step >= 4 else torch.randn(4, generator=generator)
        grads = {"embedding.weight": [embedding], "layer.weight": [layer], "bias": [bias]}
        _write(tmp_path / f"step-{step:08d}", grads, step, ("every",))
    _, document = _json("history", tmp_path)
    jumps = {row["name"]: row["first_jump"] for row in document["params"]}
    assert jumps["embedding.weight"] is None
    assert jumps["layer.weight"]["step"] == 6 and jumps["layer.weight"]["kind"] == "norm"
    assert jumps["layer.weight"]["ratio"] > 10
    assert jumps["bias"] == {"step": 4, "kind": "zeros"}
    lines = _gradstat("history", tmp_path).stdout.splitlines()
    order = [
        next(index for index, line in enumerate(lines) if name in line)
        for name in ("bias", "layer.weight", "embedding.weight")
    ]
    assert order == sorted(order), lines  # who moved first (the bias, at 4) first
    assert "7 snapshots" in lines[0]
    _, inf = _json("history", tmp_path, "-p", "inf")  # the inf norm's JSON (it raised)
    assert inf["norm_type"] == "inf" and len(inf["snapshots"]) == 7


# ---------------------------------------------------------------------------------------------
# The docs say what the tool does
# ---------------------------------------------------------------------------------------------


def _schema_section() -> str:
    text = CLI_MD.read_text()
    return text[text.index("## JSON schema") :]


def _documented(command: str) -> set[str]:
    """The quoted keys of ``command``'s bullet in docs/cli.md's JSON schema."""
    section = _schema_section()
    match = re.search(rf"^- `{command}`: (.*?)(?=^- |\Z)", section, re.S | re.M)
    assert match, f"docs/cli.md's JSON schema has no entry for {command}"
    return set(re.findall(r'"(\w+)"', match.group(1)))


def _keys(document: Any) -> set[str]:
    """Every key of ``document``, at any depth (but the axis names of inspect's ``axes``)."""
    if isinstance(document, dict):
        # inspect's axes are named by their axis: data, not keys of the schema
        inner = [value for key, value in document.items() if key != "axes"]
        return set(document) | {key for value in inner for key in _keys(value)}
    if isinstance(document, list):
        return {key for value in document for key in _keys(value)}
    return set()


def test_every_json_key_is_documented(tmp_path: Path) -> None:
    grads = _grads()
    a = _write(tmp_path / "run" / "step-00000007", {n: [g, g] for n, g in grads.items()})
    b = _write(tmp_path / "b", {n: [g, g * 2] for n, g in grads.items()})
    snapshot_keys = set(re.findall(r'"(\w+)"', _schema_section().split("\n\n")[1]))
    documents = {
        "norm": _json("norm", a, "--max-norm", "1")[1],
        "zeros": _json("zeros", a)[1],
        "clip": _json("clip", a, "--max-norm", "0.1", "--out", tmp_path / "c")[1],
        "inspect": _json("inspect", a)[1],
        "compare": _json("compare", a, b)[1],
        "audit": _json("audit", b)[1],
        "history": _json("history", tmp_path / "run")[1],
    }
    for command, document in documents.items():
        carried = {"snapshot"} | ({"a", "b"} if command == "compare" else set())
        for key in carried & set(document):
            if isinstance(document[key], dict):
                assert set(document[key]) <= snapshot_keys, (command, document[key])
                assert set(document[key]) == set(documents["norm"]["snapshot"])
        undocumented = _keys(document) - _documented(command) - snapshot_keys
        assert not undocumented, (command, undocumented)
    # The snapshot object is in the documents that say it is.
    for command in ("norm", "zeros", "inspect", "audit"):
        assert isinstance(documents[command]["snapshot"], dict), command
    assert isinstance(documents["clip"]["snapshot"], str)
    assert "in every document" not in " ".join(CLI_MD.read_text().split())


def _help_options(command: str) -> set[str]:
    result = run_gradstat(command, "--help", env={"COLUMNS": "200"})
    return set(re.findall(r"(--[a-z][a-z-]+)", result.stdout)) - {"--help"}


def test_the_synopsis_gives_every_commands_options() -> None:
    text = CLI_MD.read_text()
    synopsis = re.findall(r"^    gradstat (\w+) (.*)$", text, re.M)
    assert {command for command, _ in synopsis} == {
        "norm",
        "zeros",
        "clip",
        "inspect",
        "compare",
        "audit",
        "history",
        "explain",
    }
    sentence = re.search(r"\n\n(`\w+`[^.]*?also take `--device.*?)\.", text, re.S)
    assert sentence, "docs/cli.md names the commands that take --device and --timeout"
    with_device = set(re.findall(r"`(\w+)`", sentence.group(1).split("also take")[0]))
    sources = re.findall(r"every\s+command\s+also\s+takes\s+(.*?),\s+which\s+say", text, re.S)
    assert len(sources) == 2, "docs/cli.md names the options of wgrads dumps and checkpoints"
    wgrads = {option for said in sources for option in re.findall(r"(--[a-z][a-z-]+)", said)}
    for command, line in synopsis:
        options = set(re.findall(r"(--[a-z][a-z-]+)", line)) | {"--status-file"} | wgrads
        if command in with_device:
            options |= {"--device", "--timeout"}
        assert options == _help_options(command), command


def test_history_shows_a_run_of_routine_snapshots_as_a_range() -> None:
    from types import SimpleNamespace

    from gradstat.cli.render import _triggered

    every_step = SimpleNamespace(steps=list(range(1, 13)), triggers=[("every",)] * 12)
    assert _triggered(every_step.steps, every_step.triggers) == "every at 1 .. 12"
    strided = SimpleNamespace(
        steps=[5, 9, 10, 15, 20, 25],
        triggers=[("every",), ("spike",), ("every",), ("every",), ("every",), ("every",)],
    )
    assert _triggered(strided.steps, strided.triggers) == "every at 5, 10, 15 .. 25; spike at 9"
    # Steps 5, 9, 10 have no one stride: each is named.
    uneven = SimpleNamespace(
        steps=[5, 9, 10], triggers=[("every",), ("every", "spike"), ("every",)]
    )
    assert _triggered(uneven.steps, uneven.triggers) == "every at 5, 9, 10; spike at 9"
