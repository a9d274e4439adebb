"""Issue 25, items 1-7: the library in a job's ordinary life never gives a silently wrong number.

Parameters versus gradients, collectives joined alike by ranks whose lists differ, GradNorm after
``zero_grad()``, clipping's arguments, all-or-none clipping, sparse gradients and one-line errors.
Every expected number is float64 arithmetic on the tensors themselves, never gradstat's.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import gradstat
from gradstat import (
    GradNorm,
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
    total_norm,
    total_zeros,
)
from gradstat.errors import (
    ClipArgumentError,
    GradientInputError,
    GradstatError,
    StatsGroupError,
)
from gradstat.testing import Case, launch
from tests._oracle import rel_err


def _norm64(tensors: list[torch.Tensor], p: float = 2.0) -> float:
    """float64 p-norm of the tensors' dense values, the oracle."""
    values = [float(v) for t in tensors for v in t.detach().double().flatten().tolist()]
    if p == math.inf:
        return max((abs(v) for v in values), default=0.0)
    return float(sum(abs(v) ** p for v in values) ** (1.0 / p))


def _zeros64(tensors: list[torch.Tensor]) -> int:
    return sum(int(v == 0.0) for t in tensors for v in t.detach().double().flatten().tolist())


def _one_line(error: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(error.value)
    assert message and "\n" not in message, message
    return message


# --- item 1: a tensor that requires grad (or holds a .grad) is a parameter ----------------


def test_a_tensor_that_requires_grad_stands_for_its_gradient() -> None:
    x = torch.tensor([3.0, 4.0], requires_grad=True)
    (x * x).sum().backward()  # x.grad = [6, 8]: norm 10, where the weights' norm is 5
    assert total_norm([x]) == pytest.approx(_norm64([x.grad]), rel=1e-12)
    assert total_norm([x]) == pytest.approx(10.0, rel=1e-12)
    y = torch.tensor([0.0, 2.0, 5.0], requires_grad=True)
    (y * torch.tensor([1.0, 0.0, 3.0])).sum().backward()  # y.grad = [1, 0, 3]: one zero
    assert total_zeros([y]) == _zeros64([y.grad]) == 1
    # Parameters and plain gradient tensors in one list.
    plain = torch.tensor([0.0, 12.0])
    assert total_norm([x, plain]) == pytest.approx(_norm64([x.grad, plain]), rel=1e-12)
    assert total_zeros([y, plain]) == 2


def test_named_pairs_as_the_recorder_holds_them_read_the_gradients() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(3, 4, generator=gen).requires_grad_()  # tensors, not nn.Parameters
    bias = torch.zeros(3, requires_grad=True)
    (torch.full((2, 4), 3.0) @ weight.T + bias).pow(2).sum().backward()
    pairs = [("weight", weight), ("bias", bias)]
    tensors = [tensor for _, tensor in pairs]
    grads = [tensor.grad for tensor in tensors]
    assert rel_err(total_norm(tensors), _norm64(grads)) <= 1e-12
    assert total_zeros(tensors) == _zeros64(grads)
    assert _norm64(grads) > 10 * _norm64(tensors)  # the weights' norm would be far off


def test_a_leaf_holding_a_grad_is_a_parameter_and_a_create_graph_gradient_is_a_gradient() -> None:
    frozen = torch.nn.Parameter(torch.ones(3))
    frozen.grad = torch.tensor([1.0, 2.0, 2.0])
    frozen.requires_grad_(False)
    assert total_norm([frozen]) == pytest.approx(3.0, rel=1e-12)
    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    (weight**3).sum().backward(create_graph=True)
    grad = weight.grad
    assert grad is not None and grad.requires_grad and not grad.is_leaf
    assert total_norm([grad]) == pytest.approx(_norm64([grad]), rel=1e-12)  # [3, 12]
    weight.grad = None  # breaks the reference cycle create_graph makes


def test_a_view_of_a_parameter_holding_a_grad_is_a_parameter() -> None:
    """Megatron's distributed optimizer keeps each fp32 parameter's shard as a view of it
    (``param.view(-1)[start:end]``: it requires grad and is no leaf), sets the shard's ``.grad``
    before the step and passes the shards to ``clip_grad_by_total_norm_fp32``. Taken for a
    gradient, the shard's norm was the weights' (28.3 for a gradient norm of 1.41) and clipping
    scaled the weights; a shard without its ``.grad`` was refused instead of skipped."""
    weights = torch.nn.Parameter(torch.arange(16.0).reshape(4, 4))
    before = weights.detach().clone()
    shard, bare = weights.view(-1)[4:12], weights.view(-1)[12:]
    assert shard.requires_grad and not shard.is_leaf
    shard.grad = torch.tensor([0.5, 0.0, -1.5, 2.0, 0.0, 0.25, -0.5, 1.0])
    grad = shard.grad.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor torch's warning about a non-leaf's .grad
        with pytest.raises(GradientInputError, match="is a parameter"):
            get_grad_norm_fp32([shard])
        assert GradNorm([shard])() == pytest.approx(_norm64([grad]), rel=1e-12)
        assert total_norm([shard, bare]) == pytest.approx(_norm64([grad]), rel=1e-12)
        assert count_zeros_fp32([shard, bare], None) == _zeros64([grad])
        clip_grad_by_total_norm_fp32([shard, bare], 1.0, 4.0)
    assert torch.equal(weights.detach(), before), "the weights were scaled"
    assert torch.equal(shard.grad, grad * (1.0 / (4.0 + 1e-6)))


def test_a_create_graph_gradient_that_views_its_grad_outputs_is_a_gradient() -> None:
    """With grad_outputs that require grad, a create_graph gradient can be a view of them (here
    their transpose): it stays a gradient, as a view of a leaf that is no parameter."""
    x = torch.randn(3, 4, requires_grad=True)
    outputs = torch.randn(4, 3)
    outputs[0] = 0.0
    outputs.requires_grad_()
    (grad,) = torch.autograd.grad(x.t(), x, outputs, create_graph=True)
    assert grad._base is outputs and not grad.is_leaf
    assert total_norm([grad]) == pytest.approx(_norm64([grad]), rel=1e-12)
    assert total_zeros([grad]) == _zeros64([grad]) == 3
    assert get_grad_norm_fp32([grad]) == pytest.approx(_norm64([grad]), rel=1e-12)


def test_the_megatron_api_refuses_parameters_given_for_gradients() -> None:
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(2)]
    for param in params:
        param.grad = torch.full((4,), 2.0)
    with pytest.raises(GradientInputError) as error:
        get_grad_norm_fp32(params)
    assert "grads_for_norm" in _one_line(error)
    with pytest.raises(GradientInputError):
        get_grad_norm_fp32([torch.ones(2, requires_grad=True)])
    assert get_grad_norm_fp32([param.grad for param in params]) == pytest.approx(
        _norm64([param.grad for param in params]), rel=1e-12
    )


