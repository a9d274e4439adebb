"""A NaN or an infinity on one rank reaches every rank's norm, whichever rank holds it and
whatever p: gloo's MAX reduction drops a NaN, so the inf-norm (one MAX of max |x|) gave the
other ranks' finite max, and the recorder's non-finite trigger never fired."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import gradstat
from gradstat.testing import spawn

pytestmark = pytest.mark.multiprocess

_PS = (2.0, 1.0, math.inf, 3.0)


def _norms_by_bad_rank(rank: int, _world_size: int, _arg: Any) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for bad_rank in (0, 1):
        for value in (math.nan, math.inf):
            grad = torch.ones(4)
            if rank == bad_rank:
                grad[1] = value
            for p in _PS:
                key = f"{value} on rank {bad_rank}, p {p}"
                found[key] = [
                    gradstat.total_norm([grad], p),
                    gradstat.get_grad_norm_fp32([grad], p),
                ]
    return found


def test_a_non_finite_element_on_one_rank_is_every_ranks_norm() -> None:
    for found in spawn(2, _norms_by_bad_rank):
        for key, norms in found.items():
            if key.startswith("nan"):
                assert all(math.isnan(norm) for norm in norms), (key, norms)
            else:
                assert norms == [math.inf, math.inf], (key, norms)
