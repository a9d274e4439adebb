"""Where a DTensor gradient's local shard lies on its device mesh, and which shards count.

A DTensor gradient counts by its placements: pieces that are ``Shard`` (``_StridedShard``
included) on a mesh dimension are disjoint and all count; a ``Replicate`` dimension holds
copies, counted once (at coordinate 0); ``Partial`` is a gradient still pending its reduction,
which no norm can be taken of. A mesh may be a slice of a larger (root) mesh: a module left out
of a TP plan lives on the data-parallel slice and is a copy on every TP rank. The root's
dimensions outside the slice hold such copies too, except a pipeline dimension, whose ranks
hold other layers, and, for a Megatron parameter marked ``tensor_model_parallel``, a TP
dimension, along which Megatron splits it without saying so in the placements.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MeshPlacement",
    "describe",
    "is_pipeline_dim",
    "is_tensor_parallel_dim",
    "placement_code",
    "root_mesh",
    "valid_code",
]

_CODE = re.compile(r"^(R|P|S\(\d+\))$")


def is_pipeline_dim(name: str) -> bool:
    """Mesh dimensions whose ranks hold different layers, by their name in any case (``pp``,
    ``PP``, ``pipeline``, ``pipe``, ``stage``...)."""
    name = name.lower()
    return name.startswith("pp") or "pipe" in name or "stage" in name


def is_tensor_parallel_dim(name: str) -> bool:
    """Mesh dimensions named like a tensor-parallel axis, in any case (``tp``, ``etp``,
    ``TP``, ``tensor...``)."""
    name = name.lower()
    return name in ("tp", "etp") or name.startswith("tp") or "tensor" in name


def placement_code(placement: Any) -> str:
    """``S(d)`` for Shard and _StridedShard (disjoint pieces either way), ``R``, ``P``."""
    if placement.is_replicate():
        return "R"
    if placement.is_partial():
        return "P"
    dim = getattr(placement, "dim", None)
    if isinstance(dim, int):  # Shard; _StridedShard is not is_shard() in torch 2.13
        return f"S({dim})"
    raise ValueError(f"DTensor placement {placement!r} is not Shard, Replicate or Partial")


def valid_code(code: Any) -> bool:
    return isinstance(code, str) and _CODE.match(code) is not None


@dataclass(frozen=True)
class MeshPlacement:
    """Where one DTensor gradient's local shard sits.

    Attributes:
        mesh_shape: the DTensor's mesh.
        coordinate: this rank's coordinate on it.
        placements: one code per mesh dimension: ``S(d)``, ``R`` or ``P``.
        global_shape: the full tensor's shape.
        mesh_dim_names: the mesh's dimension names, when it has them.
        global_offset: where the local shard starts in the full tensor (None: not recorded).
        copies: the root mesh's dimensions outside this mesh that hold copies of the shard,
            as ``(name, rank, size)``: pipeline dimensions are left out.
    """

    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...]
    placements: tuple[str, ...]
    global_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None = None
    global_offset: tuple[int, ...] | None = None
    copies: tuple[tuple[str, int, int], ...] = ()

    def at(
        self, coordinate: tuple[int, ...], global_offset: tuple[int, ...] | None
    ) -> MeshPlacement:
        """The shard of the same DTensor at ``coordinate`` and ``global_offset``: a copy of
        this one's fields (0.8 us, where the frozen dataclass's ``__init__`` takes 1.8)."""
        twin = object.__new__(MeshPlacement)
        state = twin.__dict__
        state.update(self.__dict__)
        state["coordinate"], state["global_offset"] = coordinate, global_offset
        return twin

    def dim_name(self, dim: int) -> str:
        return self.mesh_dim_names[dim] if self.mesh_dim_names else f"dim {dim}"

    def partial_dims(self) -> list[str]:
        """The mesh dimensions on which the gradient is Partial (pending a reduction)."""
        if "P" not in self.placements:  # the common case, at the cost of a tuple's scan
            return []
        return [self.dim_name(dim) for dim, code in enumerate(self.placements) if code == "P"]

    def is_replica(self, tensor_parallel: bool = False, *, across_root: bool = True) -> bool:
        """True when another rank's shard holding the same values is the one that counts.

        Args:
            tensor_parallel: the parameter is marked ``tensor_model_parallel`` (Megatron): a
                TP-named root dimension outside the mesh splits it rather than copying it.
            across_root: also count the copies along the root mesh; False: the DTensor's own
                placements alone (Megatron's attribute filters removed the other copies).
        """
        return any(index != 0 for _, index, _ in self.copy_dims(tensor_parallel, across_root))

    def copy_dims(
        self, tensor_parallel: bool = False, across_root: bool = True
    ) -> list[tuple[str, int, int]]:
        """The dimensions along which other ranks hold copies of this shard, as ``(name, this
        rank's coordinate, size)``: its mesh's Replicate dimensions, then (``across_root``) the
        root's that hold copies (see :meth:`is_replica`); dimensions of size 1 hold none."""
        if "R" not in self.placements and not (across_root and self.copies):
            return []  # a shard that every rank holds its own of (FSDP2's): no copies
        found = [
            (self.dim_name(dim), index, size)
            for dim, (code, index, size) in enumerate(
                zip(self.placements, self.coordinate, self.mesh_shape, strict=True)
            )
            if code == "R" and size > 1
        ]
        if across_root:
            found += [
                (name, rank, size)
                for name, rank, size in self.copies
                if size > 1 and not (tensor_parallel and is_tensor_parallel_dim(name))
            ]
        return found


def root_mesh(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced from (itself when it is no slice)."""
    getter = getattr(mesh, "_get_root_mesh", None)
    root = getter() if getter is not None else None
    return mesh if root is None else root


def _copy_dims(mesh: Any) -> tuple[tuple[str, int, int], ...]:
    """The root mesh's dimensions that ``mesh`` (a slice of it) does not span, but pipeline.

    Raises:
        ValueError: the mesh spans part of a root dimension (gradstat cannot tell its copies).
    """
    root = root_mesh(mesh)
    if root is mesh or root.ndim == mesh.ndim:
        return ()
    coordinate = root.get_coordinate()
    if coordinate is None:
        raise ValueError("a DTensor gradient's root mesh does not contain this rank")
    members = set(mesh.mesh.flatten().tolist())
    names = root.mesh_dim_names or tuple(f"dim{dim}" for dim in range(root.ndim))
    grid = root.mesh
    copies = []
    for dim in range(root.ndim):
        index = list(coordinate)
        line = []
        for position in range(root.shape[dim]):
            index[dim] = position
            line.append(int(grid[tuple(index)]))
        inside = sum(rank in members for rank in line)
        if inside == len(line) or is_pipeline_dim(names[dim]):
            continue
        if inside != 1:
            raise ValueError(
                f"a DTensor gradient's mesh {tuple(mesh.shape)} spans {inside} of the "
                f"{len(line)} ranks of root mesh dimension {names[dim]!r}: its copies are "
                "ambiguous"
            )
        copies.append((names[dim], int(coordinate[dim]), int(root.shape[dim])))
    return tuple(copies)


_COPIES: dict[int, tuple[Any, tuple[tuple[str, int, int], ...]]] = {}


def _cached_copy_dims(mesh: Any) -> tuple[tuple[str, int, int], ...]:
    # Meshes live as long as the job; the entry keeps its mesh so that its id is not reused.
    entry = _COPIES.get(id(mesh))
    if entry is None or entry[0] is not mesh:
        entry = _COPIES[id(mesh)] = (mesh, _copy_dims(mesh))
    return entry[1]


def describe(grad: Any, with_offset: bool = False) -> MeshPlacement:
    """The placement of a DTensor gradient's local shard on this rank.

    Args:
        grad: a DTensor.
        with_offset: also compute where the local shard starts in the full tensor.

    Raises:
        ValueError: the DTensor's mesh does not contain this rank, or its copies are ambiguous.
    """
    mesh = grad.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("a DTensor gradient lives on a mesh this rank is not part of")
    placements = tuple(placement_code(placement) for placement in grad.placements)
    offset = None
    if with_offset and "P" not in placements:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, start = compute_local_shape_and_global_offset(grad.shape, mesh, grad.placements)
        if tuple(shape) == tuple(grad.to_local().shape):
            offset = tuple(int(value) for value in start)
    names = mesh.mesh_dim_names
    return MeshPlacement(
        mesh_shape=tuple(int(size) for size in mesh.shape),
        coordinate=tuple(int(index) for index in coordinate),
        placements=placements,
        global_shape=tuple(int(size) for size in grad.shape),
        mesh_dim_names=None if names is None else tuple(names),
        global_offset=offset,
        copies=_cached_copy_dims(mesh),
    )
