"""sample_data/: the generator is deterministic, and its snapshots give the unsharded statistics.

The model and its gradients come from the script itself (imported from its path); the expected
statistics are computed here, in float64, from those unsharded gradients.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors import safe_open

import gradstat
from gradstat.analysis.stats import SnapshotStats, snapshot_stats
from gradstat.snapshot import Snapshot
from gradstat.testing import Layout, LayoutError, ParamLayout, shard_gradients
from tests._oracle import float64_norm, rel_err, zeros_in

SAMPLE_DATA = Path(__file__).resolve().parents[1] / "sample_data"
SCRIPT = SAMPLE_DATA / "make_sample_data.py"
NORM_TYPES = (2.0, 1.0, math.inf)


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_sample_data", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


sample = _load_script()
CLEAN = (sample.DISTOPT, sample.GTP)
ALL = (*CLEAN, sample.NAN, sample.BUGS)


@pytest.fixture(scope="module")
def grads() -> dict[str, torch.Tensor]:
    return dict(sample.full_gradients().grads)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The four snapshots, generated in this process into a fresh directory."""
    out = tmp_path_factory.mktemp("sample_data")
    assert sample.generate(out) == 0
    return out


def _files(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*.safetensors"))
    }


def _stats(directory: Path) -> SnapshotStats:
    return snapshot_stats(Snapshot.open(directory), NORM_TYPES)


