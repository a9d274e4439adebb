"""Gradient norms and zero counts over real gloo process groups, against the unsharded oracle.

Every layout shards one small model's gradients the way Megatron lays them out, runs gradstat on
each rank with that rank's shard and groups, and compares every rank's answer with float64
statistics of the unsharded gradients. The layouts of one world size share a single spawn (a
process start costs seconds on two cores); each layout still passes or fails on its own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch import Tensor

from gradstat.testing import Case, LaunchReport, launch
from tests._jobs import (
    EMBEDDING,
    NORM_TYPES,
    DTensorCase,
    Job,
    dtensor_grads,
    full_grads,
    gtp_geometry,
    oracle_grads,
    run_dtensor,
    run_layout,
)
from tests._oracle import float64_norm, zeros_in

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

LAYOUTS = [
    # world size 2
    Job("tp2", tp=2),
    Job("gtp2", gtp=2),
    Job("dp2_ep2_moe", dp=2, ep=2, moe=True),
    # world size 4
    Job("tp2_pp2_tied", tp=2, pp=2),
    Job("tp2_dp2_plain", tp=2, dp=2),
    Job("tp2_dp2_distopt", tp=2, dp=2, distopt=True),
    Job("pp2_dp2_distopt_tied", pp=2, dp=2, distopt=True),
    Job("tp2_dp2_ep2_etp2_moe", tp=2, dp=2, ep=2, etp=2, moe=True),
    Job("gtp4_spill_axis_places", gtp=4, align=8, axis_places=True),
    Job("gtp2_dp2_distopt", gtp=2, dp=2, distopt=True),
    Job("gtp2_dp2_ep2_egtp2_moe_spill", gtp=2, dp=2, ep=2, egtp=2, moe=True, align=8),
    # world size 8
    Job("tp2_pp2_dp2_ep2_moe_distopt", tp=2, pp=2, dp=2, ep=2, moe=True, distopt=True),
    Job("tp2_gtp2_dp2_plain", tp=2, gtp=2, dp=2),
    Job("gtp4_dp2_distopt_spill", gtp=4, dp=2, align=8, distopt=True),
    Job("tp2_pp4_tied", tp=2, pp=4),
    Job("tp2_dp4_ep4_etp2_moe_distopt", tp=2, dp=4, ep=4, etp=2, moe=True, distopt=True),
    # Context parallelism: CP ranks hold copies; the plain optimizer's statistics group (model
    # parallel) leaves them out, the distributed optimizer shards over DP x CP.
    Job("tp2_cp2_plain", tp=2, cp=2),  # world size 4
    Job("cp2_dp2_distopt", cp=2, dp=2, distopt=True),
    Job("tp2_cp2_pp2_tied_plain", tp=2, cp=2, pp=2),  # world size 8
    Job("tp2_cp2_dp2_ep2_moe_distopt", tp=2, cp=2, dp=2, ep=2, moe=True, distopt=True),
    Job("gtp2_cp2_dp2_ep2_egtp2_moe_plain", gtp=2, cp=2, dp=2, ep=2, egtp=2, moe=True, align=8),
]

# Negative controls: the same machinery with one thing broken on purpose.
UNTIED = Job("neg_pp2_dp2_distopt_untied", pp=2, dp=2, distopt=True, untie_output_copy=True)
UNSTAMPED = Job("neg_gtp2_dp2_distopt_unstamped", gtp=2, dp=2, distopt=True, stamp_pad_zeros=False)
CP_SUMMED = Job("neg_tp2_cp2_plain_stats_over_cp", tp=2, cp=2, stats_over_cp=True)
NEGATIVE_CONTROLS = [UNTIED, UNSTAMPED, CP_SUMMED]

DTENSOR_CASES = [
    DTensorCase("dtensor_fsdp2", tp=1, dp=2),
    DTensorCase("dtensor_tp2_fsdp2", tp=2, dp=2),
    # A 2-D data-parallel mesh (Replicate, Shard(0)), reduced over both of its dimensions.
    DTensorCase("dtensor_hsdp_2x2", tp=1, dp=4, replicate=2),
    DTensorCase("dtensor_tp2_hsdp_2x2", tp=2, dp=4, replicate=2),
]


def _cases(world_size: int) -> list[Case]:
    layouts = [layout for layout in LAYOUTS + NEGATIVE_CONTROLS if layout.world_size == world_size]
    dtensors = [case for case in DTENSOR_CASES if case.world_size == world_size]
    return [Case(layout.name, run_layout, layout) for layout in layouts] + [
        Case(case.name, run_dtensor, case) for case in dtensors
    ]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], LaunchReport]:
    """One spawn per world size, shared by every case of that size (started on first use)."""
    reports: dict[int, LaunchReport | Exception] = {}

    def report(world_size: int) -> LaunchReport:
        if world_size not in reports:
            run_dir = tmp_path_factory.mktemp(f"world{world_size}")
            try:
                reports[world_size] = launch(world_size, run_dir, _cases(world_size))
            except Exception as error:  # failed to start: fail every case, start once
                reports[world_size] = error
        outcome = reports[world_size]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return report


def _expected(grads: list[Tensor], extra_zeros: int = 0) -> dict[str, Any]:
    """float64 norms and zero count of unsharded gradients, in the shape the ranks report."""
    norms = {p: float64_norm(grads, p) for p in NORM_TYPES}
    return {"norms": norms, "zeros": zeros_in(grads) + extra_zeros}


def _assert_matches(got: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    for p in NORM_TYPES:
        want = expected["norms"][p]
        if p == math.inf:
            assert got["norms"][p] == want, f"{what}: inf-norm {got['norms'][p]!r} != {want!r}"
        else:
            assert math.isclose(got["norms"][p], want, rel_tol=1e-6), (
                f"{what}: {p}-norm {got['norms'][p]!r} != {want!r}"
            )
    assert got["zeros"] == expected["zeros"], f"{what}: {got['zeros']} != {expected['zeros']} zeros"


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_layout_matches_unsharded_oracle(
    layout: Job, spawned: Callable[[int], LaunchReport]
) -> None:
    per_rank = spawned(layout.world_size).values(layout.name)
    grads = oracle_grads(layout.moe)
    categories = ("dense", "expert", "total") if layout.moe else ("total",)
    for category in categories:
        expected = _expected(grads[category])
        for rank, got in enumerate(per_rank):
            _assert_matches(got[category], expected, f"rank {rank} {category}")
    if layout.distopt and gtp_geometry(layout):
        # Some fragment must end or start inside the padding, not only cover it whole or miss it.
        stamped = [fragment for got in per_rank for fragment in got["stamped"]]
        assert any(0 < pad < numel for pad, numel in stamped), stamped


def test_layouts_cover_padding_that_spills_into_lower_gtp_ranks() -> None:
    by_name = {layout.name: layout for layout in LAYOUTS}
    spilling = ("gtp4_spill_axis_places", "gtp4_dp2_distopt_spill", "gtp2_dp2_ep2_egtp2_moe_spill")
    for name in spilling:
        assert any(shard.spills for shard in gtp_geometry(by_name[name])), name
    # The plain GTP layout pads without spilling, so both shapes of padding are exercised.
    geometry = gtp_geometry(by_name["gtp2"])
    assert any(shard.pad_rows for shard in geometry)
    assert not any(shard.spills for shard in geometry)


def test_untied_output_copy_counts_the_embedding_twice(
    spawned: Callable[[int], LaunchReport],
) -> None:
    correct = oracle_grads(moe=False)["total"]
    embedding = full_grads(moe=False)[EMBEDDING]
    doubled = _expected([*correct, embedding])
    assert doubled["norms"][2] > float64_norm(correct, 2) * 1.01, "the embedding must show"
    assert zeros_in([embedding]) > 0
    for rank, got in enumerate(spawned(UNTIED.world_size).values(UNTIED.name)):
        _assert_matches(got["total"], doubled, f"rank {rank} (untied copy)")


def test_plain_statistics_summed_over_cp_count_every_copy_cp_times(
    spawned: Callable[[int], LaunchReport],
) -> None:
    """The statistics group must leave the CP ranks out: summed over them, every gradient counts
    once per CP rank (the norm sqrt(cp) times too large)."""
    grads = oracle_grads(moe=False)["total"]
    counted_twice = _expected([*grads, *grads])
    assert counted_twice["norms"][2] > float64_norm(grads, 2) * 1.4
    for rank, got in enumerate(spawned(CP_SUMMED.world_size).values(CP_SUMMED.name)):
        _assert_matches(got["total"], counted_twice, f"rank {rank} (summed over CP)")


def test_fragments_stamped_without_padding_overcount_by_the_pad_elements(
    spawned: Callable[[int], LaunchReport],
) -> None:
    pad_elements = sum(shard.pad_elements for shard in gtp_geometry(UNSTAMPED))
    assert pad_elements > 0
    overcounted = _expected(oracle_grads(moe=False)["total"], extra_zeros=pad_elements)
    for rank, got in enumerate(spawned(UNSTAMPED.world_size).values(UNSTAMPED.name)):
        _assert_matches(got["total"], overcounted, f"rank {rank} (unstamped fragments)")


@pytest.mark.parametrize("case", DTENSOR_CASES, ids=lambda case: case.name)
def test_dtensor_shard0_grads_match_unsharded_oracle(
    case: DTensorCase, spawned: Callable[[int], LaunchReport]
) -> None:
    per_rank = spawned(case.world_size).values(case.name)
    expected = _expected([grad for grad, _ in dtensor_grads().values()])
    for rank, got in enumerate(per_rank):
        assert got["dp_size"] == case.dp and got["mesh_dims"] == (2 if case.replicate > 1 else 1)
        _assert_matches(got, expected, f"rank {rank} ({case.name})")
    # Uneven Shard(0): some local shards are shorter than others, one is empty.
    local_rows = [got["local_rows"] for got in per_rank]
    assert len({tuple(rows) for rows in local_rows}) > 1
    assert any(0 in rows for rows in local_rows)


def raise_on_last_rank(rank: int, world_size: int, message: str) -> None:
    """The last rank raises; the others hang (a stand-in for a rank stuck outside gloo)."""
    if rank == world_size - 1:
        raise ValueError(message)
    time.sleep(600)


def test_launcher_reports_a_rank_traceback_and_stops_the_waiting_ranks(tmp_path: Path) -> None:
    message = "deliberate failure on the last rank"
    # Rank 0 would sleep for 600 s: only the launcher's kill, after rank 1 failed, ends it
    # before the 300 s limit, whatever the machine's load.
    report = launch(2, tmp_path, [Case("fails", raise_on_last_rank, message)], timeout_s=300)
    with pytest.raises(AssertionError) as failure:
        report.values("fails")
    text = str(failure.value)
    assert "ValueError: " + message in text
    assert "raise_on_last_rank" in text
    assert "rank 0 outlived a failed rank and was killed" in text
    assert "timed out" not in text
