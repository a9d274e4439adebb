"""The attribute predicates and GTP padding arithmetic."""

from __future__ import annotations

import itertools

import pytest
import torch

import gradstat.clip_grads as clip_grads
from gradstat import (
    AxisPlace,
    count_zeros_fp32,
    gtp_local_pad_zero_count,
    param_is_not_gtp_duplicate,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
)
from gradstat.errors import AttributeMismatchError
from tests._params import gtp_shard, param_with


class _LiveGroupLike:
    """Any object with rank() and size() is accepted where a group is."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_shared_copies_do_not_count() -> None:
    assert param_is_not_shared(param_with(torch.ones(2)))
    assert param_is_not_shared(param_with(torch.ones(2), shared=False))
    assert not param_is_not_shared(param_with(torch.ones(2), shared=True))


@pytest.mark.parametrize("group_type", [AxisPlace, _LiveGroupLike])
def test_tensor_parallel_duplicates(group_type: type) -> None:
    tp0, tp1 = group_type(0, 2), group_type(1, 2)
    sharded = param_with(torch.ones(2), tensor_model_parallel=True)
    replicated = param_with(torch.ones(2), tensor_model_parallel=False)
    unmarked = param_with(torch.ones(2))
    assert param_is_not_tensor_parallel_duplicate(sharded, tp1)
    assert param_is_not_tensor_parallel_duplicate(replicated, tp0)
    assert not param_is_not_tensor_parallel_duplicate(replicated, tp1)
    assert not param_is_not_tensor_parallel_duplicate(unmarked, tp1)
    assert param_is_not_tensor_parallel_duplicate(unmarked, None)


def test_expert_params_use_the_expert_tp_group() -> None:
    expert = param_with(torch.ones(2), allreduce=False)
    dense = param_with(torch.ones(2), allreduce=True)
    # Dense TP rank 1 but expert TP rank 0: the expert replica counts, the dense one does not.
    assert param_is_not_tensor_parallel_duplicate(expert, AxisPlace(1, 2), AxisPlace(0, 2))
    assert not param_is_not_tensor_parallel_duplicate(dense, AxisPlace(1, 2), AxisPlace(0, 2))
    assert not param_is_not_tensor_parallel_duplicate(expert, AxisPlace(0, 2), AxisPlace(1, 2))
    assert param_is_not_tensor_parallel_duplicate(expert, AxisPlace(1, 2), None)


def test_gtp_duplicates() -> None:
    shard = param_with(torch.ones(2), is_gtp_weight_remat=True)
    replicated = param_with(torch.ones(2))
    expert = param_with(torch.ones(2), allreduce=False)
    assert param_is_not_gtp_duplicate(shard, AxisPlace(3, 4))
    assert param_is_not_gtp_duplicate(replicated, AxisPlace(0, 4))
    assert not param_is_not_gtp_duplicate(replicated, AxisPlace(3, 4))
    assert param_is_not_gtp_duplicate(replicated, None)
    assert param_is_not_gtp_duplicate(expert, AxisPlace(3, 4), AxisPlace(0, 2))
    assert not param_is_not_gtp_duplicate(expert, AxisPlace(0, 4), AxisPlace(1, 2))


def test_axis_place_rejects_a_rank_outside_its_axis() -> None:
    with pytest.raises(ValueError, match="axis rank 2 is outside an axis of size 2"):
        AxisPlace(2, 2)


# (full rows, cols, alignment, GTP size): 48 rows pad to 64 over 2 ranks (padding in the last
# shard only); 10 rows pad to 16 over 4 ranks of 4 rows (padding spills into rank 2); 3 rows pad
# to 64 over 4 ranks of 16 (ranks 1-3 entirely padding); no padding at all.
LAYOUTS = [(48, 5, 16, 2), (10, 3, 4, 4), (3, 2, 16, 4), (64, 2, 16, 2)]


@pytest.mark.parametrize(("rows", "cols", "align", "gtp_size"), LAYOUTS)
def test_gtp_pad_count_matches_a_real_padded_split(
    rows: int, cols: int, align: int, gtp_size: int
) -> None:
    total = 0
    for gtp_rank in range(gtp_size):
        shard, mask = gtp_shard(rows, cols, align, gtp_rank, gtp_size)
        assert gtp_local_pad_zero_count(shard, 0, shard.numel()) == int(mask.sum())
        assert clip_grads._gtp_pad_zero_count(shard, shard.grad) == int(mask.sum())
        total += int(mask.sum())
    assert total == shard.pad_length * cols


@pytest.mark.parametrize(("rows", "cols", "align", "gtp_size"), LAYOUTS)
def test_gtp_pad_count_of_fragments(rows: int, cols: int, align: int, gtp_size: int) -> None:
    """Distributed-optimizer fragments: any flat range, and the fragments add up to the shard."""
    shard, mask = gtp_shard(rows, cols, align, gtp_size - 1, gtp_size)
    flat_mask = mask.reshape(-1)
    numel = shard.numel()
    cuts = [0, 1, numel // 3, numel // 2 + 1, numel - 1, numel]
    for start, end in itertools.pairwise(cuts):
        expected = int(flat_mask[start:end].sum())
        assert gtp_local_pad_zero_count(shard, start, end) == expected


def test_stamped_pad_zeros_win_and_unplaced_fragments_count_none() -> None:
    shard, _ = gtp_shard(48, 5, 16, 1, 2)
    fragment = shard.grad.reshape(-1)[10:30]
    assert clip_grads._gtp_pad_zero_count(shard, fragment) == 0
    stamped = param_with(fragment, is_gtp_weight_remat=True, gtp_pad_zeros=7)
    assert clip_grads._gtp_pad_zero_count(stamped, fragment) == 7
    plain = param_with(torch.zeros(4, 4))
    assert clip_grads._gtp_pad_zero_count(plain, plain.grad) == 0


def test_unstamped_flat_fragment_with_copied_attributes_counts_no_padding() -> None:
    """A fragment alone cannot tell where it sits in the shard: nothing is subtracted."""
    shard, _ = gtp_shard(10, 3, 4, 2, 4)  # rows 2-3 of this 4-row shard are padding
    for flat in (shard.grad.reshape(-1), shard.grad.reshape(-1)[6:]):
        fragment = param_with(
            flat.clone(), is_gtp_weight_remat=True, pad_length=shard.pad_length, group=shard.group
        )
        assert clip_grads._gtp_pad_zero_count(fragment, fragment.grad) == 0


@pytest.mark.parametrize(("rows", "cols", "align", "gtp_size"), LAYOUTS)
def test_an_unstamped_fragment_that_records_its_place_counts_its_padding(
    rows: int, cols: int, align: int, gtp_size: int
) -> None:
    """A snapshot's distributed-optimizer fragment without the ``gtp_pad_zeros`` stamp but
    with its place (``fragment_offset`` in a shard of ``fragment_shape``): its padding was
    counted as zeros (a GTP4 x DP2 snapshot: 2462 of 6056 where the logical count is 414 of
    4008)."""
    for gtp_rank in range(gtp_size):
        shard, mask = gtp_shard(rows, cols, align, gtp_rank, gtp_size)
        flat, flat_mask = shard.grad.reshape(-1), mask.reshape(-1)
        numel = shard.numel()
        cuts = [0, 1, numel // 3, numel // 2 + 1, numel - 1, numel]
        for start, end in itertools.pairwise(cuts):
            fragment = param_with(
                flat[start:end].clone(),
                is_gtp_weight_remat=True,
                pad_length=shard.pad_length,
                group=shard.group,
                fragment_offset=start,
                fragment_shape=list(shard.shape),
            )
            expected = int(flat_mask[start:end].sum())
            assert clip_grads._gtp_pad_zero_count(fragment, fragment.grad) == expected


def test_gtp_pad_count_is_not_cached_onto_the_param() -> None:
    shard, _ = gtp_shard(48, 5, 16, 1, 2)
    clip_grads._gtp_pad_zero_count(shard, shard.grad)
    assert not hasattr(shard, "gtp_pad_zeros")


def test_inconsistent_gtp_attributes_are_reported() -> None:
    shard, _ = gtp_shard(48, 5, 16, 1, 2)
    shard.pad_length = 65
    with pytest.raises(AttributeMismatchError, match="pad_length 65 exceeds the 64 rows"):
        gtp_local_pad_zero_count(shard, 0, shard.numel())
    shard.pad_length = 16
    with pytest.raises(AttributeMismatchError, match=r"range \[0, 1000\) is outside"):
        gtp_local_pad_zero_count(shard, 0, 1000)


def test_a_gtp_shard_without_its_group_is_refused_not_miscounted() -> None:
    """A padded GTP shard without .group: rank 0 was assumed, a data row of rank 0 was taken for
    padding and the zero count came out -1 (a 7 x 2 weight padded to 8 rows over GTP 2)."""
    weight = torch.arange(1.0, 15.0).reshape(7, 2)
    weight[3, 0] = 0.0  # the one real zero, in rank 0's shard
    shards = list(torch.cat([weight, torch.zeros(1, 2)]).chunk(2))
    for shard in shards:
        param = param_with(shard.clone(), is_gtp_weight_remat=True, pad_length=1)
        with pytest.raises(AttributeMismatchError) as error:
            count_zeros_fp32([param], None)
        assert "no .group" in str(error.value) and "\n" not in str(error.value)
    counts = []
    for rank, shard in enumerate(shards):
        param = param_with(shard.clone(), is_gtp_weight_remat=True, pad_length=1)
        param.group = AxisPlace(rank, 2)
        counts.append(count_zeros_fp32([param], None, gtp_group=AxisPlace(rank, 2)))
    assert sum(counts) == 1.0
