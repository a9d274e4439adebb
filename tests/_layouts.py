"""Multi-process helpers for tests/test_layouts.py: a gloo launcher, a tiny model, Megatron layouts.

The launcher spawns one process per rank (spawn context, gloo, file rendezvous), runs a list of
cases in every rank, one after the other, and brings back each case's value or its traceback.
A rank that fails or hangs fails the test; it never hangs it.

The model is a small GPT with tied embeddings and optional MoE layers. Its full, unsharded
gradients come from a seeded generator, so the test process builds the same tensors as every
rank. Each rank cuts out its own shard the way Megatron lays it out (TP, CP, PP, DP, EP/ETP,
GTP/EGTP, distributed-optimizer fragments), makes the real process groups, and computes the
statistics with gradstat. The float64 oracle reads the unsharded gradients.

The same sharder writes snapshots (:func:`write_snapshot`) with nothing but ``save_rank``, so
``compare`` and ``audit`` are also tested on layouts that ``gradstat.layout`` did not make.
"""

from __future__ import annotations

import math
import os
import pickle
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

import gradstat
from tests._params import param_with

NORM_TYPES: tuple[float, ...] = (2.0, 1.0, 3.0, math.inf)

# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One computation every rank runs: ``fn(rank, world_size, arg)`` returns a picklable value."""

    case_id: str
    fn: Callable[[int, int, Any], Any]
    arg: Any = None


@dataclass(frozen=True)
class Outcome:
    """What one rank brought back from one case: its value, or the traceback it raised."""

    value: Any = None
    error: str | None = None


@dataclass(frozen=True)
class LaunchReport:
    """Every rank's outcomes, and what went wrong with the processes themselves."""

    outcomes: list[dict[str, Outcome]]
    problems: list[str] = field(default_factory=list)

    def values(self, case_id: str) -> list[Any]:
        """The case's value on every rank, in rank order.

        Raises:
            AssertionError: a rank raised in this case (its traceback is in the message), or a
                rank never finished it (the process problems are in the message).
        """
        errors, missing = [], []
        for rank, outcomes in enumerate(self.outcomes):
            outcome = outcomes.get(case_id)
            if outcome is None:
                missing.append(rank)
            elif outcome.error is not None:
                errors.append(f"--- rank {rank} raised in case {case_id!r}:\n{outcome.error}")
        if errors or missing:
            lines = [*errors]
            if missing:
                lines.append(f"--- ranks {missing} have no outcome for case {case_id!r}")
                for rank, outcomes in enumerate(self.outcomes):
                    for other, outcome in outcomes.items():
                        if outcome.error is not None and other != case_id:
                            lines.append(
                                f"--- rank {rank} raised in case {other!r}:\n{outcome.error}"
                            )
            lines.extend(f"--- {problem}" for problem in self.problems)
            raise AssertionError("\n".join(lines))
        return [outcomes[case_id].value for outcomes in self.outcomes]


def _result_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank{rank}.pkl"


def _save(run_dir: Path, rank: int, outcomes: dict[str, Outcome]) -> None:
    # Written after every case and renamed into place, so a killed rank leaves whole files.
    path = _result_path(run_dir, rank)
    partial = path.with_suffix(".partial")
    partial.write_bytes(pickle.dumps(outcomes))
    os.replace(partial, path)


def _rank_main(
    rank: int, world_size: int, run_dir: Path, cases: Sequence[Case], pg_timeout_s: float
) -> None:
    """One rank: join the gloo world, run the cases in order, stop at the first failure."""
    torch.set_num_threads(1)
    outcomes: dict[str, Outcome] = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{run_dir}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
    except BaseException:
        outcomes["<init_process_group>"] = Outcome(error=traceback.format_exc())
        _save(run_dir, rank, outcomes)
        raise SystemExit(1) from None
    failed = False
    try:
        for case in cases:
            try:
                outcomes[case.case_id] = Outcome(value=case.fn(rank, world_size, case.arg))
            except Exception:
                outcomes[case.case_id] = Outcome(error=traceback.format_exc())
                failed = True
            _save(run_dir, rank, outcomes)
            if failed:
                # The other ranks' collectives are out of step with ours from here on.
                break
    finally:
        dist.destroy_process_group()
    # The results are on disk: skip the interpreter's teardown, seconds per rank on two cores.
    os._exit(1 if failed else 0)