def test_parameter_apis_refuse_gradient_tensors_rather_than_skip_them() -> None:
    grads = [torch.full((4,), 2.0), torch.ones(3)]
    before = [grad.clone() for grad in grads]
    with pytest.raises(GradientInputError) as error:
        clip_grad_by_total_norm_fp32(grads, 1.0, 100.0)
    assert "pass the parameters" in _one_line(error)
    assert all(torch.equal(a, b) for a, b in zip(grads, before, strict=True))
    with pytest.raises(GradientInputError):
        count_zeros_fp32(grads, None)
    with pytest.raises(GradientInputError):
        gradstat.grads_for_norm(grads)


# --- item 3: GradNorm sees the live gradients ----------------------------------------------


def _backward(model: torch.nn.Module, scale: float) -> None:
    gen = torch.Generator().manual_seed(int(scale))
    model(torch.randn(8, 16, generator=gen) * scale).pow(2).sum().backward()


@pytest.mark.parametrize("p", [2.0, 1.0, math.inf])
def test_gradnorm_of_parameters_follows_zero_grad_set_to_none(p: float) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared = GradNorm(model.parameters(), p)  # built before any gradient exists
    for scale in (1.0, 30.0, 0.01):
        optimizer.zero_grad(set_to_none=True)
        _backward(model, scale)
        grads = [param.grad for param in model.parameters()]
        assert rel_err(prepared(), _norm64(grads, p)) <= 1e-9
    optimizer.zero_grad(set_to_none=True)
    assert prepared() == 0.0  # no gradients now: an empty list


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA graph path needs a GPU")
def test_gradnorm_of_cuda_parameters_replays_or_recaptures_after_zero_grad() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    model = model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, l1 = GradNorm(model.parameters()), GradNorm(model.parameters(), 1)
    for scale in (1.0, 30.0, 0.01, 5.0):
        optimizer.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(int(scale * 100))
        model((torch.randn(8, 16, generator=gen) * scale).cuda()).pow(2).sum().backward()
        grads = [param.grad.cpu() for param in model.parameters()]
        assert rel_err(prepared(), _norm64(grads)) <= 1e-6
        assert rel_err(l1(), _norm64(grads, 1)) <= 1e-6
    assert prepared._plan is not None  # the graph served these calls


