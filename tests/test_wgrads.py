"""Megatron's `--save-wgrads-interval` dumps read as they are, by every command.

The dumps are written by tests/_wgrads.py's own sharder, as megatron-core 0.19's ``save_grads``
writes them, from known logical gradients; the expected numbers are their float64 statistics
(tests/test_wgrads_megatron.py does the same with megatron-core's own GPTModel jobs).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests._cli import run_gradstat
from tests._wgrads import Layout, Model, close, run_cli

LAYOUTS = {
    "tp2": Layout(tp=2),
    "pp2-tied": Layout(pp=2),
    "pp2-untied": Layout(pp=2, tied=False),
    "pp1-untied": Layout(tied=False),
    "tp2-pp2-vpp2-uneven": Layout(tp=2, pp=2, vpp=2, layers=(3, 1, 2, 1)),
    "ep2": Layout(ep=2, experts=4),
    "tp2-ep2-grouped-te": Layout(tp=2, ep=2, experts=4, grouped=True, te=True),
    "tp2-ep4-etp1": Layout(tp=2, ep=4, etp=1, experts=8),
    "tp2-pp2-ep2-tied": Layout(tp=2, pp=2, ep=2, experts=4),
    # BERT's and T5's encoder.layers.N, numbered from 0 on each stage as the decoder's are
    "tp2-pp2-vpp2-encoder": Layout(tp=2, pp=2, vpp=2, block="encoder"),
}


def _dump(tmp_path: Path, layout: Layout, iteration: int = 100, seed: int = 0) -> Path:
    folder = tmp_path / "wgrads" / f"iter_{iteration:07d}"
    Model.make(layout, seed).write(folder)
    return folder


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_norms_and_zeros_are_the_logical_gradients(name: str, tmp_path: Path) -> None:
    layout = LAYOUTS[name]
    model = Model.make(layout)
    folder = _dump(tmp_path, layout)
    for p, flag in ((2.0, "2"), (1.0, "1"), (math.inf, "inf")):
        status, document, stderr = run_cli("norm", folder, "-p", flag, "--json")
        assert status == 0, stderr
        assert close(document["total_norm"], model.norm(p)), (p, document["total_norm"])
        assert document["snapshot"]["step"] == 100
        assert document["snapshot"]["source"] == "megatron-wgrads"
    status, document, _ = run_cli("norm", folder, "--json")
    expected = model.param_norms()
    got = {row["name"]: row["norm"] for row in document["params"]}
    assert got.keys() == expected.keys()  # global names, each logical tensor once
    assert all(close(got[param], expected[param]) for param in expected)
    status, document, stderr = run_cli("zeros", folder, "--json")
    assert status == 0, stderr
    assert document["num_zeros"] == model.zeros
    assert document["num_elements"] == sum(t.grad.numel() for t in model.tensors.values())
    status, document, stderr = run_cli("audit", folder, "--json")
    assert status == 0, (stderr, document)


def test_inspect_says_why_and_from_where(tmp_path: Path) -> None:
    folder = _dump(tmp_path, Layout(tp=2, pp=2, ep=2, experts=4))
    status, document, stderr = run_cli("inspect", folder, "--json")
    assert status == 0, stderr
    rows = {row["name"]: row for row in document["params"]}
    fc1 = rows["decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1["expert"] and fc1["tensor_parallel"] and fc1["partition_dim"] == 0
    assert "'*.linear_fc1.weight'" in fc1["rule"]
    # Stage 1, EP rank 1: its local layer 1, local expert 1, on both TP ranks.
    assert sorted(fc1["sources"]) == [
        f"mp_rank_0{tp}_001_001.pth:model_chunk0/"
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
        for tp in (0, 1)
    ]
    norm = rows["decoder.layers.0.input_layernorm.weight"]
    assert not norm["tensor_parallel"] and "full copy" in norm["rule"]
    assert len(norm["sources"]) == 4  # 2 TP x 2 EP files of stage 0: one counted
    output = rows["output_layer.weight"]
    assert output["shared"] and "tied copy" in output["rule"]
    status, text, _ = run_cli("inspect", folder)
    assert status == 0 and "Megatron wgrads dump" in text and "name rule" in text


def test_untied_output_counts_and_the_option_overrules(tmp_path: Path) -> None:
    model = Model.make(Layout(pp=2, tied=False))
    folder = tmp_path / "iter_0000007"
    model.write(folder)
    _, document, _ = run_cli("inspect", folder, "--json")
    output = {row["name"]: row for row in document["params"]}["output_layer.weight"]
    assert not output["shared"] and "untied" in output["rule"]
    # Said tied, the output layer is taken for the embedding's copy and left out.
    _, document, _ = run_cli("norm", folder, "--json", "--tied-output", "yes")
    without = {n: t for n, t in model.tensors.items() if n != "output_layer.weight"}
    expected = math.sqrt(sum(float((t.grad.double() ** 2).sum()) for t in without.values()))
    assert close(document["total_norm"], expected)
    # ... and audit says the copies differ.
    status, document, _ = run_cli("audit", folder, "--json", "--tied-output", "yes")
    assert status == 1
    assert any(f["kind"] == "tied_copies_differ" for f in document["findings"])


def test_a_name_no_rule_knows_is_refused_until_stated(tmp_path: Path) -> None:
    folder = _dump(tmp_path, Layout(tp=2))
    for path in folder.iterdir():
        chunks = torch.load(path)
        chunks["model_chunk0"]["decoder.layers.0.my_adapter.weight"] = torch.ones(4, 8)
        torch.save(chunks, path)
    status, _, stderr = run_cli("norm", folder)
    assert status == 2
    assert "'decoder.layers.0.my_adapter.weight'" in stderr
    assert "--tp-sharded" in stderr and "--tp-replicated" in stderr
    assert stderr.count("\n") == 1
    model = Model.make(Layout(tp=2))
    base = sum(float((t.grad.double() ** 2).sum()) for t in model.tensors.values())
    _, replicated, _ = run_cli("norm", folder, "--json", "--tp-replicated", "*.my_adapter.*")
    assert close(replicated["total_norm"], math.sqrt(base + 32))
    _, sharded, _ = run_cli("norm", folder, "--json", "--tp-sharded", "*.my_adapter.weight=0")
    assert close(sharded["total_norm"], math.sqrt(base + 64))
    status, _, stderr = run_cli("norm", folder, "--tp-sharded", "*.my_adapter.weight")
    assert status == 2 and "PATTERN=DIM" in stderr


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing_tp_file", "no file for TP rank 1, EP rank 0"),
        ("missing_stage_file", "mp_rank_01_001.pth: missing: pipeline stage 1 has 1 files"),
        # Megatron names a PP or EP rank only when that size is over 1: rank 0 alone is cut.
        ("missing_last_stage", "ends in pipeline rank 0"),
        ("missing_last_ep_rank", "ends in expert-parallel rank 0"),
        ("missing_last_of_four_ep_ranks", "router.weight routes to 4 experts, but the files"),
        ("two_layouts", "rank suffixes"),
        ("stage_lacks_a_param", "has no 'decoder.layers.0.self_attention.linear_proj.bias'"),
        ("shapes_differ", "not shards of one Megatron layout"),
        ("not_a_dump", "a Megatron wgrads file holds model_chunkN/<parameter name> tensors"),
        # one global name on two stages was one row of both stages' gradients
        ("one_name_on_two_stages", "(pipeline stage 0): its block's layers are not numbered"),
    ],
)
def test_what_cannot_be_placed_is_refused(case: str, message: str, tmp_path: Path) -> None:
    folder = _dump(tmp_path, Layout(tp=2, pp=2))
    if case == "missing_tp_file":
        folder = _dump(tmp_path / "ep", Layout(tp=2, ep=2, experts=4))
        (folder / "mp_rank_01_000.pth").unlink()
    elif case == "missing_stage_file":
        (folder / "mp_rank_01_001.pth").unlink()
    elif case == "missing_last_stage":
        for path in folder.glob("mp_rank_*_001.pth"):
            path.unlink()
    elif case == "missing_last_ep_rank":
        folder = _dump(tmp_path / "ep", Layout(pp=2, ep=2, experts=4))
        for path in folder.glob("mp_rank_00_*_001.pth"):
            path.unlink()
    elif case == "missing_last_of_four_ep_ranks":
        folder = _dump(tmp_path / "ep", Layout(ep=4, experts=4))
        (folder / "mp_rank_00_003.pth").unlink()
    elif case == "two_layouts":
        shutil.copy(folder / "mp_rank_00_000.pth", folder / "mp_rank_00.pth")
    elif case == "stage_lacks_a_param":
        path = folder / "mp_rank_01_000.pth"
        chunks = torch.load(path)
        del chunks["model_chunk0"]["decoder.layers.0.self_attention.linear_proj.bias"]
        torch.save(chunks, path)
    elif case == "shapes_differ":
        path = folder / "mp_rank_01_000.pth"
        chunks = torch.load(path)
        chunks["model_chunk0"]["decoder.layers.0.mlp.linear_fc1.weight"] = torch.ones(4, 8)
        torch.save(chunks, path)
    elif case == "one_name_on_two_stages":
        for tp_rank in range(2):
            path = folder / f"mp_rank_{tp_rank:02d}_000.pth"
            chunks = torch.load(path)
            chunks["model_chunk0"]["decoder.final_layernorm.weight"] = torch.ones(8)
            torch.save(chunks, path)
    elif case == "not_a_dump":
        torch.save(
            {"model": {"w": torch.ones(2)}, "step": torch.ones(1)}, folder / "mp_rank_00_000.pth"
        )
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    for command in ("norm", "zeros", "audit", "inspect"):
        status, _, stderr = run_cli(command, folder)
        assert status == 2, (command, stderr)
        assert message in stderr, stderr
        assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before


def test_a_last_stage_without_output_layer_or_final_norm_is_warned_of(tmp_path: Path) -> None:
    """PP=3 without stage 2 reads as PP=2: nothing in the names says otherwise, but stage 1
    holds neither the output layer nor the final norm that a GPT model's last stage holds."""
    folder = _dump(tmp_path, Layout(pp=3))
    status, _, stderr = run_cli("norm", folder)
    assert status == 0 and "warning" not in stderr, stderr
    (folder / "mp_rank_00_002.pth").unlink()
    status, _, stderr = run_cli("norm", folder)
    assert status == 0
    assert "the last pipeline stage found (1) holds neither output_layer.weight" in stderr