def launch(
    world_size: int,
    run_dir: Path,
    cases: Sequence[Case],
    *,
    timeout_s: float = 150.0,
    pg_timeout_s: float = 30.0,
    grace_s: float = 3.0,
) -> LaunchReport:
    """Run ``cases`` on ``world_size`` fresh gloo ranks and collect every rank's outcomes.

    Args:
        world_size: number of ranks (processes) to spawn.
        run_dir: an empty directory for the rendezvous file and the result files.
        cases: computations to run in every rank, in this order.
        timeout_s: wall-clock limit for the whole run; ranks still alive then are killed.
        pg_timeout_s: gloo's collective timeout, so a rank whose peer died raises.
        grace_s: once a rank has failed, how long the others get to finish before being killed.

    Returns:
        The outcomes of every rank and the process-level problems (exit codes, kills).
    """
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, run_dir, list(cases), pg_timeout_s),
            name=f"gradstat-test-rank{rank}",
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    problems: list[str] = []
    deadline = time.monotonic() + timeout_s
    kill_at = deadline
    try:
        while True:
            alive = [proc for proc in procs if proc.is_alive()]
            if not alive:
                break
            if any(proc.exitcode not in (None, 0) for proc in procs):
                kill_at = min(kill_at, time.monotonic() + grace_s)
            remaining = kill_at - time.monotonic()
            if remaining <= 0:
                reason = "timed out" if kill_at == deadline else "outlived a failed rank"
                for proc in alive:
                    problems.append(f"rank {procs.index(proc)} {reason} and was killed")
                    proc.kill()
                break
            wait([proc.sentinel for proc in alive], timeout=min(remaining, 0.5))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    outcomes = []
    for rank, proc in enumerate(procs):
        if proc.exitcode != 0:
            problems.append(f"rank {rank} exited with code {proc.exitcode}")
        path = _result_path(run_dir, rank)
        outcomes.append(pickle.loads(path.read_bytes()) if path.exists() else {})
    return LaunchReport(outcomes=outcomes, problems=problems)


# ---------------------------------------------------------------------------------------------
# The model and its unsharded gradients
# ---------------------------------------------------------------------------------------------

VOCAB, HIDDEN, LAYERS, FFN = 16, 8, 4, 36
EXPERTS, EXPERT_FFN = 4, 6
UNSEEN_TOKENS = (3, 7, 12)  # embedding rows whose gradient is exactly zero
ZERO_EXPERT = 1  # an expert no token was routed to: all-zero gradients
SEED = 20260829
# Frequent tokens give the embedding the largest gradients, so counting it twice shows.
EMBEDDING_SCALE = 10.0

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_COPY = "output_layer.weight"
# A GTP shard's boolean mask of its padding elements (a test-only attribute; never saved).
PAD_MASK = "_test_gtp_pad_mask"


@dataclass(frozen=True)
class ParamSpec:
    """One logical parameter: shape, how TP splits it, where it lives, whether GTP shards it.

    ``split`` is "column" (dim 0 over TP: column-parallel or vocab-parallel), "row" (dim 1) or
    "none" (replicated over TP). ``layer`` is None for the embedding (first stage) and the final
    layernorm (last stage). Expert params split over ETP/EGTP instead of TP/GTP.
    """

    name: str
    shape: tuple[int, ...]
    split: str
    layer: int | None = None
    expert: int | None = None
    gtp: bool = False


