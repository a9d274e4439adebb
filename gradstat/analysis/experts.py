"""The experts of MoE layers one by one: which parameters make up each expert, their statistics
per expert, and the audit's checks of experts and routers.

Experts are recognised by the parameter names Megatron gives them, with the global expert
index (gradstat's recorder and its wgrads reader renumber a rank's local experts, so expert 5
is ``5`` on whichever EP rank holds it):

- SequentialMLP: ``<layer>.experts.local_experts.<E>.<rest>``, e.g.
  ``decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight``;
- grouped GEMM (TEGroupedMLP): ``<layer>.experts.<linear>.weight<E>`` and ``.bias<E>``, one
  tensor per expert, e.g. ``decoder.layers.1.mlp.experts.linear_fc1.weight2``.

Both give the expert module (``decoder.layers.1.mlp.experts``), the index and the rest of the
name (``linear_fc1.weight``). The name decides, not the ``allreduce`` attribute: a parameter
named so is an expert's whatever its attributes say.

- stacked expert weights, one tensor of three or more dimensions holding its experts along
  dim 0, a direct parameter of an ``experts`` module: torch-native MoE such as torchtitan's
  ``moe.experts.w1`` of shape [E, dim, hidden]. Asked for (``Request.split_experts``), the
  statistics also hold each row, ``<tensor>[<E>]``, under its global index: a DTensor's row
  offset on dim 0 plus the row, or for a plain tensor on EP rank e holding n rows, e * n plus
  the row (Megatron's contiguous blocks of experts per EP rank).

Not split: a stacked tensor stored flat, as legacy GroupedMLP's ``experts.weight1`` of shape
[hidden, E * ffn] (its shape does not say E), a DTensor sharded on dim 0 over more than one
mesh dimension (its rows are strided: which global row each local one is, the record does not
say) or whose offset was not recorded, a tensor split by TP on dim 0 or carrying GTP padding.
Such tensors, marked as expert parameters, are summed up in one row of their own. Shared
experts (``shared_experts``) are dense parameters.

Routers are ``<layer>.router.weight`` and ``<layer>.router.bias``, ``<layer>`` being the
expert module's parent (``decoder.layers.1.mlp``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gradstat.analysis.stats import ParamStats, SnapshotStats, nan_max
from gradstat.core import kernels
from gradstat.snapshot.format import ParamRecord, RankHeader

__all__ = [
    "DENSE_ROW",
    "OTHER_EXPERT_ROW",
    "ExpertIssue",
    "ExpertName",
    "ExpertStats",
    "expert_issues",
    "expert_label",
    "expert_name",
    "expert_stats",
    "router_layer",
    "stacked_first_expert",
]

# The summary rows of ``expert_stats``: every dense parameter, and the expert parameters
# whose names say no expert index (stacked [E, ...] tensors).
DENSE_ROW = "(dense parameters)"
OTHER_EXPERT_ROW = "(other expert parameters)"

_SEQUENTIAL = re.compile(
    r"^(?P<module>(?:.*\.)?experts)\.local_experts\.(?P<index>\d+)\.(?P<rest>.+)$"
)
_GROUPED = re.compile(
    r"^(?P<module>(?:.*\.)?experts)\.(?P<linear>[^.]+)\.(?P<kind>weight|bias)(?P<index>\d+)$"
)
# A stacked tensor's row, as ``Request.split_experts`` names it: ``...experts.w1[5]``.
_STACKED_ROW = re.compile(r"^(?P<module>(?:.*\.)?experts)\.(?P<rest>[^.\[]+)\[(?P<index>\d+)\]$")
_STACKED = re.compile(r"^(?:.*\.)?experts\.[^.\[]+$")
_ROUTER = re.compile(r"^(?P<layer>.+)\.router\.(?:weight|bias)$")


@dataclass(frozen=True)
class ExpertName:
    """What a parameter's name says of its expert."""

    module: str  # the expert module: ``decoder.layers.1.mlp.experts``
    index: int  # the global expert index within that module
    rest: str  # the parameter within the expert: ``linear_fc1.weight``

    @property
    def label(self) -> str:
        return expert_label(self.module, self.index)


def expert_label(module: str, index: int) -> str:
    """How reports name an expert: ``decoder.layers.1.mlp.experts[2]``, whichever naming."""
    return f"{module}[{index}]"


def expert_name(name: str) -> ExpertName | None:
    """The expert a parameter belongs to, by its name; None for anything else."""
    match = _SEQUENTIAL.match(name)
    if match:
        return ExpertName(match["module"], int(match["index"]), match["rest"])
    match = _GROUPED.match(name)
    if match:
        rest = f"{match['linear']}.{match['kind']}"
        return ExpertName(match["module"], int(match["index"]), rest)
    match = _STACKED_ROW.match(name)
    if match:
        return ExpertName(match["module"], int(match["index"]), match["rest"])
    return None