def test_gradnorm_of_parameters_selects_as_grads_for_norm_and_refuses_a_mix() -> None:
    kept = torch.nn.Parameter(torch.zeros(3))
    tied = torch.nn.Parameter(torch.zeros(3))
    tied.shared = True  # Megatron's second copy of a tied weight
    prepared = GradNorm([kept, tied])
    kept.grad, tied.grad = torch.tensor([3.0, 0.0, 4.0]), torch.tensor([100.0, 0.0, 0.0])
    assert prepared() == pytest.approx(5.0, rel=1e-12)
    with pytest.raises(GradientInputError) as error:
        GradNorm([kept, torch.ones(2)])
    _one_line(error)


# --- item 4: clipping validates max_norm and total_norm ------------------------------------


def _clip_params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((5, 3), (7,))]
    for param in params:
        param.grad = torch.randn(param.shape, generator=gen)
    return params


@pytest.mark.parametrize(
    "total", [-1.0, -1e300, -1e-6, -math.inf, None, "3.0", True, torch.tensor([1.0, 2.0])]
)
def test_clip_refuses_a_total_norm_that_is_no_norm(total: Any) -> None:
    params = _clip_params()
    before = [param.grad.clone() for param in params]
    with pytest.raises(ClipArgumentError) as error:
        clip_grad_by_total_norm_fp32(params, 1.0, total)
    assert "total_norm" in _one_line(error)
    assert isinstance(error.value, ValueError) and isinstance(error.value, GradstatError)
    for param, original in zip(params, before, strict=True):
        assert param.grad.view(torch.int32).equal(original.view(torch.int32))


@pytest.mark.parametrize("max_norm", ["1.0", True, None, torch.ones(2)])
def test_clip_refuses_a_max_norm_that_is_no_number(max_norm: Any) -> None:
    params = _clip_params()
    with pytest.raises(ClipArgumentError) as error:
        clip_grad_by_total_norm_fp32(params, max_norm, 2.0)
    assert "max_norm" in _one_line(error)
    assert isinstance(error.value, TypeError)  # what the raw error used to be


def test_an_infinite_total_norm_multiplies_by_zero_as_megatron_does() -> None:
    params = _clip_params()
    params[1].grad[2] = math.inf
    clip_grad_by_total_norm_fp32(params, 1.0, math.inf)  # max_norm / (inf + 1e-6) = 0.0 < 1
    assert torch.equal(params[0].grad, torch.zeros(5, 3))
    expected = torch.zeros(7)
    expected[2] = math.nan  # inf * 0
    assert torch.equal(params[1].grad.isnan(), expected.isnan())
    assert torch.equal(params[1].grad.nan_to_num(), torch.zeros(7))