# (name, shape, TP split, sharded over GTP when GTP is on), per layer or per expert.
_ATTENTION = [
    ("input_layernorm.weight", (HIDDEN,), "none", False),
    ("input_layernorm.bias", (HIDDEN,), "none", False),
    ("self_attention.linear_qkv.weight", (3 * HIDDEN, HIDDEN), "column", True),
    ("self_attention.linear_qkv.bias", (3 * HIDDEN,), "column", False),
    ("self_attention.linear_proj.weight", (HIDDEN, HIDDEN), "row", True),
    ("self_attention.linear_proj.bias", (HIDDEN,), "none", False),
    ("pre_mlp_layernorm.weight", (HIDDEN,), "none", False),
]
_DENSE_MLP = [
    ("mlp.linear_fc1.weight", (FFN, HIDDEN), "column", True),
    ("mlp.linear_fc2.weight", (HIDDEN, FFN), "row", False),
]
_ROUTER = [("mlp.router.weight", (EXPERTS, HIDDEN), "none", False)]
_EXPERT = [
    ("linear_fc1.weight", (EXPERT_FFN, HIDDEN), "column", True),
    ("linear_fc2.weight", (HIDDEN, EXPERT_FFN), "row", False),
    ("linear_fc2.bias", (HIDDEN,), "none", False),
]


def model_specs(moe: bool) -> list[ParamSpec]:
    """The model's logical parameters, in module order (the tied output layer is the embedding)."""
    specs = [ParamSpec(EMBEDDING, (VOCAB, HIDDEN), "column")]
    for layer in range(LAYERS):
        prefix = f"decoder.layers.{layer}."
        for name, shape, split, gtp in _ATTENTION + (_ROUTER if moe else _DENSE_MLP):
            specs.append(ParamSpec(prefix + name, shape, split, layer, gtp=gtp))
        for expert in range(EXPERTS if moe else 0):
            local = f"{prefix}mlp.experts.local_experts.{expert}."
            for name, shape, split, gtp in _EXPERT:
                specs.append(ParamSpec(local + name, shape, split, layer, expert, gtp))
    for name in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
        specs.append(ParamSpec(name, (HIDDEN,), "none", LAYERS))
    return specs


def full_grads(moe: bool) -> dict[str, Tensor]:
    """The unsharded fp32 gradients, the same in every process: ~25% exact zeros, scaled rows."""
    generator = torch.Generator().manual_seed(SEED)
    grads = {}
    for spec in model_specs(moe):
        values = torch.randn(spec.shape, generator=generator, dtype=torch.float64)
        keep = torch.rand(spec.shape, generator=generator, dtype=torch.float64) > 0.25
        scale = 10.0 ** torch.randint(-2, 1, (), generator=generator).item()
        if spec.name == EMBEDDING:
            scale = EMBEDDING_SCALE
        grads[spec.name] = (values * keep * scale).to(torch.float32)
        if spec.expert == ZERO_EXPERT:
            grads[spec.name].zero_()
    grads[EMBEDDING][list(UNSEEN_TOKENS)] = 0.0
    return grads


