"""Checkpoint files (models.weights): which shards a folder holds, headers, streaming reads and streamed writes
that safetensors itself reads back."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardtune.models import weights


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(4, 3, generator=gen).to(torch.bfloat16),
        "b.weight": torch.randn(5, generator=gen),
        "c.ids": torch.arange(6, dtype=torch.int64),
        "d.mask": torch.tensor([True, False]),
        "e.half": torch.randn(2, 2, generator=gen).half(),
    }


def test_shard_files_prefer_the_index_then_model_safetensors_then_any(tmp_path):
    with pytest.raises(ValueError, match=r"^--base x: no \*\.safetensors weights there"):
        weights.shard_files(tmp_path, "--base x")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    assert weights.shard_files(tmp_path, "m") == [tmp_path / "other.safetensors"]
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    assert weights.shard_files(tmp_path, "m") == [tmp_path / "model.safetensors"]
    index = {"weight_map": {"y": "model-00002-of-00002.safetensors", "x": "model-00001-of-00002.safetensors"}}
    (tmp_path / weights.INDEX).write_text(json.dumps(index))
    assert [p.name for p in weights.shard_files(tmp_path, "m")] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_streamed_shards_read_back_with_safetensors_and_their_headers(tmp_path):
    """Every dtype of the header table round-trips; shards split where the next tensor would pass max_bytes."""
    tensors = _tensors()
    writer = weights.ShardWriter(tmp_path, max_bytes=40)  # a.weight (24 bytes) + b.weight (20) do not fit together
    for name, t in tensors.items():
        writer.add(weights.PendingTensor(name, t.dtype, tuple(t.shape), lambda t=t: t))
    weight_map = writer.finish()
    files = weights.shard_files(tmp_path, "out")
    assert len(files) == len(set(weight_map.values())) > 1
    index = json.loads((tmp_path / weights.INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    back = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)
    shapes, dtypes = weights.read_headers(files)
    assert shapes == {n: tuple(t.shape) for n, t in tensors.items()}
    assert dtypes == {n: t.dtype for n, t in tensors.items()}
    streamed = dict(weights.iter_checkpoint(str(tmp_path)))
    assert all(torch.equal(streamed[n], t) for n, t in tensors.items())


def test_one_small_shard_is_model_safetensors_without_index(tmp_path):
    t = torch.ones(3)
    writer = weights.ShardWriter(tmp_path, max_bytes=1 << 20)
    writer.add(weights.PendingTensor("w", t.dtype, (3,), lambda: t))
    assert writer.finish() == {"w": "model.safetensors"}
    assert not (tmp_path / weights.INDEX).exists()
    assert torch.equal(load_file(str(tmp_path / "model.safetensors"))["w"], t)


class _Mesh:
    """The parts of a DeviceMesh that the loader reads: the rank layout and the dimension names."""

    def __init__(self, layout: list, names: tuple[str, ...] | None):
        self.mesh, self.mesh_dim_names = torch.tensor(layout), names
        self.ndim = self.mesh.ndim


@pytest.mark.parametrize(
    ("layout", "names", "expected"),
    [
        ([0, 1, 2, 3], ("shard",), [0, 1, 2, 3]),  # FULL_SHARD: one shard group of all ranks
        ([0, 1, 2, 3], None, [0, 1, 2, 3]),  # an unnamed 1-D mesh is the shard group
        ([[0, 1], [2, 3]], ("replicate", "shard"), [0, 1, 0, 1]),  # HYBRID_SHARD over 2 nodes of 2
        ([[0], [1], [2], [3]], ("replicate", "shard"), [0, 0, 0, 0]),  # NO_SHARD: shard groups of one rank
        ([[0, 2], [1, 3]], ("shard", "replicate"), [0, 1, 0, 1]),  # the name decides, not the position
    ],
)
def test_a_ranks_shard_index_is_its_coordinate_on_the_shard_dimension(layout, names, expected):
    from shardtune.parallel.loading import _shard_index

    mesh = _Mesh(layout, names)
    assert [_shard_index(r, mesh) for r in range(4)] == expected


def test_a_mesh_without_a_shard_dimension_is_refused():
    from shardtune.parallel.loading import _shard_index

    with pytest.raises(ValueError, match="no 'shard' dimension"):
        _shard_index(0, _Mesh([[0, 1], [2, 3]], ("dp", "tp")))
