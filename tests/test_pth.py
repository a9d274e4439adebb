"""torch.save files read without torch.load: tensors bitwise as saved, everything else refused.

Files come from the installed torch's own ``torch.save`` (zip records aligned to 64 bytes, the
alignment held in each local header's extra field, none in the central directory's), or are
written here member by member (``_write_zip``, aligned the same way) where a test needs a pickle
or an archive torch.save would not write.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from gradstat.errors import SnapshotError
from gradstat.snapshot import pth
from gradstat.snapshot.container import mapped
from gradstat.snapshot.pth import read_pth


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _leaves(tree: dict[str, Any], above: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    found = []
    for key, value in tree.items():
        if isinstance(value, dict):
            found += _leaves(value, (*above, key))
        else:
            found.append(((*above, key), value))
    return found


def _check_round_trip(path: Path, saved: dict[str, Any]) -> None:
    """Every tensor of ``saved`` read back from ``path`` bitwise, its path and order kept."""
    read = read_pth(path)
    expected = _leaves(saved)
    assert list(read.paths.values()) == [key_path for key_path, _ in expected]
    assert list(read.paths) == ["/".join(key_path) for key_path, _ in expected]
    assert read.container.metadata == {} and read.container.data_start == 0
    with mapped(read.container) as tensors:
        assert list(tensors) == list(read.paths)
        for key_path, tensor in expected:
            got = tensors["/".join(key_path)]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape
            assert torch.equal(_bytes(got), _bytes(tensor)), key_path


def _refused(path: Path, *parts: str) -> str:
    with pytest.raises(SnapshotError) as caught:
        read_pth(path)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    for part in parts:
        assert part in message
    return message


def test_nested_dicts_of_each_dtype_read_bitwise(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    buffer = torch.randn(1000, generator=generator)
    one_by_four = torch.randn(1, 4, generator=generator).t()  # stride (1, 4): contiguous
    assert one_by_four.is_contiguous() and one_by_four.stride() == (1, 4)
    saved = {
        "model_chunk0": {
            "decoder.layers.0.mlp.linear_fc1.weight": buffer[10:110].view(10, 10),
            "decoder.layers.0.mlp.linear_fc1.bias": buffer[500:520],
            "bf16": torch.randn(7, 3, generator=generator).to(torch.bfloat16),
            "fp16": torch.randn(5, generator=generator).to(torch.float16),
            "fp64": torch.randn(2, 3, 4, generator=generator, dtype=torch.float64),
            "scalar": torch.tensor(-2.5),
            "empty": torch.empty(0, 5),
            "empty_view": buffer[3:3],
            "column": one_by_four,
        },
        "model_chunk1": {"deeper": {"still": {"w": torch.arange(6.0).view(2, 3)}}},
        "ordered": OrderedDict(x=torch.full((3,), float("nan"), dtype=torch.bfloat16)),
        "nothing": {},
    }
    path = tmp_path / "mp_rank_00.pth"
    torch.save(saved, path)
    _check_round_trip(path, saved)
    loaded = torch.load(path, weights_only=True)
    _check_round_trip(path, loaded)


def test_views_of_one_grad_buffer_share_one_storage(tmp_path: Path) -> None:
    """Megatron's main_grad on CPU: views into one contiguous buffer, saved as one storage."""
    buffer = torch.randn(
        64 + 12 + 30, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1)
    )
    shapes = {"a.weight": (8, 8), "a.bias": (12,), "b.weight": (3, 10)}
    grads, position = {}, 0
    for name, shape in shapes.items():
        count = torch.Size(shape).numel()
        grads[name] = buffer[position : position + count].view(shape)
        position += count
    path = tmp_path / "mp_rank_00.pth"
    torch.save({"model_chunk0": grads}, path)
    with zipfile.ZipFile(path) as archive:
        assert sum("/data/" in name for name in archive.namelist()) == 1
    _check_round_trip(path, {"model_chunk0": grads})
    slots = read_pth(path).container.slots
    assert slots["model_chunk0/a.bias"].start == slots["model_chunk0/a.weight"].start + 64 * 2
    assert slots["model_chunk0/b.weight"].start == slots["model_chunk0/a.bias"].end


def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def _write_zip(
    path: Path, members: dict[str, bytes], compression: int = zipfile.ZIP_STORED
) -> None:
    """A zip of ``members`` whose data records begin at multiples of 64, as torch.save's do."""
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = compression
            assert archive.fp is not None
            pad = -(archive.fp.tell() + 30 + len(name.encode()) + 4) % 64
            info.extra = struct.pack("<HH", 0xCAFE, pad) + bytes(pad)
            archive.writestr(info, data)