def test_gtp_and_a_wrong_expert_tp_are_refused(tmp_path: Path) -> None:
    folder = _dump(tmp_path, Layout(tp=2, ep=4, etp=1, experts=8))
    status, _, stderr = run_cli("norm", folder, "--gtp", "2")
    assert status == 2 and "GTP" in stderr and "--gtp 2" in stderr
    status, _, stderr = run_cli("norm", folder, "--etp", "2")
    assert status == 2 and "--etp 2" in stderr
    status, document, _ = run_cli("inspect", folder, "--json", "--etp", "1")
    assert status == 0 and document["axes"]["etp"] == 1 and document["axes"]["ep"] == 4


def test_audit_finds_copies_that_differ(tmp_path: Path) -> None:
    folder = _dump(tmp_path, Layout(tp=2, ep=2, experts=4))
    name = "decoder.layers.1.input_layernorm.weight"
    path = folder / "mp_rank_01_000.pth"  # TP rank 1: a replicated layernorm (Megatron-LM#1446)
    chunks = torch.load(path)
    chunks["model_chunk0"][name] = chunks["model_chunk0"][name] + 1.0
    torch.save(chunks, path)
    path = folder / "mp_rank_00_001.pth"  # EP rank 1: a dense tensor repeated in its file
    chunks = torch.load(path)
    dense = "decoder.layers.0.self_attention.linear_proj.weight"
    chunks["model_chunk0"][dense] = chunks["model_chunk0"][dense] * 2
    torch.save(chunks, path)
    status, document, _ = run_cli("audit", folder, "--json")
    assert status == 1
    kinds = {(finding["kind"], finding["name"]) for finding in document["findings"]}
    assert ("tp_replicas_differ", name) in kinds, kinds
    assert any(found == dense for _, found in kinds), kinds


