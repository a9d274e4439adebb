"""gradstat against megatron-core 0.16.1 itself, on 8 gloo CPU processes with Megatron's real
``parallel_state`` (TP=2 x PP=2 x DP=2 with a tied embedding, EP=2 x ETP=2 experts), the plain
and the distributed optimizer, and against the unsharded float64 oracle.

Megatron's functions run from its own source (tests/_megatron.py says how its CUDA devices are
pointed at the CPU); its optimizer's selection and chaining code runs unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gradstat.testing import Case, launch
from tests import _jobs
from tests._cli import run_gradstat
from tests._jobs import Job
from tests._oracle import float64_norm, rel_err, zeros_in

# Looked up, not imported: Megatron is imported only by the ranks, never by the test process.
if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed (the parity extra)", allow_module_level=True)

from tests._megatron import NORM_TYPES, run_clip_and_empty, run_parity

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning"),
]

LAYOUT = Job("tp2-pp2-dp2-ep2", tp=2, pp=2, dp=2, ep=2, etp=2, moe=True)
# Megatron's no-TE fallback reduces each tensor in fp32; gradstat combines in float64.
MEGATRON_RTOL, GRADSTAT_RTOL = 1e-6, 1e-9
# The snapshot reader's one-pass kernel sums each fp32 chunk in fp32 lanes (5e-9 seen here).
SNAPSHOT_RTOL = 1e-7


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("megatron-snapshots")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, snapshots: Path) -> list[dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("megatron-parity")
    case = Case("parity", run_parity, (LAYOUT, str(snapshots)))
    return launch(LAYOUT.world_size, run_dir, [case], timeout_s=400).values("parity")


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir: Path = tmp_path_factory.mktemp("megatron-clip")
    return launch(1, run_dir, [Case("clip", run_clip_and_empty)], timeout_s=200).values("clip")[0]


def _oracle() -> dict[str, dict[str, Any]]:
    grads = _jobs.oracle_grads(moe=True)
    return {
        part: {
            "norms": {p: float64_norm(grads[part], p) for p in NORM_TYPES},
            "zeros": zeros_in(grads[part]),
        }
        for part in ("dense", "expert", "total")
    }


def _parts(ranks: list[dict[str, Any]]) -> Iterator[tuple[int, str, str, dict[str, Any]]]:
    for rank, result in enumerate(ranks):
        for kind in ("plain", "distopt"):
            for part in ("dense", "expert"):
                yield rank, kind, part, result[kind][part]


def test_megatron_places_ranks_as_the_independent_sharder_does(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        dense, expert = result["coords"]
        assert (dense, expert) == LAYOUT.view_coords(rank)


def test_gradstat_selects_the_tensors_megatrons_optimizer_selects(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, kind, part, stats in _parts(ranks):
        assert stats["same_selection"], (rank, kind, part)
        # No group given: read from Megatron's parallel_state, as Megatron does.
        assert stats["same_bare_selection"], (rank, kind, part)


def test_norms_equal_megatrons_and_the_float64_oracle(ranks: list[dict[str, Any]]) -> None:
    oracle = _oracle()
    for rank, kind, part, stats in _parts(ranks):
        for p in NORM_TYPES:
            megatron, ours = stats["megatron"]["norms"][p], stats["gradstat"]["norms"][p]
            expected = oracle[part]["norms"][p]
            where = (rank, kind, part, p, megatron, ours, expected)
            if p == math.inf:
                assert megatron == ours == expected, where
            else:
                assert rel_err(megatron, expected) <= MEGATRON_RTOL, where
                assert rel_err(ours, expected) <= GRADSTAT_RTOL, where
                assert rel_err(ours, megatron) <= MEGATRON_RTOL, where
        assert stats["megatron_optimizer_norm"] == stats["megatron"]["norms"][2.0]


def test_zero_counts_equal_megatrons_exactly(ranks: list[dict[str, Any]]) -> None:
    oracle = _oracle()
    for rank, kind, part, stats in _parts(ranks):
        expected = oracle[part]["zeros"]
        where = (rank, kind, part, stats["megatron"]["zeros"], stats["gradstat"]["zeros"], expected)
        assert stats["megatron"]["zeros"] == stats["gradstat"]["zeros"] == expected, where
        assert stats["gradstat_bare_zeros"] == expected, where
    for result in ranks:
        for kind in ("plain", "distopt"):
            assert result[kind]["zeros_type"] == ("float", "float"), "the same type as Megatron's"


def test_the_chained_optimizer_combines_what_gradstat_combines(ranks: list[dict[str, Any]]) -> None:
    """Plain: dense and expert reduce over different groups, and Megatron's ChainedOptimizer
    takes sqrt(dense^2 + expert^2); distributed: one shared group, one call over both."""
    oracle = _oracle()["total"]
    for rank, result in enumerate(ranks):
        for kind in ("plain", "distopt"):
            chained = result[kind]["chained"]
            dense, expert = (result[kind][part]["gradstat"] for part in ("dense", "expert"))
            ours = math.hypot(dense["norms"][2.0], expert["norms"][2.0])
            assert rel_err(chained["megatron_norm"], oracle["norms"][2.0]) <= MEGATRON_RTOL
            assert rel_err(ours, oracle["norms"][2.0]) <= GRADSTAT_RTOL, (rank, kind)
            assert chained["megatron_zeros"] == dense["zeros"] + expert["zeros"] == oracle["zeros"]


def test_clipping_is_bitwise_megatrons(single: dict[str, Any]) -> None:
    for key, outcome in single["clip"].items():
        assert outcome["bitwise"], key
        _attr, _dtype, max_norm = key
        coefficient = max_norm / (3.0 + 1e-6)
        for scaled_by in outcome["scaled_by"]:
            expected = coefficient if coefficient < 1 else 1.0
            tolerance = 1e-2 if "bfloat16" in _dtype else 1e-6
            assert abs(scaled_by - expected) <= tolerance * expected, (key, scaled_by)


def test_empty_lists(single: dict[str, Any]) -> None:
    """megatron-core 0.16.1 still crashes on an empty list for p != 2 (NVIDIA/Megatron-LM#5529,
    fixed by PR #5530 in later versions); gradstat gives 0.0, as the fixed Megatron does."""
    for p, outcome in single["empty"].items():
        assert outcome["gradstat"] == 0.0
        if p == 2.0:
            assert outcome["megatron"] == 0.0
        else:
            assert isinstance(outcome["megatron"], str), (p, outcome)
    assert single["empty_zeros"] == {"megatron": 0.0, "gradstat": 0.0}


def _cli(*args: str) -> dict[str, Any]:
    result = run_gradstat(*args, "--json")
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


@pytest.mark.parametrize("kind", ["plain", "distopt"])
def test_a_snapshot_dumped_from_live_megatron_gives_megatrons_numbers(
    ranks: list[dict[str, Any]], snapshots: Path, kind: str
) -> None:
    """dump_rank with no coordinates given (read from Megatron's parallel_state), then the CLI:
    the numbers Megatron's optimizer computed live, and the float64 oracle's."""
    oracle = _oracle()
    live = ranks[0][kind]
    norm = _cli("norm", str(snapshots / kind))
    assert rel_err(norm["total_norm"], live["chained"]["megatron_norm"]) <= MEGATRON_RTOL
    assert rel_err(norm["total_norm"], oracle["total"]["norms"][2.0]) <= SNAPSHOT_RTOL
    for part in ("dense", "expert"):
        megatron = live[part]["megatron"]["norms"][2.0]
        assert rel_err(norm[f"{part}_norm"], megatron) <= MEGATRON_RTOL, part
    zeros = _cli("zeros", str(snapshots / kind))
    assert zeros["num_zeros"] == live["chained"]["megatron_zeros"] == oracle["total"]["zeros"]
    for p, flag in ((1.0, "1"), (math.inf, "inf")):
        other = _cli("norm", str(snapshots / kind), "-p", flag)
        assert rel_err(other["total_norm"], oracle["total"]["norms"][p]) <= SNAPSHOT_RTOL
    # The one finding (exit status 1): the tests' GPT routes no token to ZERO_EXPERT, per layer.
    audit = run_gradstat("audit", str(snapshots / kind), "--json")
    assert audit.returncode == 1, audit.stderr
    found = [(item["kind"], item["name"]) for item in json.loads(audit.stdout)["findings"]]
    unrouted = f"mlp.experts[{_jobs.ZERO_EXPERT}]"
    assert found == [
        ("expert_never_routed", f"decoder.layers.{layer}.{unrouted}")
        for layer in range(_jobs.LAYERS)
    ]


CP_LAYOUT = Job("tp2-cp2-dp2", tp=2, cp=2, dp=2)


@pytest.fixture(scope="module")
def cp_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("megatron-parity-cp")
    snapshots = tmp_path_factory.mktemp("megatron-snapshots-cp")
    case = Case("parity", run_parity, (CP_LAYOUT, str(snapshots)))
    return launch(CP_LAYOUT.world_size, run_dir, [case], timeout_s=400).values("parity")


def test_context_parallel_statistics_equal_megatrons_and_float64(
    cp_ranks: list[dict[str, Any]],
) -> None:
    """TP=2 x CP=2 x DP=2 under Megatron's parallel_state: CP ranks hold copies; the plain
    optimizer reduces over its model-parallel group (CP left out), the distributed one shards
    over DP x CP and reduces over every rank. Megatron's own functions and gradstat's agree."""
    grads = _jobs.oracle_grads(moe=False)["dense"]
    for rank, result in enumerate(cp_ranks):
        dense, _expert = result["coords"]
        assert dense == CP_LAYOUT.view_coords(rank)[0]
        for kind in ("plain", "distopt"):
            stats = result[kind]["dense"]
            assert stats["same_selection"] and stats["same_bare_selection"], (rank, kind)
            for p in NORM_TYPES:
                megatron, ours = stats["megatron"]["norms"][p], stats["gradstat"]["norms"][p]
                expected = float64_norm(grads, p)
                if p == math.inf:
                    assert megatron == ours == expected
                else:
                    assert rel_err(megatron, expected) <= MEGATRON_RTOL, (rank, kind, p)
                    assert rel_err(ours, expected) <= GRADSTAT_RTOL, (rank, kind, p)
            zeros = stats["megatron"]["zeros"], stats["gradstat"]["zeros"]
            assert zeros == (zeros_in(grads),) * 2, (rank, kind)