def test_a_second_run_writes_byte_identical_files(generated: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    first, second = _files(generated), _files(tmp_path)
    assert len(first) == len(ALL) * 8
    assert first == second
    # stdout is the figures table only: a header, the oracle and one row per snapshot.
    rows = result.stdout.splitlines()
    assert [row.split()[0] for row in rows[1:]] == ["unsharded", *ALL]


# How far a committed value may sit from a fresh one, relative to its tensor's largest |element|.
# The gradients come from a real fp32 backward pass, whose sums run in an order that depends on
# the CPU's vector width and thread count: an element that is a small difference of large terms
# can move by many of its own ulps, so an element-wise relative tolerance fails on another
# machine. Scaled to the tensor, the differences measured between two machines stay below 1e-6
# (7 fp32 ulps of the largest element); 1e-4 leaves room for other CPUs and still catches any
# real change (a misplaced shard, a wrong scale, a lost row all move a tensor by O(1)).
SAME_GRADIENT_RTOL = 1e-4


def _assert_same_gradient(old: torch.Tensor, new: torch.Tensor, label: str) -> None:
    """Equal dtype, shape and non-finite elements; finite values equal to SAME_GRADIENT_RTOL."""
    assert (old.dtype, old.shape) == (new.dtype, new.shape), label
    assert torch.equal(old.isnan(), new.isnan()), label
    assert torch.equal(old.isposinf(), new.isposinf()), label
    assert torch.equal(old.isneginf(), new.isneginf()), label
    finite = old.isfinite()
    if not finite.any():
        return
    old64, new64 = old[finite].double(), new[finite].double()
    scale = float(old64.abs().max())
    worst = float((old64 - new64).abs().max())
    assert worst <= SAME_GRADIENT_RTOL * scale, f"{label}: max |diff| {worst:.3g}, max |x| {scale}"


def test_the_committed_files_are_what_the_script_writes(generated: Path) -> None:
    """Same files, headers and attributes; values equal up to the CPU's fp32 summation order."""
    for name in ALL:
        committed, fresh = SAMPLE_DATA / name, generated / name
        assert sorted(_files(committed)) == sorted(_files(fresh)), name
        for path in sorted(fresh.glob("*.safetensors")):
            with (
                safe_open(str(path), framework="pt") as new,
                safe_open(str(committed / path.name), framework="pt") as old,
            ):
                assert json.loads(old.metadata()["gradstat"]) == json.loads(
                    new.metadata()["gradstat"]
                ), path.name
                assert sorted(old.keys()) == sorted(new.keys())
                for key in new.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    label = f"{name}/{path.name}: {key}"
                    _assert_same_gradient(old.get_tensor(key), new.get_tensor(key), label)


def test_the_tolerance_still_sees_a_real_change() -> None:
    """Negative control: a change far smaller than any layout bug is still caught."""
    grad = torch.linspace(-1.0, 1.0, 64)
    _assert_same_gradient(grad, grad + 8e-7 * (grad.abs() < 0.1), "measured drift")
    for changed in (grad.flip(0), grad * 1.001, torch.where(grad.abs() < 0.02, 0.0, grad)):
        with pytest.raises(AssertionError):
            _assert_same_gradient(grad, changed, "changed")


def test_existing_output_is_refused_without_force(generated: Path, tmp_path: Path) -> None:
    target = tmp_path / sample.GTP
    target.mkdir()
    mine = target / "notes.txt"
    mine.write_text("the user's")
    assert sample.main(["--out", str(tmp_path)]) == 2
    assert sorted(path.name for path in tmp_path.iterdir()) == [sample.GTP]
    assert sorted(target.iterdir()) == [mine]
    assert sample.main(["--out", str(tmp_path), "--force"]) == 0
    assert mine.read_text() == "the user's"
    assert _files(tmp_path) == _files(generated)


@pytest.mark.parametrize("source", ["generated", "committed"])
@pytest.mark.parametrize("name", CLEAN)
def test_snapshot_statistics_equal_the_unsharded_gradients(
    name: str, source: str, generated: Path, grads: dict[str, torch.Tensor]
) -> None:
    directory = (generated if source == "generated" else SAMPLE_DATA) / name
    snapshot = Snapshot.open(directory)
    assert (snapshot.world_size, snapshot.step) == (8, sample.STEP)
    stats = snapshot_stats(snapshot, NORM_TYPES)
    everything = list(grads.values())
    for norm_type in NORM_TYPES:
        expected, got = float64_norm(everything, norm_type), stats.norm(norm_type)
        if source == "generated" and norm_type == math.inf:
            assert got == expected
        else:
            assert rel_err(got, expected) <= 1e-6, norm_type
    assert stats.zeros == zeros_in(everything)
    assert stats.numel == sum(grad.numel() for grad in everything)
    by_name = {param.name: param for param in stats.params}
    assert sorted(by_name) == sorted(grads)  # each logical parameter once; no output copy
    for param_name, grad in grads.items():
        assert by_name[param_name].zeros == zeros_in([grad]), param_name
        assert by_name[param_name].numel == grad.numel(), param_name
        expected = float64_norm([grad], 2)
        assert math.isclose(by_name[param_name].norm(2), expected, rel_tol=1e-6, abs_tol=1e-12)


def test_nan_snapshot_names_the_broken_parameters(generated: Path) -> None:
    clean = {param.name: param for param in _stats(generated / sample.DISTOPT).params}
    stats = _stats(generated / sample.NAN)
    assert math.isnan(stats.norm(2.0)) and math.isnan(stats.norm(1.0))
    (nan_rank, nan_name, _), (inf_rank, inf_name, _) = sample.CORRUPTIONS
    by_name = {param.name: param for param in stats.params}
    assert math.isnan(by_name[nan_name].norm(2)) and nan_rank in by_name[nan_name].ranks
    assert by_name[inf_name].norm(2) == math.inf and inf_rank in by_name[inf_name].ranks
    assert by_name[inf_name].norm(math.inf) == math.inf
    for name, param in by_name.items():
        if name not in (nan_name, inf_name):
            assert param.norm(2) == clean[name].norm(2), name
    assert stats.zeros == sum(param.zeros for param in clean.values())


def test_nan_snapshot_inf_norm_is_nan(generated: Path) -> None:
    stats = _stats(generated / sample.NAN)
    nan_name = sample.CORRUPTIONS[0][1]
    by_name = {param.name: param for param in stats.params}
    assert math.isnan(by_name[nan_name].norm(math.inf))
    assert math.isnan(stats.norm(math.inf))


def test_unreached_expert_and_unused_vocabulary_have_exact_zero_gradients(
    generated: Path, grads: dict[str, torch.Tensor]
) -> None:
    gradients = sample.full_gradients()
    assert gradients.tokens_per_expert[sample.UNREACHED_EXPERT] == 0
    assert all(
        count > 0
        for index, count in enumerate(gradients.tokens_per_expert)
        if index != sample.UNREACHED_EXPERT
    )
    unreached = [name for name in grads if f"local_experts.{sample.UNREACHED_EXPERT}." in name]
    assert len(unreached) == 2
    stats = {param.name: param for param in _stats(generated / sample.GTP).params}
    for name in unreached:
        assert not grads[name].count_nonzero()
        assert stats[name].zeros == stats[name].numel == grads[name].numel()
    embedding = grads[sample.EMBEDDING]
    unused = list(sample.UNUSED_TOKENS)
    assert not embedding[unused].count_nonzero()
    used = [token for token in range(sample.VOCAB) if token not in sample.UNUSED_TOKENS]
    assert bool((embedding[used] != 0).any(dim=1).all())
    # What the file holds: rank 0 of the GTP layout has the whole embedding (TP=1, not GTP).
    with safe_open(str(generated / sample.GTP / "rank-00000.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor(sample.EMBEDDING), embedding)


def test_gtp_layout_has_padding_spilling_into_a_lower_rank(generated: Path) -> None:
    layout = sample.LAYOUTS[sample.GTP]
    multiple = layout.gtp_align * layout.gtp
    expected_pad = 0
    for name, grad in sample.full_gradients().grads.items():
        if name.endswith(sample._GTP_SHARDED):
            expected_pad += (-grad.shape[0] % multiple) * grad.shape[1]
    stats = _stats(generated / sample.GTP)
    assert stats.pad_zeros == expected_pad > 0
    # Expert 0's linear_fc1 has 16 rows, padded to 64: 48 rows of padding, 32 per EGTP shard,
    # so EGTP rank 0's shard ends in 16 padding rows and rank 1's is all padding.
    name = f"decoder.layers.{sample.MOE_LAYER}.mlp.experts.local_experts.0.linear_fc1.weight"
    snapshot = Snapshot.open(generated / sample.GTP)
    shards = {}
    for rank_file in snapshot.files:
        with rank_file.params() as params:
            for param in params:
                if param.name == name:
                    shards[rank_file.header.coords["egtp"][0]] = param.grad.clone()
                    assert param.pad_length == 48
    assert set(shards) == {0, 1}
    assert shards[0].shape == (32, sample.HIDDEN)
    assert shards[0][:16].count_nonzero() == 16 * sample.HIDDEN
    assert not shards[0][16:].count_nonzero() and not shards[1].count_nonzero()


def test_layout_rank_order_and_errors() -> None:
    layout = Layout(tp=2, gtp=2, dp=2, pp=2, ep=2, egtp=2)
    assert (layout.world_size, layout.edp) == (16, 2)
    # Stage 1, stage rank 5: tp 1, gtp 0, dp 1; ep 1, egtp 0, edp 1 (megatron-core 0.19's
    # expert order etp-ep-egtp-edp, read off its parallel_state by the parity script).
    coords = layout.coords(13)
    assert coords["pp"] == (1, 2) and coords["tp"] == (1, 2) and coords["gtp"] == (0, 2)
    assert coords["dp"] == (1, 2) and coords["egtp"] == (0, 2) and coords["ep"] == (1, 2)
    assert coords["edp"] == (1, 2) and coords["etp"] == (0, 1) and coords["cp"] == (0, 1)
    with pytest.raises(LayoutError, match="cannot be regrouped"):
        Layout(tp=2, ep=4)
    grad = {"w": torch.ones(3, 4)}
    with pytest.raises(LayoutError, match="needs dim 0 divisible by TP size 2"):
        shard_gradients(Layout(tp=2), [ParamLayout("w", "column")], grad)
    with pytest.raises(LayoutError, match="stage 1 is outside pp size 1"):
        shard_gradients(Layout(), [ParamLayout("w", stage=1)], grad)
    with pytest.raises(LayoutError, match="'v' is not a described parameter"):
        shard_gradients(Layout(), [ParamLayout("w")], {**grad, "v": torch.ones(1)})
    assert isinstance(LayoutError("x"), gradstat.GradstatError)


def test_bugs_snapshot_holds_the_three_planted_bugs(
    generated: Path, grads: dict[str, torch.Tensor]
) -> None:
    """gradstat audit finds each bug; the norms it gives come from float64 sums of squares."""
    from gradstat.analysis.audit import audit_snapshot
    from gradstat.distributed.runner import Processes

    report = audit_snapshot(Snapshot.open(generated / sample.BUGS), Processes(0, 1))
    found = {finding.kind: finding for finding in report.findings}
    # And the expert that no token reaches, which every sample snapshot has.
    assert len(found) == len(report.findings) == 4
    assert set(found) == {*sample.BUG_KINDS, "expert_never_routed"}
    unreached = f"decoder.layers.{sample.MOE_LAYER}.mlp.experts[{sample.UNREACHED_EXPERT}]"
    assert found["expert_never_routed"].name == unreached

    def squares(tensor: torch.Tensor) -> float:
        return float(tensor.double().square().sum())

    true = sum(squares(grad) for grad in grads.values())
    embedding, layernorm = squares(grads[sample.EMBEDDING]), squares(grads[sample.BUG_LAYERNORM])
    # As Megatron counts it: the tied embedding twice, and the 0.5 in the padding.
    counted = true + embedding + 0.25
    assert rel_err(report.total_norm, math.sqrt(counted)) <= 1e-6
    expected = {
        "tp_replicas_differ": counted - layernorm + 2.25 * layernorm,
        "gtp_padding_nonzero": counted - 0.25,
        "tied_copy_counted_twice": counted - embedding,
    }
    for kind, power in expected.items():
        norm = found[kind].norm_if_miscounted
        assert norm is not None and rel_err(norm, math.sqrt(power)) <= 1e-6, kind
    assert found["tp_replicas_differ"].name == sample.BUG_LAYERNORM
    assert found["gtp_padding_nonzero"].max_abs_diff == 0.5
    assert found["tied_copy_counted_twice"].name == sample.OUTPUT_LAYER
