"""DCP metadata unpickled by allowlist: what a ``.metadata`` pickle may build, and nothing else.

A DCP ``.metadata`` file is ``pickle.dump`` of DCP's ``Metadata``, which the stock reader loads
with plain ``pickle.load``. Here DCP's own records (and Megatron ``torch_dist`` extras) become
inert stand-ins (:class:`Inert`: plain objects that only store their pickled state), so none of
DCP's code runs on untrusted bytes, no ``torch.distributed`` import is needed, and a DCP version
that adds or renames fields is read by the attributes it has. torch dtypes, layouts, memory
formats, ``torch.Size``, pure paths and plain containers are built as themselves; any other
global is refused (:class:`Refused`) before it exists. :mod:`gradstat.snapshot.dcp` converts
what comes out into its index records.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict, defaultdict
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import IO, Any

import torch

from gradstat.errors import SnapshotError

__all__ = ["Inert", "MetadataUnpickler", "Refused"]

# DCP's own records, by the module that defines them (and where older versions defined them).
# The planner records appear in Megatron's metadata (its cached ``all_local_plans``).
_DCP_CLASSES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "TensorInfo",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.distributed.checkpoint.planner": frozenset(
        {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"}
    ),
    "torch.distributed._shard.sharded_tensor.metadata": frozenset(
        {"TensorProperties", "MEM_FORMAT_ENCODING"}
    ),
}
_MEGATRON_PREFIX = "megatron.core.dist_checkpointing."
_CONTAINERS: dict[tuple[str, str], Any] = {
    ("builtins", "dict"): dict,
    ("builtins", "list"): list,
    ("builtins", "tuple"): tuple,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("collections", "OrderedDict"): OrderedDict,
    ("collections", "defaultdict"): defaultdict,
}
# Paths (StorageMeta.checkpoint_id) come back as pure paths: no filesystem access.
_PATH_MODULES = frozenset({"pathlib", "pathlib._local"})
_POSIX_PATHS = frozenset({"PosixPath", "PurePosixPath", "Path", "PurePath"})
_WINDOWS_PATHS = frozenset({"WindowsPath", "PureWindowsPath"})


class Inert:
    """A pickled record rebuilt as data only: its state becomes attributes, nothing runs.

    ``_origin`` names the class the pickle asked for. Constructor arguments (an enum member's
    value, a reduce tuple's arguments) are kept in ``_args``; a state that is not a dict (DCP's
    ``TensorProperties`` pickles a tuple) in ``_state``.
    """

    _origin = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Inert:
        inert = object.__new__(cls)
        inert.__dict__["_args"] = args
        return inert

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_args"] = args

    def __setstate__(self, state: Any) -> None:
        if (
            type(state) is tuple
            and len(state) == 2
            and all(part is None or type(part) is dict for part in state)
        ):
            # (dict state, slot state), as pickle writes an object with __slots__.
            merged: dict[Any, Any] = {**(state[0] or {}), **(state[1] or {})}
            state = merged
        if type(state) is dict and all(
            type(key) is str and key.isidentifier() and not key.startswith("__") for key in state
        ):
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state

    def __repr__(self) -> str:
        return f"<inert {self._origin}>"


_STAND_INS: dict[str, type[Inert]] = {}


def _stand_in(module: str, name: str) -> type[Inert]:
    origin = f"{module}.{name}"
    if origin not in _STAND_INS:
        _STAND_INS[origin] = type(name, (Inert,), {"_origin": origin, "__module__": __name__})
    return _STAND_INS[origin]


_LAYOUTS = {str(value): value for value in vars(torch).values() if isinstance(value, torch.layout)}


def _layout_by_name(name: Any) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout``: a layout by its name, nothing else."""
    if type(name) is not str or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"no torch layout is named {name!r}")
    return _LAYOUTS[name]


def _printable(text: str) -> str:
    return text if text.isprintable() else repr(text)


class Refused(SnapshotError):
    """A global the allowlist refuses; raised from ``find_class``, before anything is built."""


class MetadataUnpickler(pickle._Unpickler):
    """DCP metadata by allowlist.

    Python's pure-Python unpickler (as torch's ``weights_only`` unpickler and gradstat's
    ``pth`` reader use): its memo is a dict, where the C unpickler's array grows to the largest
    index a crafted ``LONG_BINPUT`` names.
    """

    def __init__(self, file: IO[bytes], path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if type(module) is str and type(name) is str:
            found = _allowed_global(module, name)
            if found is not None:
                return found
        raise Refused(
            f"{self._path}: refused to unpickle {_printable(str(module))}.{_printable(str(name))}"
            ": a DCP .metadata holds only DCP's metadata records, torch dtypes and sizes and "
            "plain containers, so this file is damaged or crafted; do not load it with "
            "torch.distributed.checkpoint either"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP metadata holds no persistent references")


def _allowed_global(module: str, name: str) -> Any:
    """What ``find_class`` returns for an allowed global, or None for a refused one."""
    if (module, name) in _CONTAINERS:
        return _CONTAINERS[module, name]
    if name in _DCP_CLASSES.get(module, ()) or module.startswith(_MEGATRON_PREFIX):
        return _stand_in(module, name)
    if module == "torch":
        value = vars(torch).get(name)
        if value is torch.Size or isinstance(
            value, (torch.dtype, torch.layout, torch.memory_format)
        ):
            return value
    if (module, name) == ("torch.serialization", "_get_layout"):
        return _layout_by_name
    if module in _PATH_MODULES:
        if name in _POSIX_PATHS:
            return PurePosixPath
        if name in _WINDOWS_PATHS:
            return PureWindowsPath
    return None