def test_a_tensor_total_norm_and_a_numpy_like_number_are_accepted() -> None:
    params = _clip_params()
    before = [param.grad.double() for param in params]
    clip_grad_by_total_norm_fp32(params, torch.tensor(1.5), torch.tensor(3.0, dtype=torch.float64))
    for param, original in zip(params, before, strict=True):
        torch.testing.assert_close(
            param.grad.double(), original * (1.5 / 3.000001), rtol=2e-7, atol=0
        )


# --- item 5: all gradients are checked before any is scaled --------------------------------


def _expanded_param() -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(4, 3))
    param.grad = torch.ones(3).expand(4, 3)  # stride 0: twelve elements in three floats
    return param


@pytest.mark.parametrize("bad", ["expanded", "meta", "inference", "float16"])
def test_a_clip_that_fails_leaves_every_gradient_as_it_was(bad: str) -> None:
    first = _clip_params()[0]
    if bad == "expanded":
        second = _expanded_param()
    elif bad == "meta":
        second = torch.nn.Parameter(torch.zeros(3, device="meta"))
        second.grad = torch.zeros(3, device="meta")
    elif bad == "inference":
        second = torch.nn.Parameter(torch.zeros(3))
        with torch.inference_mode():
            made = torch.ones(3)
        second.grad = made
    else:
        second = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
        second.grad = torch.ones(3, dtype=torch.float16)
    before = first.grad.clone()
    with pytest.raises(GradstatError) as error:
        clip_grad_by_total_norm_fp32([first, second], 1.0, 10.0)
    assert "parameter 1" in _one_line(error) or "shape (3,)" in str(error.value)
    assert first.grad.view(torch.int32).equal(before.view(torch.int32))


def test_the_same_gradient_listed_twice_is_scaled_once() -> None:
    param = _clip_params()[0]
    before = param.grad.double()
    clip_grad_by_total_norm_fp32([param, param], 1.0, 4.0)
    torch.testing.assert_close(param.grad.double(), before * (1.0 / 4.000001), rtol=2e-7, atol=0)


def test_two_views_of_the_same_elements_are_scaled_once() -> None:
    """Two parameters whose .grad are distinct view objects of one buffer's same elements."""
    buffer = torch.arange(1.0, 11.0)
    first, second, third = (torch.nn.Parameter(torch.zeros(5)) for _ in range(3))
    first.grad, second.grad, third.grad = buffer[:5], buffer[:5], buffer[5:]
    fourth = torch.nn.Parameter(torch.zeros(5, 1))
    fourth.grad = buffer[:5].view(5, 1)  # the same elements in another shape
    clip_grad_by_total_norm_fp32([first, second, third, fourth], 1.0, 4.0)
    expected = torch.arange(1.0, 11.0, dtype=torch.float64) * (1.0 / 4.000001)
    torch.testing.assert_close(buffer.double(), expected, rtol=2e-7, atol=0)


def test_gradients_sharing_part_of_their_memory_are_refused_before_any_is_scaled() -> None:
    buffer = torch.arange(1.0, 11.0)
    first, second, third = (torch.nn.Parameter(torch.zeros(n)) for n in (4, 6, 3))
    first.grad, second.grad, third.grad = buffer[:4], buffer[4:], buffer[2:5]
    with pytest.raises(GradientInputError) as error:
        clip_grad_by_total_norm_fp32([first, second, third], 1.0, 4.0)
    assert "parameters 0 and 2 share part of their memory" in _one_line(error)
    assert buffer.equal(torch.arange(1.0, 11.0))


def _params_holding(*grads: torch.Tensor) -> list[torch.nn.Parameter]:
    params = []
    for grad in grads:
        param = torch.nn.Parameter(torch.zeros(grad.shape))
        param.grad = grad
        params.append(param)
    return params