def _saved(tmp_path: Path, tree: Any, name: str = "mp_rank_00.pth") -> Path:
    path = tmp_path / name
    torch.save(tree, path)
    return path


def _with_pickle(tmp_path: Path, data_pkl: bytes) -> Path:
    """A torch.save file of one tensor whose data.pkl is ``data_pkl``."""
    members = _members(_saved(tmp_path, {"x": torch.zeros(4)}, "template.pth"))
    members["template/data.pkl"] = data_pkl
    path = tmp_path / "forged.pth"
    _write_zip(path, members)
    return path


def test_rewritten_archive_reads_as_torch_save_wrote_it(tmp_path: Path) -> None:
    """The control for the rewritten archives below: unchanged, the rewrite reads back."""
    saved = {"x": torch.arange(4.0)}
    members = _members(_saved(tmp_path, saved, "template.pth"))
    _write_zip(tmp_path / "copy.pth", members)
    _check_round_trip(tmp_path / "copy.pth", saved)


class _RunsCode:
    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.sentinel}",))


def test_a_pickle_that_would_run_code_runs_nothing(tmp_path: Path) -> None:
    sentinel = tmp_path / "SENTINEL"
    path = _saved(tmp_path, {"model_chunk0": {"w": torch.zeros(2), "evil": _RunsCode(sentinel)}})
    _refused(path, f"holds a pickled {os.system.__module__}.system", "gradstat unpickles nothing")
    assert not sentinel.exists()
    # The control: torch.load without weights_only runs the command.
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    assert not sentinel.exists()
    torch.load(path, weights_only=False)
    assert sentinel.exists()


class _Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "tree, global_name",
    [
        ({"w": torch.nn.Parameter(torch.zeros(2))}, "torch._utils._rebuild_parameter"),
        (
            {"w": torch.zeros(2).as_subclass(_Subclass)},
            "torch._tensor._rebuild_from_type_v2",
        ),
        ({"w": torch.zeros(2, dtype=torch.float8_e4m3fn)}, "torch._utils._rebuild_tensor_v3"),
    ],
    ids=["parameter", "tensor subclass", "float8"],
)
def test_what_torch_save_builds_beyond_plain_tensors_is_refused(
    tmp_path: Path, tree: Any, global_name: str
) -> None:
    _refused(_saved(tmp_path, tree), f"holds a pickled {global_name}, not nested dicts")


def test_a_forged_global_is_refused_before_it_is_called(tmp_path: Path) -> None:
    sentinel = tmp_path / "SENTINEL"
    payload = f"open({str(sentinel)!r}, 'w')"
    data_pkl = b"\x80\x02}X\x01\x00\x00\x00xcbuiltins\neval\nX" + struct.pack("<I", len(payload))
    data_pkl += payload.encode() + b"\x85Rs."
    assert pickle.loads(data_pkl) is not None and sentinel.exists()  # the payload works
    sentinel.unlink()
    _refused(_with_pickle(tmp_path, data_pkl), "holds a pickled builtins.eval")
    assert not sentinel.exists()


@pytest.mark.parametrize(
    "value, what",
    [
        ([torch.zeros(2)], "a list"),
        ((torch.zeros(2),), "a tuple"),
        (3, "an int"),
        ("text", "a str"),
        (None, "None"),
        (1.5, "a float"),
    ],
)
def test_anything_but_a_tensor_or_dict_is_refused_by_its_key_path(
    tmp_path: Path, value: Any, what: str
) -> None:
    tree = {"model_chunk0": {"ok": torch.zeros(2), "decoder.layers.0.x": value}}
    _refused(_saved(tmp_path, tree), "'model_chunk0/decoder.layers.0.x' holds " + what)


@pytest.mark.parametrize("top", [torch.zeros(2), [torch.zeros(2)], 7])
def test_a_top_level_that_is_not_a_dict_is_refused(tmp_path: Path, top: Any) -> None:
    _refused(_saved(tmp_path, top), "not a dict of tensors")


@pytest.mark.parametrize("key", [1, "a/b", ("a",)])
def test_a_key_that_is_no_slot_name_is_refused(tmp_path: Path, key: Any) -> None:
    _refused(_saved(tmp_path, {"chunk": {key: torch.zeros(2)}}), repr(key), "under 'chunk'")


def test_a_dict_met_twice_is_refused(tmp_path: Path) -> None:
    shared = {"w": torch.zeros(2)}
    _refused(_saved(tmp_path, {"a": shared, "b": shared}), "'b' is a dict met before")


