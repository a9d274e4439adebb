"""Data-parallel replicas that lack different gradients, matched by their place in the list.

A torch-native statistic takes plain gradients for replicas: each rank's copy is the whole
gradient, so the largest rank's statistic stands for all (a rank whose list lacks a gradient,
None after ``zero_grad()`` or a parameter its batch never used, takes another rank's). That holds
while one rank holds every gradient some rank holds. Where rank 0 lacks one parameter's gradient
and rank 1 another's, no rank's statistic is the whole: the statistic is then taken per place in
the list, each place's largest over the ranks, and those combined. The lists must hold the same
parameters in the same order on every rank (the same model), which the list's length checks.

The way is decided from reduced numbers, so every rank takes it or none: a rank that lacks a
gradient says so in the statistic's first all-reduce (free); only then do the ranks compare
which places they lack (one all-reduce of four numbers), and only where those differ do they
reduce one row per place.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from gradstat.core.groups import all_reduce
from gradstat.errors import ReplicaWarning

__all__ = ["lacked_differently", "lacking_digest", "per_place"]

_DIGEST_BITS = 52  # a float64 holds the digest exactly


def lacking_digest(length: int, lacking: Sequence[int]) -> float:
    """A list's length and the places it lacks a gradient at, as one float64 (a 52-bit digest):
    equal on two ranks when they lack the same places."""
    text = f"{length}:{','.join(map(str, lacking))}".encode()
    digest = hashlib.sha1(text, usedforsecurity=False).digest()
    return float(int.from_bytes(digest[:8], "little") % (1 << _DIGEST_BITS))


def lacked_differently(length: int, lacking: Sequence[int], device: torch.device) -> bool:
    """Whether the ranks' lists, of one length, lack gradients at different places (a
    collective over the default group: every rank calls, once some rank lacks one).

    Args:
        length: how many items this rank's list holds.
        lacking: the places of this rank's list whose gradient is missing.
        device: where the group's backend takes tensors.
    """
    digest = lacking_digest(length, lacking)
    found = [float(length), -float(length), digest, -digest]
    top, low, digest_top, digest_low = all_reduce(
        torch.tensor(found, dtype=torch.float64, device=device), dist.ReduceOp.MAX, None
    ).tolist()
    if top != -low:
        if dist.get_rank() == 0:
            warnings.warn(
                ReplicaWarning(
                    f"gradstat: the ranks pass lists of {-low:.0f} to {top:.0f} items and some "
                    "lack gradients, so their replicas cannot be matched by place: the largest "
                    "rank's statistic is taken; pass the same parameters on every rank (group= "
                    "for pipeline stages)"
                ),
                stacklevel=2,
            )
        return False
    return bool(digest_top != -digest_low)


def per_place(
    grads: Sequence[Tensor],
    places: Sequence[int],
    extra: Sequence[int],
    length: int,
    compute: Callable[[list[Tensor], torch.device], Tensor],
    op: dist.ReduceOp.RedOpType,
    device: torch.device,
) -> Tensor:
    """The statistic of the replicas' union: ``compute`` of each gradient in its place's row,
    each row's largest over the ranks (a MAX all-reduce over the default group), the rows then
    summed (``op`` SUM) or maximised (MAX).

    Args:
        grads: this rank's plain gradients.
        places: each gradient's place in the list.
        extra: what each gradient adds to its statistic (zeros a sparse gradient leaves out).
        length: the list's length, the same on every rank.
        compute: the statistic of a list of tensors.
        op: how the rows combine.
        device: where the statistics live.
    """
    empty = compute([], device)
    rows = empty.new_zeros((length, *empty.shape))
    for grad, place, added in zip(grads, places, extra, strict=True):
        rows[place] = compute([grad], device) + added
    rows = all_reduce(rows, dist.ReduceOp.MAX, None)
    return rows.amax(0) if op == dist.ReduceOp.MAX else rows.sum(0)