def test_views_with_gaps_or_in_another_order_are_judged_by_their_elements() -> None:
    """Only contiguous gradients were held to their memory: a transposed view of a gradient was
    scaled twice, and views of columns that share some elements with another gradient were not
    refused; disjoint views of interleaved columns are two gradients."""
    scale = 1.0 / 4.000001
    grad = torch.arange(1.0, 17.0).reshape(4, 4)
    clip_grad_by_total_norm_fp32(_params_holding(grad, grad.t()), 1.0, 4.0)
    torch.testing.assert_close(
        grad.double(), torch.arange(1.0, 17.0).reshape(4, 4).double() * scale
    )
    grad = torch.arange(1.0, 17.0).reshape(4, 4)
    clip_grad_by_total_norm_fp32(_params_holding(grad[:, 0::2], grad[:, 1::2]), 1.0, 4.0)
    torch.testing.assert_close(
        grad.double(), torch.arange(1.0, 17.0).reshape(4, 4).double() * scale
    )
    for first, second in (
        ((slice(None), slice(0, 2)), (slice(0, 2), slice(None))),
        ((), (slice(None), 1)),
    ):
        grad = torch.arange(1.0, 17.0).reshape(4, 4)
        with pytest.raises(GradientInputError) as error:
            clip_grad_by_total_norm_fp32(_params_holding(grad[first], grad[second]), 1.0, 4.0)
        assert "parameters 0 and 1 share part of their memory" in _one_line(error)
        assert grad.equal(torch.arange(1.0, 17.0).reshape(4, 4))


def test_a_gradient_whose_strides_fold_onto_its_own_elements_is_refused() -> None:
    """``as_strided((3, 3), (1, 1))`` names element 2 three times: torch calls that too hard to
    say from the strides, and it was scaled in place, some elements two or three times."""
    base = torch.arange(1.0, 7.0)
    with pytest.raises(GradientInputError) as error:
        clip_grad_by_total_norm_fp32(_params_holding(base.as_strided((3, 3), (1, 1))), 1.0, 4.0)
    assert "self-overlapping" in _one_line(error)
    assert base.equal(torch.arange(1.0, 7.0))
    base = torch.arange(1.0, 9.0)
    fine = base.as_strided((3, 2), (2, 3))  # elements 0, 3, 2, 5, 4, 7: none twice
    clip_grad_by_total_norm_fp32(_params_holding(fine), 1.0, 4.0)
    scaled = torch.tensor([1.0, 0, 1, 1, 1, 1, 0, 1]) * (1.0 / 4.000001 - 1.0) + 1.0
    torch.testing.assert_close(base.double(), torch.arange(1.0, 9.0).double() * scaled.double())


# --- item 6: sparse gradients --------------------------------------------------------------


def _sparse_embedding() -> torch.nn.Embedding:
    torch.manual_seed(6)
    embedding = torch.nn.Embedding(12, 5, sparse=True)
    tokens = torch.tensor([1, 3, 3, 7, 1, 1, 10])  # repeated rows: an uncoalesced grad
    (embedding(tokens) * torch.randn(7, 5)).sum().backward()
    grad = embedding.weight.grad
    assert grad is not None and grad.layout == torch.sparse_coo and not grad.is_coalesced()
    return embedding


@pytest.mark.parametrize("p", [2.0, 1.0, math.inf, 3.0, 0.5])
def test_sparse_gradients_norms_are_their_dense_norms(p: float) -> None:
    embedding = _sparse_embedding()
    grad = embedding.weight.grad
    assert grad is not None
    dense = grad.to_dense()
    expected = _norm64([dense], p)
    assert rel_err(total_norm([embedding.weight], p), expected) <= 1e-9
    assert rel_err(total_norm([grad], p), expected) <= 1e-9
    assert rel_err(get_grad_norm_fp32([grad], p), expected) <= 1e-9
    csr = dense.to_sparse_csr()
    assert rel_err(total_norm([csr], p), expected) <= 1e-9
    assert rel_err(get_grad_norm_fp32([dense.to_sparse_bsr((2, 5))], p), expected) <= 1e-9
    assert not grad.is_coalesced()  # nothing written into the caller's tensor