def stacked_first_expert(
    header: RankHeader, record: ParamRecord, local_shape: tuple[int, ...]
) -> int | None:
    """The global index of the first expert a stacked [E, ...] tensor's local rows hold; None
    for any other tensor, and for a stacked one whose rows cannot be placed (module docstring).

    Args:
        header: its rank file's header (the EP coordinate of a plain tensor).
        record: its record.
        local_shape: the shape of the gradient this rank holds.
    """
    if not _STACKED.match(record.name) or len(local_shape) < 3:
        return None
    if len(record.param_shape) < 3 or record.attr("is_gtp_weight_remat"):
        return None
    if record.attr("gtp_pad_zeros") is not None:
        return None
    if record.attr("tensor_model_parallel") and record.attr("partition_dim") == 0:
        return None
    placement = record.dtensor
    if placement is not None:
        on_rows = sum(code == "S(0)" for code in placement.placements)
        if on_rows == 0:
            return 0
        if on_rows > 1 or placement.global_offset is None:
            return None
        return placement.global_offset[0]
    ep_rank, ep_size = header.coords.get("ep", (0, 1))
    return ep_rank * local_shape[0] if record.is_expert and ep_size > 1 else 0


def router_layer(name: str) -> str | None:
    """The MoE layer of a router parameter (``decoder.layers.1.mlp``), None for others."""
    match = _ROUTER.match(name)
    return None if match is None else match["layer"]


@dataclass(frozen=True)
class ExpertStats:
    """One expert's statistics, all its parameters combined (or a summary row's).

    ``module`` and ``index`` are None for the summary rows (``DENSE_ROW``, ``OTHER_EXPERT_ROW``).
    """

    label: str
    module: str | None
    index: int | None
    params: tuple[str, ...]
    numel: int
    zeros: int
    pad_zeros: int
    norms: Mapping[float, float]
    max_abs: float | None
    ranks: tuple[int, ...]  # the rank files holding a counted piece, ascending

    def norm(self, norm_type: float) -> float:
        if norm_type == math.inf:
            if self.max_abs is None:
                raise KeyError("the inf norm was not computed; ask for it in norm_types")
            return self.max_abs
        return self.norms[norm_type]

    @property
    def all_zero(self) -> bool:
        """Every counted element is exactly zero (when zeros were counted)."""
        return self.numel > 0 and self.zeros == self.numel


def _combined(
    label: str, module: str | None, index: int | None, members: Sequence[ParamStats]
) -> ExpertStats:
    norm_types = members[0].norms.keys()
    with_inf = members[0].max_abs is not None
    return ExpertStats(
        label=label,
        module=module,
        index=index,
        params=tuple(param.name for param in members),
        numel=sum(param.numel for param in members),
        zeros=sum(param.zeros for param in members),
        pad_zeros=sum(param.pad_zeros for param in members),
        norms={
            p: kernels.combine_norms((param.norms[p] for param in members), p) for p in norm_types
        },
        max_abs=nan_max(param.norm(math.inf) for param in members) if with_inf else None,
        ranks=tuple(sorted({rank for param in members for rank in param.ranks})),
    )


def expert_stats(stats: SnapshotStats) -> list[ExpertStats]:
    """Per-expert statistics: a row per (expert module, expert index), then the summary rows.

    Expert modules come in the snapshot's module order, each one's experts by index; then one
    row of every dense parameter and one of the expert parameters no name rule places, where
    there are any. Every counted parameter is in exactly one row, so the rows combine to the
    snapshot's totals.
    """
    experts: dict[str, dict[int, list[ParamStats]]] = {}
    dense: list[ParamStats] = []
    other: list[ParamStats] = []
    split: dict[str, list[ParamStats]] = {}  # a stacked tensor's rows, by the tensor's name
    for row in stats.expert_rows:
        split.setdefault(row.name.rpartition("[")[0], []).append(row)
    for param in stats.params:
        for member in split.get(param.name, [param]):
            found = expert_name(member.name)
            if found is not None:
                experts.setdefault(found.module, {}).setdefault(found.index, []).append(member)
            else:
                (other if member.expert else dense).append(member)
    rows = [
        _combined(expert_label(module, index), module, index, by_index[index])
        for module, by_index in experts.items()
        for index in sorted(by_index)
    ]
    if dense:
        rows.append(_combined(DENSE_ROW, None, None, dense))
    if other:
        rows.append(_combined(OTHER_EXPERT_ROW, None, None, other))
    return rows