def test_compare_two_layouts_of_one_model(tmp_path: Path) -> None:
    one = _dump(tmp_path / "a", Layout(tp=2, pp=2, vpp=2, layers=(3, 1, 2, 1)))
    other = _dump(tmp_path / "b", Layout(pp=1, layers=(7,)))
    status, document, stderr = run_cli("compare", one, other, "--json")
    assert status == 0, (stderr, document)
    changed = _dump(tmp_path / "c", Layout(pp=1, layers=(7,)), seed=1)
    status, document, _ = run_cli("compare", one, changed, "--json")
    assert status == 1


def test_clip_writes_a_dump_of_the_same_layout(tmp_path: Path) -> None:
    layout = Layout(tp=2, pp=2)
    model = Model.make(layout)
    folder = _dump(tmp_path, layout)
    out = tmp_path / "clipped" / "iter_0000100"
    total = model.norm(2.0)
    status, _, stderr = run_cli(
        "clip", folder, "--max-norm", str(total / 4), "--out", out, "--json"
    )
    assert status == 0, stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in folder.iterdir())
    _, clipped, _ = run_cli("norm", out, "--json")
    assert abs(clipped["total_norm"] - total / 4) <= 1e-6 * total
    original = torch.load(folder / "mp_rank_01_001.pth")
    scaled = torch.load(out / "mp_rank_01_001.pth")
    assert original.keys() == scaled.keys()
    for chunk, tensors in original.items():
        assert list(tensors) == list(scaled[chunk])