def test_sparse_gradients_zero_counts_include_the_rows_they_do_not_store() -> None:
    embedding = _sparse_embedding()
    grad = embedding.weight.grad
    assert grad is not None
    dense = grad.to_dense()
    expected = _zeros64([dense])
    assert expected == 5 * 8  # eight rows never looked up
    assert total_zeros([embedding.weight]) == expected
    assert count_zeros_fp32([embedding.weight], None) == float(expected)
    with_zero = dense.clone()
    with_zero[3, 2] = 0.0  # a stored zero among the values
    assert total_zeros([with_zero.to_sparse_csr()]) == expected + 1
    assert total_zeros([with_zero.to_sparse_csc()]) == expected + 1


def test_clipping_scales_sparse_gradients_never_skips_them() -> None:
    embedding = _sparse_embedding()
    grad = embedding.weight.grad
    assert grad is not None
    before = grad.to_dense().double()
    csr_param = torch.nn.Parameter(torch.zeros(4, 6).to_sparse_csr())
    csr_param.grad = torch.arange(24.0).reshape(4, 6).to_sparse_csr()
    csr_before = csr_param.grad.to_dense().double()
    clip_grad_by_total_norm_fp32([embedding.weight, csr_param], 2.0, 50.0)
    coefficient = 2.0 / (50.0 + 1e-6)
    after = embedding.weight.grad
    assert after is not None
    # The duplicates of an uncoalesced gradient are scaled one by one, each product rounded to
    # fp32: a row that sums duplicates is within a rounding of each of them, not of the sum.
    largest = float((before * coefficient).abs().max())
    torch.testing.assert_close(
        after.to_dense().double(), before * coefficient, rtol=2e-7, atol=4e-7 * largest
    )
    assert float((after.to_dense().double() - before).abs().max()) > 0.5 * float(before.abs().max())
    torch.testing.assert_close(
        csr_param.grad.to_dense().double(), csr_before * coefficient, rtol=2e-7, atol=0
    )


# --- item 7: one-line errors ---------------------------------------------------------------


def test_meta_gradients_are_one_line_errors_everywhere() -> None:
    meta = torch.nn.Parameter(torch.zeros(2, 3, device="meta"))
    meta.grad = torch.zeros(2, 3, device="meta")
    for call in (
        lambda: total_norm([meta]),
        lambda: total_norm([meta], math.inf),
        lambda: total_zeros([meta]),
        lambda: get_grad_norm_fp32([meta.grad]),
        lambda: count_zeros_fp32([meta], None),
        lambda: clip_grad_by_total_norm_fp32([meta], 1.0, 10.0),
        lambda: GradNorm([meta])(),
    ):
        with pytest.raises(GradientInputError) as error:
            call()
        assert "meta device" in _one_line(error)


# --- item 2 (and item 7's stats group): ranks whose lists differ, on 2 gloo ranks -----------


def _full_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(25)
    shapes = {"A": (6, 5), "B": (7,), "C": (4, 3), "E": (5,), "g0": (3,), "g1": (4,)}
    full = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    full["A"][0, :2] = 0.0
    full["B"][1] = 0.0
    full["E"][4] = 0.0
    return full