def oracle_grads(moe: bool) -> dict[str, list[Tensor]]:
    """The unsharded gradients, each logical parameter once: dense, expert and all of them."""
    grads = full_grads(moe)
    specs = model_specs(moe)
    dense = [grads[spec.name] for spec in specs if spec.expert is None]
    expert = [grads[spec.name] for spec in specs if spec.expert is not None]
    return {"dense": dense, "expert": expert, "total": dense + expert}


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A Megatron parallel layout of the model.

    Dense ranks are ordered tp (fastest), cp, gtp, dp, pp (Megatron's tp-cp-ep-gtp_remat-dp-pp
    without ep); expert ranks regroup each stage's ranks as etp (fastest), ep, egtp, edp, the
    expert data-parallel ranks taking in the context-parallel ones. CP ranks hold the same
    gradients (all-reduced over DP x CP); the distributed optimizer shards over DP x CP, cp the
    faster. The last three
    fields break the layout on purpose (negative controls): the tied output copy loses
    ``shared``, fragments are stamped with 0 padding, or the plain optimizer's statistics are
    also summed over the CP ranks.
    """

    name: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    gtp: int = 1
    ep: int = 1
    etp: int = 1
    egtp: int = 1
    cp: int = 1
    moe: bool = False
    distopt: bool = False
    align: int = 4
    axis_places: bool = False  # tp/gtp arguments and GTP `group` attrs as AxisPlace objects
    untie_output_copy: bool = False
    stamp_pad_zeros: bool = True
    stats_over_cp: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.gtp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        stage = self.tp * self.gtp * self.cp * self.dp
        assert stage % (self.etp * self.egtp * self.ep) == 0, self
        return stage // (self.etp * self.egtp * self.ep)

    def dense_axes(self) -> list[tuple[str, int]]:
        """Axes fastest first; cp only when it is split (layouts without CP keep the
        coordinates they always had)."""
        cp = [("cp", self.cp)] if self.cp > 1 else []
        return [("tp", self.tp), *cp, ("gtp", self.gtp), ("dp", self.dp), ("pp", self.pp)]

    def dp_cp_place(self, dense: dict[str, int]) -> tuple[int, int]:
        """(rank, size) among the ranks the distributed optimizer shards dense params over."""
        return dense["dp"] * self.cp + dense.get("cp", 0), self.dp * self.cp

    def expert_axes(self) -> list[tuple[str, int]]:
        return [
            ("etp", self.etp),
            ("ep", self.ep),
            ("egtp", self.egtp),
            ("edp", self.edp),
            ("pp", self.pp),
        ]

    def stage_of(self, spec: ParamSpec) -> int:
        if spec.layer is None:
            return 0
        if spec.layer == LAYERS:
            return self.pp - 1
        return spec.layer // (LAYERS // self.pp)


def gtp_pad_rows(rows: int, align: int, gtp_size: int) -> int:
    """Rows of zero padding that make ``rows`` a multiple of ``align * gtp_size``."""
    return -rows % (align * gtp_size)


@dataclass(frozen=True)
class GtpGeometry:
    """How one TP-local weight is padded and split over its GTP group."""

    name: str
    tp_parts: int
    rows: int
    columns: int
    pad_rows: int
    rows_per_shard: int

    @property
    def pad_elements(self) -> int:
        """Padding elements over all TP parts: what a count without pad subtraction adds."""
        return self.tp_parts * self.pad_rows * self.columns

    @property
    def spills(self) -> bool:
        """Padding longer than a shard: it reaches into lower GTP ranks' shards."""
        return self.pad_rows > self.rows_per_shard