@pytest.mark.parametrize(
    "tensor",
    [torch.randn(4, 4).t(), torch.zeros(3).expand(4, 3), torch.randn(6, 4)[:, 1:3]],
    ids=["transposed", "expanded", "sliced"],
)
def test_a_view_that_is_not_contiguous_is_refused(tmp_path: Path, tensor: torch.Tensor) -> None:
    assert not tensor.is_contiguous()
    _refused(_saved(tmp_path, {"chunk": {"w": tensor}}), "'chunk/w'", "not contiguous")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_a_dtype_gradstat_does_not_read_is_refused(tmp_path: Path, dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    _refused(
        _saved(tmp_path, {"chunk": {"steps": torch.zeros(3, dtype=dtype)}}),
        f"'chunk/steps' is {name}",
    )


def test_the_legacy_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pth"
    torch.save({"w": torch.zeros(2)}, path, _use_new_zipfile_serialization=False)
    _refused(path, "not a PyTorch zip archive", "_use_new_zipfile_serialization=False")


def test_a_truncated_file_is_refused_wherever_it_is_cut(tmp_path: Path) -> None:
    whole = _saved(tmp_path, {"chunk": {"w": torch.randn(1000), "b": torch.randn(10)}}).read_bytes()
    with zipfile.ZipFile(tmp_path / "mp_rank_00.pth") as archive:
        directory = archive.start_dir
    assert 0 < directory < len(whole) - 22
    for cut in (
        len(whole) // 2,
        directory + 10,
        (directory + len(whole)) // 2,
        len(whole) - 8,
        8,
        1,
    ):
        path = tmp_path / f"cut_{cut}.pth"
        path.write_bytes(whole[:cut])
        _refused(path, "not a PyTorch zip archive", "truncated")


def test_a_compressed_member_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "deflated.pth"
    _write_zip(path, _members(_saved(tmp_path, {"w": torch.zeros(100)})), zipfile.ZIP_DEFLATED)
    _refused(path, "is compressed", "save it again")


def test_a_big_endian_file_is_refused(tmp_path: Path) -> None:
    members = _members(_saved(tmp_path, {"w": torch.zeros(2)}))
    assert members["mp_rank_00/byteorder"] == b"little"
    members["mp_rank_00/byteorder"] = b"big"
    _write_zip(tmp_path / "big.pth", members)
    _refused(tmp_path / "big.pth", "'big'-endian")


def test_a_missing_storage_member_is_refused(tmp_path: Path) -> None:
    members = _members(_saved(tmp_path, {"chunk": {"w": torch.zeros(2)}}))
    del members["mp_rank_00/data/0"]
    _write_zip(tmp_path / "holed.pth", members)
    _refused(tmp_path / "holed.pth", "tensor 'chunk/w'", "'mp_rank_00/data/0', is missing")


def test_a_storage_member_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    members = _members(_saved(tmp_path, {"chunk": {"w": torch.zeros(4)}}))
    members["mp_rank_00/data/0"] = members["mp_rank_00/data/0"][:12]
    _write_zip(tmp_path / "short.pth", members)
    _refused(tmp_path / "short.pth", "tensor 'chunk/w'", "holds 12 bytes")


class _Storage:
    def __init__(self, storage_type: Any, key: str, numel: int) -> None:
        self.storage_type, self.key, self.numel = storage_type, key, numel


class _View:
    """Pickles as torch.save pickles a tensor, with whatever view it is given."""

    def __init__(self, storage: _Storage, offset: Any, size: Any, stride: Any) -> None:
        self.args: tuple[Any, ...] = (storage, offset, size, stride, False, OrderedDict())

    def __reduce__(self) -> tuple[Any, ...]:
        return (torch._utils._rebuild_tensor_v2, self.args)


class _StoragePickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", obj.storage_type, obj.key, "cpu", obj.numel)
        return None


def _forged(tmp_path: Path, tree: dict[str, Any]) -> Path:
    """A torch.save-like file of ``tree``'s views of storage '0' (four float32 zeros)."""
    data = io.BytesIO()
    _StoragePickler(data, protocol=2).dump(tree)
    members = _members(_saved(tmp_path, {"x": torch.zeros(4)}, "template.pth"))
    members["template/data.pkl"] = data.getvalue()
    path = tmp_path / "forged.pth"
    _write_zip(path, members)
    return path


def test_a_forged_view_within_its_storage_reads(tmp_path: Path) -> None:
    """The control for the forged views below: a good one reads back."""
    storage = _Storage(torch.FloatStorage, "0", 4)
    path = _forged(
        tmp_path, {"a": _View(storage, 1, (3,), (1,)), "b": _View(storage, 0, (2, 2), (2, 1))}
    )
    slots = read_pth(path).container.slots
    assert slots["a"].start == slots["b"].start + 4 and slots["a"].end == slots["b"].end


@pytest.mark.parametrize(
    "view, message",
    [
        ((2, (3,), (1,)), "ends at element 5 of a storage of 4"),
        ((-1, (2,), (1,)), "not a tensor's view"),
        ((0, (2, 2), (1,)), "not a tensor's view"),
        ((0, [4], [1]), "not a tensor's view"),
        ((True, (2,), (1,)), "not a tensor's view"),
        ((0, (2**62, 8), (8, 1)), "not a tensor's view"),
    ],
    ids=["past the end", "negative offset", "stride rank", "lists", "bool offset", "huge"],
)
def test_a_forged_view_is_refused(tmp_path: Path, view: tuple[Any, ...], message: str) -> None:
    storage = _Storage(torch.FloatStorage, "0", 4)
    _refused(
        _forged(tmp_path, {"chunk": {"w": _View(storage, *view)}}), "tensor 'chunk/w'", message
    )


def test_one_storage_given_two_dtypes_is_refused(tmp_path: Path) -> None:
    tree = {
        "a": _View(_Storage(torch.FloatStorage, "0", 4), 0, (4,), (1,)),
        "b": _View(_Storage(torch.HalfStorage, "0", 8), 0, (8,), (1,)),
    }
    _refused(_forged(tmp_path, tree), "tensor 'b'", "storage '0' is given as 8 float16")


def test_a_persistent_id_that_is_no_storage_is_refused(tmp_path: Path) -> None:
    tree = {"a": _View(_Storage("FloatStorage", "0", 4), 0, (4,), (1,))}  # a str, not the class
    _refused(_forged(tmp_path, tree), "data.pkl is not a pickle of nested dicts of tensors")


def test_an_oversized_pickle_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _saved(tmp_path, {"w": torch.zeros(2)})
    read_pth(path)
    monkeypatch.setattr(pth, "MAX_HEADER_BYTES", 64)
    _refused(path, "data.pkl is", "more than a dict of tensors needs")


# Reads argv[1] in a process of at most 6 GiB of address space, with gradstat's reader, or
# with C's unpickler (argv[2] "c").
_UNDER_6_GIB = """
import pickle, resource, sys, zipfile
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
if sys.argv[2:] == ["c"]:
    pickle.loads(zipfile.ZipFile(sys.argv[1]).read("template/data.pkl"))
else:
    from gradstat.snapshot.pth import read_pth
    print(len(read_pth(Path(sys.argv[1])).container.slots))
"""


def test_a_memo_index_of_four_billion_costs_nothing(tmp_path: Path) -> None:
    """C's unpickler grows its memo array to twice the index (64 GiB here) and fails under the
    limit; the reader's unpickler keeps its memo in a dict, of one entry."""
    path = _with_pickle(tmp_path, b"\x80\x02}r\xff\xff\xff\xff.")  # {} as memo[2**32 - 1]
    run = [sys.executable, "-c", _UNDER_6_GIB, str(path)]
    c_pickle = subprocess.run([*run, "c"], capture_output=True, text=True)
    assert c_pickle.returncode != 0 and "MemoryError" in c_pickle.stderr
    done = subprocess.run(run, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "0"


def test_a_plain_pickle_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "plain.pth"
    path.write_bytes(pickle.dumps({"w": [1.0, 2.0]}))
    _refused(path, "not a PyTorch zip archive")


def test_an_empty_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.pth"
    path.write_bytes(b"")
    _refused(path, "not a PyTorch zip archive")


def test_a_zip_without_data_pkl_is_refused(tmp_path: Path) -> None:
    _write_zip(tmp_path / "other.zip", {"readme.txt": b"hello"})
    _refused(tmp_path / "other.zip", "0 <archive>/data.pkl members")


def test_a_missing_file_or_a_directory_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path / "absent.pth", "no such file")
    _refused(tmp_path, "is a directory")


def test_a_member_that_fails_its_checksum_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path, {"w": torch.zeros(2)})
    raw = bytearray(path.read_bytes())
    raw[raw.index(b"little")] = ord("L")  # the checksum is the central directory's, unchanged
    path.write_bytes(raw)
    _refused(path, "damaged zip archive", "Bad CRC-32", "byteorder")