def _uneven_lists(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    full = _full_tensors()
    flat = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    grid = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    a = DTensor.from_local(full["A"].chunk(world_size)[rank], flat, [Shard(0)], run_check=False)
    b = DTensor.from_local(full["B"], flat, [Replicate()], run_check=False)
    c = DTensor.from_local(
        full["C"].chunk(world_size)[rank], grid, [Replicate(), Shard(0)], run_check=False
    )
    # On the dp slice of the 2-D mesh: a copy on every tp rank (a module left out of a TP plan).
    e = DTensor.from_local(full["E"], grid["dp"], [Replicate()], run_check=False)
    out: dict[str, Any] = {}
    mine = [b] if rank == 0 else []  # B's gradient is None on rank 1 only
    out["zeros_uneven"] = total_zeros(mine)
    out["zeros_again"] = total_zeros([a, b])
    out["norm_uneven"] = {
        str(p): total_norm([a, b] if rank == 0 else [a], p) for p in (2, 1, math.inf)
    }
    out["norm_empty"] = total_norm(mine)
    out["grid_uneven"] = total_norm([c, e] if rank == 0 else [c])
    out["grid_empty"] = total_norm([e] if rank == 0 else [])
    out["grid_zeros"] = total_zeros([e] if rank == 0 else [])
    # Extreme magnitudes on one rank only: the scaled path, taken by every rank alike.
    tiny = DTensor.from_local(full["B"] * 1e-30, flat, [Replicate()], run_check=False)
    out["tiny_uneven"] = total_norm([tiny] if rank == 0 else [])
    # Plain gradients (DDP replicas) that one rank lacks: that rank takes the other's, also on
    # the scaled path (fp32 values near 1e-30, whose squares underflow), and for p < 1.
    replica = full["g0"] * 1e-30
    out["ddp_tiny_uneven"] = total_norm([replica] if rank == 0 else [])
    out["ddp_uneven"] = {str(p): total_norm([full["g0"]] if rank == 1 else [], p) for p in (2, 0.5)}
    out["ddp_zeros_uneven"] = total_zeros([full["A"]] if rank == 1 else [])
    # Plain gradients that differ over a group (pipeline stages), beside a DTensor on one rank.
    stages = dist.new_group([0, 1])
    plain = full["g0"] if rank == 0 else full["g1"]
    out["with_group"] = total_norm([plain, b] if rank == 0 else [plain], group=stages)
    out["gradnorm_uneven"] = GradNorm([b] if rank == 0 else [])()
    # A refused gradient on rank 1 stops both ranks with a message, in step.
    meta = torch.zeros(3, device="meta")
    try:
        total_norm([b] if rank == 0 else [meta])
        out["refused"] = None
    except GradstatError as error:
        out["refused"] = (type(error).__name__, str(error))
    out["after_refused"] = total_norm([a])
    # A stats group without this rank: new_group gives rank 1 GroupMember.NON_GROUP_MEMBER.
    only_rank0 = dist.new_group([0])
    try:
        out["outside_group"] = total_norm([full["g0"]], group=only_rank0)
    except GradstatError as error:
        out["outside_group"] = (type(error).__name__, str(error))
    try:
        out["outside_group_megatron"] = get_grad_norm_fp32([full["g0"]], 2, only_rank0)
    except GradstatError as error:
        out["outside_group_megatron"] = (type(error).__name__, str(error))
    out["last"] = total_zeros([a] if rank == 0 else [])
    dist.barrier()
    return out


@pytest.mark.multiprocess
def test_ranks_whose_lists_differ_join_the_same_collectives(tmp_path: Path) -> None:
    report = launch(2, tmp_path, [Case("uneven", _uneven_lists)], timeout_s=120, pg_timeout_s=20)
    assert not report.problems, report.problems
    ranks = report.values("uneven")
    full = _full_tensors()
    a, b, c, e = full["A"], full["B"], full["C"], full["E"]
    for rank, out in enumerate(ranks):
        assert out["zeros_uneven"] == _zeros64([b]) == 1
        assert out["zeros_again"] == _zeros64([a, b]) == 3
        for p in (2.0, 1.0, math.inf):
            assert rel_err(out["norm_uneven"][str(int(p)) if p != math.inf else "inf"],
                           _norm64([a, b], p)) <= 1e-9  # fmt: skip
        assert rel_err(out["norm_empty"], _norm64([b])) <= 1e-9
        assert rel_err(out["grid_uneven"], _norm64([c, e])) <= 1e-9
        assert rel_err(out["grid_empty"], _norm64([e])) <= 1e-9
        assert out["grid_zeros"] == _zeros64([e]) == 1
        assert rel_err(out["tiny_uneven"], _norm64([b * 1e-30])) <= 1e-9
        assert rel_err(out["ddp_tiny_uneven"], _norm64([full["g0"] * 1e-30])) <= 1e-9
        for p in (2.0, 0.5):
            key = str(int(p)) if p == 2.0 else str(p)
            assert rel_err(out["ddp_uneven"][key], _norm64([full["g0"]], p)) <= 1e-9
        assert out["ddp_zeros_uneven"] == _zeros64([a]) == 2
        assert rel_err(out["with_group"], _norm64([full["g0"], full["g1"], b])) <= 1e-9
        assert rel_err(out["gradnorm_uneven"], _norm64([b])) <= 1e-9
        name, message = out["refused"]
        assert "\n" not in message
        if rank == 1:
            assert name == "GradientInputError" and "meta device" in message
        else:
            assert "another rank refused" in message
        assert rel_err(out["after_refused"], _norm64([a])) <= 1e-9
        outside, outside_megatron = out["outside_group"], out["outside_group_megatron"]
        if rank == 1:
            assert outside[0] == outside_megatron[0] == StatsGroupError.__name__
            assert "not a member of the stats group" in outside[1] and "\n" not in outside[1]
        else:
            assert "another rank refused" in outside[1]
            assert rel_err(outside_megatron, _norm64([full["g0"]])) <= 1e-9
        assert out["last"] == _zeros64([a.chunk(2)[0]]) == 2


@pytest.mark.parametrize("p", [2.0, 1.0, math.inf, 3.0])
def test_complex_gradients_count_by_their_magnitudes(tmp_path: Path, p: float) -> None:
    """A complex parameter's gradient raised out of total_norm and out of the recorder's step
    (the training loop stopped); its norm is PyTorch's: of the elements' magnitudes."""
    values = [3 + 4j, 0j, 1j, -2.5 + 0.5j]
    weight = torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64))
    weight.grad = torch.tensor(values, dtype=torch.complex64)
    bias = torch.nn.Parameter(torch.zeros(2))
    bias.grad = torch.tensor([1.0, 0.0])
    magnitudes = [math.hypot(value.real, value.imag) for value in values] + [1.0, 0.0]
    expected = max(magnitudes) if p == math.inf else math.fsum(m**p for m in magnitudes) ** (1 / p)
    assert math.isclose(gradstat.total_norm([weight, bias], p), expected, rel_tol=1e-12)
    assert gradstat.total_zeros([weight, bias]) == 2
    grads = [weight.grad, bias.grad]
    assert math.isclose(gradstat.get_grad_norm_fp32(grads, p), expected, rel_tol=1e-12)
    if p == 2.0:
        recorder = gradstat.Recorder([("w", weight), ("b", bias)], tmp_path / "run", spike=None)
        assert math.isclose(recorder.step(1), expected, rel_tol=1e-12)