def test_history_over_the_wgrads_folder(tmp_path: Path) -> None:
    layout = Layout(tp=2)
    for iteration, seed in ((100, 0), (200, 0), (300, 5)):
        _dump(tmp_path, layout, iteration, seed)
    status, document, stderr = run_cli("history", tmp_path / "wgrads", "--json")
    assert status == 0, stderr
    assert [entry["step"] for entry in document["snapshots"]] == [100, 200, 300]
    expected = [Model.make(layout, seed).norm(2.0) for seed in (0, 0, 5)]
    assert all(
        close(e["total_norm"], x) for e, x in zip(document["snapshots"], expected, strict=True)
    )
    status, _, stderr = run_cli("norm", tmp_path / "wgrads")
    assert status == 2 and "history" in stderr


def test_a_whole_command_in_a_fresh_process(tmp_path: Path) -> None:
    layout = Layout(tp=2, ep=2, experts=4)
    folder = _dump(tmp_path, layout)
    result = run_gradstat("norm", folder, "--json")
    assert result.returncode == 0, result.stderr
    assert close(json.loads(result.stdout)["total_norm"], Model.make(layout).norm(2.0))


def test_a_missing_last_tp_file_is_warned_of(tmp_path: Path) -> None:
    folder = _dump(tmp_path, Layout(tp=2))
    (folder / "mp_rank_01.pth").unlink()  # what remains reads as a TP 1 job
    result = run_gradstat("norm", folder)
    assert result.returncode == 0
    warning = [line for line in result.stderr.splitlines() if line]
    assert len(warning) == 1 and warning[0].startswith("gradstat: warning: ")
    assert "TP 2 if the attention is as wide as the hidden size" in warning[0]
    # A JSON document carries it too: a script reading stdout alone saw a calm total, exit 0.
    for command in ("norm", "zeros", "audit", "inspect"):
        status, document, _ = run_cli(command, folder, "--json")
        assert status == 0, command
        assert document["warnings"] == [warning[0].removeprefix("gradstat: warning: ")], command
    complete = _dump(tmp_path / "complete", Layout(tp=2))
    assert run_gradstat("norm", complete).stderr == ""
    assert run_cli("norm", complete, "--json")[1]["warnings"] == []


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchrun_splits_the_files_and_prints_the_same(tmp_path: Path) -> None:
    folder = _dump(tmp_path, Layout(tp=2, pp=2, ep=2, experts=4))
    for command in (("norm", "-p", "1"), ("zeros",), ("audit",)):
        alone = run_gradstat(*command, folder, "--json")
        shared = run_gradstat(*command, folder, "--json", nproc=2)
        assert shared.returncode == alone.returncode == 0, shared.stderr
        assert shared.stdout == alone.stdout


def test_multi_latent_attention_down_projections_by_their_shapes(tmp_path: Path) -> None:
    folder = _dump(tmp_path, Layout(tp=2))
    added = {  # per TP file: q down duplicated (TE spec), kv down split (local spec)
        "decoder.layers.0.self_attention.linear_q_down_proj.weight": torch.ones(6, 8),
        "decoder.layers.0.self_attention.linear_q_up_proj.weight": torch.ones(4, 6),
        "decoder.layers.0.self_attention.linear_kv_down_proj.weight": torch.ones(5, 8),
        "decoder.layers.0.self_attention.linear_kv_up_proj.weight": torch.ones(4, 8),
    }
    for path in folder.iterdir():
        chunks = torch.load(path)
        chunks["model_chunk0"].update(added)
        torch.save(chunks, path)
    _, document, _ = run_cli("inspect", folder, "--json")
    rows = {row["name"]: row for row in document["params"]}
    q_down = rows["decoder.layers.0.self_attention.linear_q_down_proj.weight"]
    kv_down = rows["decoder.layers.0.self_attention.linear_kv_down_proj.weight"]
    assert not q_down["tensor_parallel"] and "shape evidence" in q_down["rule"]
    assert kv_down["tensor_parallel"] and kv_down["partition_dim"] == 0
    assert "column-parallel" in kv_down["rule"]
    model = Model.make(Layout(tp=2))
    base = sum(float((t.grad.double() ** 2).sum()) for t in model.tensors.values())
    _, document, _ = run_cli("norm", folder, "--json")
    assert close(document["total_norm"], math.sqrt(base + 48 + 2 * (24 + 40 + 32)))
