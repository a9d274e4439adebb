"""Megatron wgrads dumps of jobs whose expert TP size is over their TP size.

Megatron's writers are the ranks ``r < ETP * EP`` of a stage, each writing
``mp_rank_{r % TP}[_{r // ETP}]``: with ETP > TP the expert TP ranks that share a TP rank write
the same file, one over the other, and the dump keeps one of their expert shards. Its file
names are the full TP x EP grid, as an ETP = TP job's, and its shapes tell nothing more, so the
expert TP size must be stated (``--etp``) and is then refused. The dumps are written by
tests/_wgrads.py's sharder, as ``save_grads`` writes them (later writers over earlier ones);
the expected numbers are float64 sums over the full, unsharded gradients.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tests._wgrads
from tests._wgrads import Layout, Model, close, run_cli

# name: (layout, the expert FFN width, divisible by the expert TP size)
OVER_TP = {
    "tp1-etp2-ep2": (Layout(tp=1, etp=2, ep=2, experts=4), 6),
    "tp1-etp2-ep1-grouped": (Layout(tp=1, etp=2, experts=2, grouped=True), 6),
    "tp2-etp4-ep2": (Layout(tp=2, etp=4, ep=2, experts=4), 12),
    "tp1-pp2-etp2-ep2": (Layout(pp=2, etp=2, ep=2, experts=4), 6),
}
# Expert TP sizes a dump holds whole: equal to TP, or below it (each EP rank from fewer TP ranks).
AT_MOST_TP = {
    "tp1-etp1-ep2": Layout(ep=2, etp=1, experts=4),
    "tp2-etp2-ep2": Layout(tp=2, ep=2, etp=2, experts=4),
    "tp2-etp1-ep2": Layout(tp=2, ep=2, etp=1, experts=4),
    "tp4-etp2-ep2": Layout(tp=4, ep=2, etp=2, experts=4),
}


@pytest.mark.parametrize("name", sorted(OVER_TP))
def test_a_stated_expert_tp_over_tp_is_refused_in_one_line(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout, expert_ffn = OVER_TP[name]
    monkeypatch.setattr(tests._wgrads, "EXPERT_FFN", expert_ffn)
    model = Model.make(layout)
    folder = tmp_path / "wgrads" / "iter_0000100"
    model.write(folder)
    # Unstated, nothing in the files tells it: they read as an ETP = TP job's, and the expert
    # shards the dump lost are missing from the total (what --etp is for).
    status, document, stderr = run_cli("norm", folder, "--json")
    assert status == 0, stderr
    assert document["total_norm"] < 0.99 * model.norm(2.0)
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    for command in ("norm", "zeros", "audit", "inspect"):
        status, _, stderr = run_cli(command, folder, "--etp", str(layout.expert_tp))
        assert status == 2, (command, stderr)
        assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
        assert str(folder) in stderr
        sizes = f"expert TP size ({layout.expert_tp}, --etp) is over its TP size ({layout.tp})"
        assert sizes in stderr, stderr
        assert "write the same mp_rank file" in stderr and "not every one" in stderr, stderr
        assert "or none to have it found" not in stderr  # dropping --etp gives the short total
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before


@pytest.mark.parametrize("name", sorted(AT_MOST_TP))
def test_an_expert_tp_at_most_tp_reads_the_full_gradients(name: str, tmp_path: Path) -> None:
    layout = AT_MOST_TP[name]
    model = Model.make(layout)
    folder = tmp_path / "wgrads" / "iter_0000100"
    model.write(folder)
    status, document, stderr = run_cli("norm", folder, "--json", "--etp", str(layout.expert_tp))
    assert status == 0, stderr
    assert close(document["total_norm"], model.norm(2.0)), document["total_norm"]
    assert document["warnings"] == []
    status, document, stderr = run_cli("inspect", folder, "--json")
    assert status == 0, stderr
    assert document["axes"]["etp"] == layout.expert_tp  # told by the files, unstated