def test_a_shared_copy_counts_nowhere_in_the_loop_as_in_its_snapshot(tmp_path: Path) -> None:
    """A tied weight's second copy marked ``shared=True``: total_norm counted it, a snapshot
    does not (Megatron's rule), so the recorder's snapshot of a healthy job said its norm
    differed from the recorder's (exit status 1)."""
    import json

    from gradstat.recorder import complete_snapshots
    from tests._cli import run_gradstat

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 3))
    model[1].weight.shared = True  # type: ignore[attr-defined]
    values = {
        name: torch.arange(1.0, param.numel() + 1).reshape(param.shape) / (i + 2)
        for i, (name, param) in enumerate(model.named_parameters())
    }
    for name, param in model.named_parameters():
        param.grad = values[name].clone()
    counted = [value for name, value in values.items() if name != "1.weight"]
    expected = math.sqrt(math.fsum(float(v) ** 2 for value in counted for v in value.flatten()))
    zeros = sum(int((value == 0).sum()) for value in counted)
    assert math.isclose(gradstat.total_norm(model.parameters()), expected, rel_tol=1e-12)
    assert gradstat.total_zeros(list(model.parameters())) == zeros
    recorder = gradstat.Recorder(model, tmp_path / "run", spike=None, steps=[1])
    assert math.isclose(recorder.step(1), expected, rel_tol=1e-12)
    recorder.wait()
    (_, snapshot), *_ = complete_snapshots(tmp_path / "run")
    done = run_gradstat("norm", snapshot, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    found = json.loads(done.stdout)
    assert math.isclose(found["total_norm"], expected, rel_tol=1e-12)
    assert found["recorded_norm_differs"] is False