def gtp_geometry(layout: Layout) -> list[GtpGeometry]:
    """The padding of every GTP-sharded weight in ``layout``."""
    geometry = []
    for spec in model_specs(layout.moe):
        tp, gtp = (layout.etp, layout.egtp) if spec.expert is not None else (layout.tp, layout.gtp)
        if not spec.gtp or gtp == 1:
            continue
        rows, columns = spec.shape
        rows, columns = (rows // tp, columns) if spec.split == "column" else (rows, columns // tp)
        pad = gtp_pad_rows(rows, layout.align, gtp)
        geometry.append(GtpGeometry(spec.name, tp, rows, columns, pad, (rows + pad) // gtp))
    return geometry


# ---------------------------------------------------------------------------------------------
# One rank's view: coordinates, groups, shards, fragments
# ---------------------------------------------------------------------------------------------


def _coords(rank: int, axes: Sequence[tuple[str, int]]) -> dict[str, int]:
    coords = {}
    for name, size in axes:
        coords[name], rank = rank % size, rank // size
    return coords


def _partition(axes: Sequence[tuple[str, int]], grouped: set[str]) -> list[list[int]]:
    """All rank lists that differ only along the ``grouped`` axes, in a fixed order."""
    world_size = math.prod(size for _, size in axes)
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world_size):
        coords = _coords(rank, axes)
        key = tuple(coords[name] for name, _ in axes if name not in grouped)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def group_containing(axes: Sequence[tuple[str, int]], grouped: set[str], rank: int) -> list[int]:
    """The ranks of ``rank``'s group along the ``grouped`` axes, as make_rank_view makes it."""
    (ranks,) = [ranks for ranks in _partition(axes, grouped) if rank in ranks]
    return ranks


def _my_group(rank: int, partition: list[list[int]]) -> dist.ProcessGroup:
    """Make every group of the partition (every rank must, in the same order); return ours."""
    mine = None
    for ranks in partition:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    assert mine is not None, (rank, partition)
    return mine


@dataclass
class RankView:
    """One rank's coordinates and groups. Axes of size 1 have no group (None: not split)."""

    dense: dict[str, int]
    expert: dict[str, int]
    groups: dict[str, Any]

    def axis(self, name: str) -> Any:
        """The group handed to the duplicate filters: a ProcessGroup, an AxisPlace or None."""
        return self.groups.get(name)


def make_rank_view(layout: Layout, rank: int) -> RankView:
    """Coordinates and real process groups of ``rank`` (collective: every rank calls it)."""
    dense_axes, expert_axes = layout.dense_axes(), layout.expert_axes()
    groups: dict[str, Any] = {}
    sizes = dict(dense_axes) | dict(expert_axes)
    for key, axes, grouped in (
        ("tp", dense_axes, {"tp"}),
        ("gtp", dense_axes, {"gtp"}),
        ("cp", dense_axes, {"cp"}),
        ("dp", dense_axes, {"dp"}),
        ("dp_cp", dense_axes, {"dp", "cp"}),
        ("etp", expert_axes, {"etp"}),
        ("egtp", expert_axes, {"egtp"}),
        ("edp", expert_axes, {"edp"}),
    ):
        if math.prod(sizes.get(axis, 1) for axis in grouped) > 1:
            groups[key] = _my_group(rank, _partition(axes, grouped))
    if layout.distopt:
        groups["dense_stats"] = groups["expert_stats"] = dist.group.WORLD
    else:
        # Plain optimizer: reduce over the model-parallel ranks of one data-parallel replica
        # (CP ranks are replicas too; the negative control sums over them as well).
        model_parallel = {"tp", "gtp", "pp"} | ({"cp"} if layout.stats_over_cp else set())
        groups["dense_stats"] = _my_group(rank, _partition(dense_axes, model_parallel))
        if layout.moe:
            expert_mp = {"etp", "egtp", "ep", "pp"}
            groups["expert_stats"] = _my_group(rank, _partition(expert_axes, expert_mp))
    dense, expert = _coords(rank, dense_axes), _coords(rank, expert_axes)
    if layout.axis_places:
        coords = dense | expert
        for key in ("tp", "gtp", "etp", "egtp"):
            if key in groups:
                groups[key] = gradstat.AxisPlace(coords[key], sizes[key])
    return RankView(dense, expert, groups)


def _tp_shard(grad: Tensor, split: str, index: int, size: int) -> Tensor:
    if split == "none" or size == 1:
        return grad
    dim = 0 if split == "column" else 1
    return grad.chunk(size, dim=dim)[index]


def _gtp_shard(grad: Tensor, align: int, index: int, size: int) -> tuple[Tensor, int, Tensor]:
    """Rank ``index``'s GTP shard, the padding rows added, and a mask of its padding elements
    (made by padding and splitting a real mask, not by arithmetic)."""
    pad = gtp_pad_rows(grad.shape[0], align, size)
    padded = torch.cat([grad, grad.new_zeros((pad, *grad.shape[1:]))])
    is_pad = torch.zeros(padded.shape, dtype=torch.bool)
    is_pad[grad.shape[0] :] = True
    return padded.chunk(size)[index], pad, is_pad.chunk(size)[index]


def local_params(layout: Layout, view: RankView) -> list[torch.nn.Parameter]:
    """The parameters ``view.rank`` holds, with their shards' gradients and Megatron attributes."""
    grads = full_grads(layout.moe)
    stage = view.dense["pp"]
    params = []
    for spec in model_specs(layout.moe):
        if layout.stage_of(spec) != stage:
            continue
        attrs: dict[str, Any] = {"_gradstat_name": spec.name}
        if spec.expert is None:
            coords, sizes, tp_axis, gtp_axis = view.dense, dict(layout.dense_axes()), "tp", "gtp"
        else:
            if spec.expert // (EXPERTS // layout.ep) != view.expert["ep"]:
                continue
            coords, sizes, tp_axis, gtp_axis = (
                view.expert,
                dict(layout.expert_axes()),
                "etp",
                "egtp",
            )
            attrs["allreduce"] = False
        grad = _tp_shard(grads[spec.name], spec.split, coords[tp_axis], sizes[tp_axis])
        if spec.split == "none":
            attrs.update(tensor_model_parallel=False, partition_dim=-1)
        else:
            attrs.update(
                tensor_model_parallel=True,
                partition_dim=0 if spec.split == "column" else 1,
                partition_stride=1,
            )
        if spec.gtp and sizes[gtp_axis] > 1:
            grad, pad, mask = _gtp_shard(grad, layout.align, coords[gtp_axis], sizes[gtp_axis])
            attrs.update(is_gtp_weight_remat=True, pad_length=pad, group=view.axis(gtp_axis))
            attrs[PAD_MASK] = mask
        if spec.name == EMBEDDING and layout.pp > 1:
            attrs["shared_embedding"] = True
        params.append(param_with(grad.clone(), **attrs))
    if layout.pp > 1 and stage == layout.pp - 1:
        # The output layer's copy of the tied embedding; its grad equals the embedding's after
        # the embedding-group all-reduce.
        embedding = _tp_shard(grads[EMBEDDING], "column", view.dense["tp"], layout.tp)
        params.append(
            param_with(
                embedding.clone(),
                tensor_model_parallel=True,
                partition_dim=0,
                partition_stride=1,
                shared=not layout.untie_output_copy,
                shared_embedding=True,
                _gradstat_name=OUTPUT_COPY,
            )
        )
    return params


# The attributes a fragment copies from its model param: every one local_params sets but the
# padding mask, which the fragment's own gtp_pad_zeros stamp replaces.
_FRAGMENT_ATTRS = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "allreduce",
    "shared",
    "shared_embedding",
    "is_gtp_weight_remat",
    "pad_length",
    "group",
    "_gradstat_name",
)


def fragments(
    params: Sequence[torch.nn.Parameter], dp_rank: int, dp_size: int, stamp: bool
) -> list[torch.nn.Parameter]:
    """The distributed optimizer's main params of ``dp_rank``: its contiguous buffer range.

    The params are laid end to end in one flat buffer, split into ``dp_size`` equal ranges;
    each fragment is ``param.view(-1)[start:end]`` of a param overlapping this rank's range,
    with the param's attributes, for GTP shards the padding inside it (``gtp_pad_zeros``), and
    where it lies (``fragment_offset``, ``fragment_shape``: what compare and audit place it by).
    """
    total = sum(param.numel() for param in params)
    per_rank = -(-total // dp_size)
    low, high = dp_rank * per_rank, min(total, (dp_rank + 1) * per_rank)
    main_params, offset = [], 0
    for param in params:
        start, end = max(low, offset) - offset, min(high, offset + param.numel()) - offset
        offset += param.numel()
        if start >= end:
            continue
        attrs = {key: getattr(param, key) for key in _FRAGMENT_ATTRS if hasattr(param, key)}
        if getattr(param, "is_gtp_weight_remat", False):
            pads = int(getattr(param, PAD_MASK).reshape(-1)[start:end].sum())
            attrs["gtp_pad_zeros"] = pads if stamp else 0
        attrs.update(fragment_offset=start, fragment_shape=list(param.shape))
        main_params.append(param_with(param.grad.view(-1)[start:end], **attrs))
    return main_params


def offline_view(layout: Layout, rank: int) -> RankView:
    """A rank's coordinates, with AxisPlace objects standing in for its TP/GTP groups."""
    dense, expert = _coords(rank, layout.dense_axes()), _coords(rank, layout.expert_axes())
    sizes, coords = dict(layout.dense_axes()) | dict(layout.expert_axes()), dense | expert
    groups = {
        axis: gradstat.AxisPlace(coords[axis], sizes[axis])
        for axis in ("tp", "gtp", "etp", "egtp")
        if sizes[axis] > 1
    }
    return RankView(dense, expert, groups)


def rank_params(layout: Layout, rank: int) -> list[torch.nn.Parameter]:
    """What ``rank`` hands to the optimizer's statistics: its shards, or with the distributed
    optimizer its fragments (dense over DP x CP, expert over EDP)."""
    view = offline_view(layout, rank)
    params = local_params(layout, view)
    if not layout.distopt:
        return params
    dense = [param for param in params if getattr(param, "allreduce", True)]
    experts = [param for param in params if not getattr(param, "allreduce", True)]
    stamp = layout.stamp_pad_zeros
    return fragments(dense, *layout.dp_cp_place(view.dense), stamp) + fragments(
        experts, view.expert["edp"], layout.edp, stamp
    )


def dump_layout(
    layout: Layout,
    directory: Path,
    step: int = 7,
    plant: Callable[[int, list[torch.nn.Parameter]], None] | None = None,
) -> Path:
    """What every rank of a job in ``layout`` writes with save_rank: a snapshot made without
    ``gradstat.layout``. ``plant(rank, params)`` may edit a rank's params before they are saved.
    """
    from gradstat.snapshot import save_rank

    sizes = dict(layout.dense_axes()) | dict(layout.expert_axes())
    for rank in range(layout.world_size):
        view = offline_view(layout, rank)
        params = rank_params(layout, rank)
        if plant is not None:
            plant(rank, params)
        coords = {axis: [(view.dense | view.expert)[axis], size] for axis, size in sizes.items()}
        save_rank(
            directory,
            [(param._gradstat_name, param) for param in params],
            rank=rank,
            world_size=layout.world_size,
            coords=coords,
            distributed_optimizer=layout.distopt,
            step=step,
        )
    return directory


def category_stats(params: list[Any], view: RankView, stats_group: Any) -> dict[str, Any]:
    """gradstat's norms and zero count of one optimizer's params (dense or expert), with the
    rank's TP/GTP groups as filters and ``stats_group`` as Megatron's grad_stats_parallel_group."""
    filters = {
        "tp_group": view.axis("tp"),
        "expert_tp_group": view.axis("etp"),
        "gtp_group": view.axis("gtp"),
        "expert_gtp_group": view.axis("egtp"),
    }
    selected = gradstat.grads_for_norm(params, **filters)
    norms = {p: gradstat.get_grad_norm_fp32(selected, p, stats_group) for p in NORM_TYPES}
    zeros = gradstat.count_zeros_fp32(params, stats_group, **filters)
    return {"norms": norms, "zeros": zeros}


def combine(dense: dict[str, Any], expert: dict[str, Any]) -> dict[str, Any]:
    """Dense and expert optimizers' statistics as one model's (Megatron's ChainedOptimizer)."""
    norms = {}
    for p in NORM_TYPES:
        d, e = dense["norms"][p], expert["norms"][p]
        norms[p] = max(d, e) if p == math.inf else (d**p + e**p) ** (1.0 / p)
    return {"norms": norms, "zeros": dense["zeros"] + expert["zeros"]}


def run_layout(rank: int, world_size: int, layout: Layout) -> dict[str, Any]:
    """A rank's norms and zero count for ``layout``: dense, expert and combined."""
    assert world_size == layout.world_size, (world_size, layout)
    view = make_rank_view(layout, rank)
    params = local_params(layout, view)
    dense = [param for param in params if getattr(param, "allreduce", True)]
    experts = [param for param in params if not getattr(param, "allreduce", True)]
    if layout.distopt:
        stamp = layout.stamp_pad_zeros
        dense = fragments(dense, *layout.dp_cp_place(view.dense), stamp)
        experts = fragments(experts, view.expert["edp"], layout.edp, stamp)
    result: dict[str, Any] = {
        "dense": category_stats(dense, view, view.groups["dense_stats"]),
        # (padding, elements) of each stamped fragment, to check what the layout exercised.
        "stamped": [
            (int(param.gtp_pad_zeros), param.numel())
            for param in dense + experts
            if hasattr(param, "gtp_pad_zeros")
        ],
    }
    if layout.moe:
        result["expert"] = category_stats(experts, view, view.groups["expert_stats"])
        result["total"] = combine(result["dense"], result["expert"])
    else:
        result["total"] = result["dense"]
    return result


# ---------------------------------------------------------------------------------------------
# DTensor gradients (Megatron-FSDP style): Shard(0) on a 1-D mesh, or HSDP's 2-D mesh
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DTensorCase:
    """Gradients split over ``tp`` TP ranks, then Shard(0) over a 1-D DeviceMesh of ``dp``
    ranks; with ``replicate`` > 1, (Replicate, Shard(0)) over a 2-D mesh of ``replicate`` x
    ``dp / replicate`` ranks, as HSDP lays them out."""

    name: str
    tp: int
    dp: int
    replicate: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.dp


def dtensor_grads() -> dict[str, tuple[Tensor, str]]:
    """Unsharded grads and their TP split; shapes make uneven and empty Shard(0) pieces."""
    generator = torch.Generator().manual_seed(SEED + 1)
    shapes = {
        "w_column": ((6, 5), "column"),
        "w_row": ((5, 4), "row"),
        "norm": ((3,), "none"),
        "tiny": ((1, 4), "none"),
    }
    grads = {}
    for name, (shape, split) in shapes.items():
        values = torch.randn(shape, generator=generator)
        grads[name] = (values * (torch.rand(shape, generator=generator) > 0.3), split)
    return grads


def run_dtensor(rank: int, world_size: int, case: DTensorCase) -> dict[str, Any]:
    """Norms and zero count of DTensor grads sharded over a DP mesh, reduced over TP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    assert world_size == case.world_size, (world_size, case)
    if case.replicate > 1:
        shape = (case.tp, case.replicate, case.dp // case.replicate)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("tp", "dp_replicate", "dp_shard"))
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        placements: list[Any] = [Replicate(), Shard(0)]
    else:
        mesh = init_device_mesh("cpu", (case.tp, case.dp), mesh_dim_names=("tp", "dp"))
        dp_mesh = mesh["dp"]
        placements = [Shard(0)]
    # The stats group is the model-parallel group: TP here, a single rank when tp == 1.
    tp_group = mesh["tp"].get_group()
    tp_rank = mesh.get_local_rank("tp")
    params = []
    for grad, split in dtensor_grads().values():
        local = _tp_shard(grad, split, tp_rank, case.tp)
        sharded = distribute_tensor(local.contiguous(), dp_mesh, placements, src_data_rank=None)
        params.append(
            param_with(
                sharded,
                tensor_model_parallel=split != "none",
                partition_dim={"column": 0, "row": 1}.get(split, -1),
            )
        )
    selected = gradstat.grads_for_norm(params, tp_group=tp_group)
    norms = {p: gradstat.get_grad_norm_fp32(selected, p, tp_group) for p in NORM_TYPES}
    zeros = gradstat.count_zeros_fp32(params, tp_group, tp_group=tp_group)
    local_sizes = [param.grad.to_local().shape[0] for param in params]
    return {
        "norms": norms,
        "zeros": zeros,
        "dp_size": dp_mesh.size(),
        "mesh_dims": dp_mesh.ndim,
        "local_rows": local_sizes,
    }


# ---------------------------------------------------------------------------------------------
# Launcher self-test cases
# ---------------------------------------------------------------------------------------------


def raise_on_last_rank(rank: int, world_size: int, message: str) -> None:
    """The last rank raises; the others hang (a stand-in for a rank stuck outside gloo)."""
    if rank == world_size - 1:
        raise ValueError(message)
    time.sleep(600)
