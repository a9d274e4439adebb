"""Checkpoints in Hugging Face's safetensors layout, read as DCP checkpoints of weights.

DCP's ``HuggingFaceStorageWriter`` writes ``model-K-of-N.safetensors`` files and
``model.safetensors.index.json`` (consolidated), or, saved distributed, one
``shard-R-model-K-of-N.safetensors`` per rank whose ``DCP_SHARDING_INFO`` metadata gives each
chunk's offsets (as observed from torch 2.13's writer with FSDP2 on 2 gloo ranks); a Hugging Face
model folder is the first kind. There is no ``.metadata``: gradstat read such a folder as rank
files and refused it ("a safetensors file without gradstat metadata"). Each statistic is held
against float64 sums of the tensors saved, computed here with ``math.fsum``.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from gradstat.snapshot import save_rank
from tests._cli import run_gradstat
from tests._params import param_with

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    weights = {
        "model.layers.0.mlp.up_proj.weight": torch.randn(5, 7, generator=gen),
        "model.layers.0.mlp.up_proj.bias": torch.randn(5, generator=gen),
        "model.norm.weight": torch.randn(7, generator=gen).to(torch.bfloat16),
        "lm_head.weight": torch.randn(3, 7, generator=gen),
    }
    weights["model.layers.0.mlp.up_proj.weight"][1] = 0.0
    return weights


def _expected(weights: dict[str, torch.Tensor]) -> tuple[float, float, float, int]:
    values = [float(v) for tensor in weights.values() for v in tensor.double().reshape(-1)]
    l2 = math.sqrt(math.fsum(v * v for v in values))
    return l2, math.fsum(abs(v) for v in values), max(abs(v) for v in values), values.count(0.0)


def _per_rank(folder: Path, weights: dict[str, torch.Tensor]) -> None:
    """Two ranks' files as the distributed writer leaves them: each tensor's rows split
    unevenly (3 + 2 of 5; 4 + 3 of 7), a rank's chunk at its offsets."""
    folder.mkdir(parents=True)
    for rank in range(2):
        held, offsets = {}, {}
        for name, tensor in weights.items():
            first = (tensor.shape[0] + 1) // 2
            start, stop = (0, first) if rank == 0 else (first, tensor.shape[0])
            held[name] = tensor[start:stop].clone()
            offsets[name] = {"saved_offsets": [start] + [0] * (tensor.dim() - 1)}
        metadata = {"DCP_VERSION": "1.0", "DCP_SHARDING_INFO": json.dumps(offsets)}
        save_file(held, folder / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors", metadata)


def _json(*args: str | Path) -> dict:
    done = run_gradstat(*args, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    found: dict = json.loads(done.stdout)
    return found


def test_hugging_face_checkpoints_read_as_weights(tmp_path: Path) -> None:
    weights = _weights()
    whole = tmp_path / "whole"
    dcp.save(weights, storage_writer=HuggingFaceStorageWriter(path=str(whole)))
    assert (whole / "model.safetensors.index.json").exists()
    _per_rank(tmp_path / "per-rank", weights)
    l2, l1, largest, zeros = _expected(weights)
    for folder in (whole, tmp_path / "per-rank"):
        for p, expected in (("2", l2), ("1", l1), ("inf", largest)):
            report = _json("norm", folder, "-p", p)
            assert report["snapshot"]["source"] == "dcp" and report["snapshot"]["kind"] == "weight"
            assert report["total_norm"] == pytest.approx(expected, rel=1e-12), (folder, p)
        assert _json("zeros", folder)["num_zeros"] == zeros == 7  # the zeroed row
        assert _json("audit", folder)["findings"] == []
        # Named by parameter, as DCP's "model." root is read: "lm_head.weight" as it is.
        names = {row["name"] for row in _json("norm", folder)["params"]}
        assert names == {"layers.0.mlp.up_proj.weight", "layers.0.mlp.up_proj.bias",
                         "norm.weight", "lm_head.weight"}  # fmt: skip
    # Two checkpoints of weights compare as an update: equal weights are flagged unchanged.
    done = run_gradstat("compare", whole, tmp_path / "per-rank", "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    rows = json.loads(done.stdout)["params"]
    assert len(rows) == 4 and all(row["max_abs_diff"] == 0.0 for row in rows), rows
    assert all(row["flags"] == ["unchanged"] for row in rows), rows


def test_a_missing_file_of_a_hugging_face_checkpoint_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    weights = _weights()
    whole = tmp_path / "whole"
    dcp.save(weights, storage_writer=HuggingFaceStorageWriter(path=str(whole)))
    (data,) = whole.glob("model-*.safetensors")
    data.unlink()
    per_rank = tmp_path / "per-rank"
    _per_rank(per_rank, weights)
    # The first rank's file gone: its chunks at offset 0 are the ones the second lacks.
    (per_rank / "shard-00001-model-00001-of-00001.safetensors").unlink()
    for folder, said in (
        (whole, f"{data}: named by model.safetensors.index.json, but missing"),
        (per_rank, "no file shard-00001-model-00001-of-00001.safetensors"),
    ):
        done = run_gradstat("norm", folder)
        assert done.returncode == 2 and done.stdout == "", done.stdout
        (line,) = done.stderr.splitlines()
        assert said in line, line


def test_a_rank_file_without_gradstat_metadata_is_named_not_read_as_weights(
    tmp_path: Path,
) -> None:
    """A snapshot whose first rank file lost its gradstat metadata is no Hugging Face
    checkpoint: it is named in one line, and nothing is read as weights."""
    save_file({"w": torch.ones(3)}, tmp_path / "rank-00000.safetensors", {"format": "pt"})
    param = param_with(torch.full((3,), 2.0), tensor_model_parallel=False)
    save_rank(tmp_path, [("w", param)], rank=1, world_size=2, coords={"dp": [1, 2]})
    done = run_gradstat("norm", tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    (line,) = done.stderr.splitlines()
    assert f"{tmp_path / 'rank-00000.safetensors'}: a safetensors file without gradstat" in line
    assert "beside gradstat rank files (rank-00001.safetensors)" in line, line


@pytest.mark.parametrize(
    ("header", "said"),
    [
        (b'{"deep":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply to parse"),
        (b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{}}', "lists 'w' twice"),
    ],
)
def test_a_hostile_header_in_a_hugging_face_checkpoint_is_one_line(
    tmp_path: Path, header: bytes, said: str
) -> None:
    save_file({"a": torch.ones(2)}, tmp_path / "model-00001-of-00002.safetensors")
    second = tmp_path / "model-00002-of-00002.safetensors"
    second.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    done = run_gradstat("norm", tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"gradstat: error: {second}: ") and said in line, line


def _save_raw(tensors: dict[str, tuple[str, list[int], bytes]], path: Path) -> None:
    """A safetensors file written byte by byte: name -> (dtype code, shape, data), for dtypes
    that ``save_file`` does not take."""
    header: dict[str, object] = {}
    data = b""
    for name, (code, shape, raw) in tensors.items():
        header[name] = {
            "dtype": code,
            "shape": shape,
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize(
    ("code", "dtype"),
    [
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"),
        ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
        ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
        ("F8_E8M0", "float8_e8m0fnu"),
    ],
)
def test_float8_weights_left_out_are_warned_of(tmp_path: Path, code: str, dtype: str) -> None:
    """A quantized model's float8 weights (or its MX block scales, E8M0) are no dtype gradstat
    reads: left out, as integer buffers are, but said on every command (``inspect`` alone named
    them); each safetensors float8 code is known, not a refusal of the whole checkpoint."""
    f32 = struct.Struct("<f")
    _save_raw(
        {
            "model.embed.weight": ("F32", [1, 2], f32.pack(3.0) + f32.pack(4.0)),
            "model.q.scale": ("F32", [1], f32.pack(2.0)),
            "model.q.weight": (code, [2, 2], bytes([0x38, 0x40, 0x48, 0x50])),
            "model.rope.ids": ("I64", [3], struct.pack("<3q", 0, 1, 2)),  # no warning of its own
        },
        tmp_path / "model.safetensors",
    )
    report = _json("norm", tmp_path)
    assert report["total_norm"] == pytest.approx(math.sqrt(9 + 16 + 4), rel=1e-12)
    expected = (
        f"{tmp_path}: 1 of the kind read left out of every statistic, of a dtype gradstat does "
        f"not read ({dtype}): model.q.weight"
    )
    assert report["warnings"] == [expected]
    done = run_gradstat("zeros", tmp_path)
    assert done.returncode == 0 and done.stderr == f"gradstat: warning: {expected}\n"


def test_the_report_names_the_layout(tmp_path: Path) -> None:
    """A Hugging Face folder is read as a DCP checkpoint (the JSON's source says ``dcp``), but
    the report's first line names what it is."""
    save_file({"model.w": torch.ones(2, 3)}, tmp_path / "model.safetensors")
    done = run_gradstat("norm", tmp_path)
    assert done.returncode == 0
    assert done.stdout.splitlines()[0] == f"{tmp_path}: Hugging Face checkpoint, model weights"
    assert _json("norm", tmp_path)["snapshot"]["source"] == "dcp"