# --- audit -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertIssue:
    """An audit finding about experts or routers (``gradstat.analysis.audit`` reports it)."""

    kind: str  # "expert_never_routed", "no_gradient" or "router_zero"
    name: str  # an expert's label or a parameter's name
    ranks: tuple[int, ...]
    detail: str


def _plural(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _without_gradient(
    headers: Iterable[tuple[int, RankHeader]],
) -> dict[str, tuple[int, ...]]:
    """MoE parameters (an expert's, by name or by its ``allreduce=False`` record, or a
    router's) recorded on some rank but with a gradient on none, and the ranks that hold them
    (in first-seen order).

    Dense parameters without a gradient are left alone: frozen ones (LoRA's base weights, a
    frozen embedding) are a choice, and common; an expert or a router without one was never
    in the backward pass of a model that trains its MoE layers.
    """
    holders: dict[str, list[int]] = {}
    with_grad: set[str] = set()
    moe: set[str] = set()
    for rank, header in headers:
        for record in header.params:
            holders.setdefault(record.name, []).append(rank)
            if record.has_grad:
                with_grad.add(record.name)
            if record.is_expert or expert_name(record.name) or router_layer(record.name):
                moe.add(record.name)
    return {
        name: tuple(ranks)
        for name, ranks in holders.items()
        if name in moe and name not in with_grad
    }


def expert_issues(
    stats: SnapshotStats, headers: Sequence[tuple[int, RankHeader]]
) -> list[ExpertIssue]:
    """What the audit says of experts and routers: no gradient at all, an expert no token
    reached, a router cut off from the loss.

    Args:
        stats: the snapshot's statistics, with zero counts.
        headers: (rank, header) of every rank file.
    """
    rows = [row for row in expert_stats(stats) if row.module is not None]
    by_module: dict[str, list[ExpertStats]] = {}
    for row in rows:
        assert row.module is not None
        by_module.setdefault(row.module, []).append(row)
    issues = _no_gradient(headers, {row.label for row in rows})
    routed: dict[str, bool] = {}  # expert module: some expert of it has a non-zero gradient
    for module, experts in by_module.items():
        live = [row for row in experts if not row.all_zero]
        routed[module] = bool(live)
        if not live:
            continue  # a layer without any gradient is a router's or a batch's story
        for row in experts:
            if row.all_zero:
                detail = (
                    f"every gradient element of expert {row.index} "
                    f"({_plural(len(row.params), 'parameter')}, {row.numel} elements) is zero, "
                    f"while {len(live)} of the layer's {len(experts)} experts have non-zero "
                    "ones: no token was routed to it"
                )
                issues.append(ExpertIssue("expert_never_routed", row.label, row.ranks, detail))
    for param in stats.params:
        layer = router_layer(param.name)
        if layer is None or not routed.get(f"{layer}.experts", False):
            continue
        if param.numel > 0 and param.zeros == param.numel:
            detail = (
                f"the router's gradient is zero in all {param.numel} elements while the "
                "layer's experts have gradients: the routing weights get no gradient "
                "(detached from the loss, or frozen)"
            )
            ranks = tuple(sorted(set(param.ranks)))
            issues.append(ExpertIssue("router_zero", param.name, ranks, detail))
    return issues


def _no_gradient(headers: Sequence[tuple[int, RankHeader]], counted: set[str]) -> list[ExpertIssue]:
    """One finding per expert none of whose parameters has a gradient on any rank, and one per
    other MoE parameter without a gradient anywhere (see ``_without_gradient``)."""
    missing = _without_gradient(headers)
    by_expert: dict[str, list[str]] = {}
    for name in missing:
        found = expert_name(name)
        if found is not None and found.label not in counted:
            by_expert.setdefault(found.label, []).append(name)
    issues = []
    reported: set[str] = set()
    for label, names in by_expert.items():
        ranks = tuple(sorted({rank for name in names for rank in missing[name]}))
        detail = (
            f"no parameter of this expert has a gradient on any rank "
            f"({_plural(len(names), 'parameter')} recorded without one): never in the "
            "backward pass, or frozen"
        )
        issues.append(ExpertIssue("no_gradient", label, ranks, detail))
        reported.update(names)
    for name, ranks in missing.items():
        if name in reported:
            continue
        detail = (
            f"recorded on {_plural(len(ranks), 'rank')}, with a gradient on none: never in "
            "the backward pass (a router detached, an expert never called), or frozen"
        )
        issues.append(ExpertIssue("no_gradient", name, tuple(sorted(set(ranks))), detail))
    return issues
