"""The rules of ``mlx_mla.distributed`` that need no second process: which group sizes can
split a model, and which weight files a pipeline rank needs."""

from __future__ import annotations

import json

import pytest

import mlx_mla
from benchmarks.common import V2, V2_LITE
from benchmarks.distributed import Rank
from mlx_mla import ModelArgs, ModelLoadError
from mlx_mla.distributed import check_group_size, pipeline_range, rank_weight_files
from testdata import writable_copy

DEMO = json.loads((mlx_mla.DEMO_MODEL / "config.json").read_text())
SHARDS = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]


def test_pipeline_split_is_mlx_lms():
    """27 layers (V2-Lite) over 2 ranks: rank 0 the last 14 (the low rank takes the extra
    one), rank 1 the first 13; 4 over 3: 2 + 1 + 1."""
    assert pipeline_range(27, Rank(0, 2)) == (13, 27)
    assert pipeline_range(27, Rank(1, 2)) == (0, 13)
    assert [pipeline_range(4, Rank(r, 3)) for r in range(3)] == [(2, 4), (1, 2), (0, 1)]


@pytest.mark.parametrize("mode, size, message", [
    ("pipeline", 5, "cannot split the model over 5 pipeline ranks: a pipeline over 5 ranks "
                    "needs at least 5 decoder layers, and the model has 4; use 2, 3 or 4 ranks"),
    ("tensor", 3, "cannot split the model over 3 tensor-parallel ranks: num_attention_heads "
                  "(8) is not divisible by 3; use 2, 4 or 8 ranks"),
])
def test_bad_group_size_is_one_line_with_the_sizes_that_work(mode, size, message):
    with pytest.raises(ModelLoadError) as e:
        check_group_size(ModelArgs.from_dict(DEMO), size, mode)
    assert str(e.value) == message


def test_good_group_sizes_pass():
    args = ModelArgs.from_dict(DEMO)
    for size in (1, 2, 4, 8):
        check_group_size(args, size, "tensor")
    for size in (1, 2, 3, 4):
        check_group_size(args, size, "pipeline")


def test_quantization_groups_limit_tensor_parallel():
    """A quantized module whose input is split needs whole groups per rank. V2-Lite's dense
    layer 0 (intermediate_size 10944 = 171 groups of 64) cannot be split 2 ways at 4-bit
    group 64, nor can its experts (1408 = 11 x 128) in groups of 128; in float it can.
    DeepSeek-V2 (236B) at 4-bit group 64 splits over 2, 4 and 8 ranks."""
    q64 = {"group_size": 64, "bits": 4}
    check_group_size(ModelArgs.from_dict(V2_LITE), 2, "tensor")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.down_proj is quantized "
                       r"in groups of 64, and its input \(10944\) split 2 ways is not a whole "
                       r"number of groups; run it on one rank, or with --pipeline"):
        check_group_size(ModelArgs.from_dict({**V2_LITE, "quantization": q64}), 2, "tensor")
    q128 = {"model.layers.1.mlp.switch_mlp.down_proj": {"group_size": 128, "bits": 4}}
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.switch_mlp\.down_proj "
                       r"is quantized in groups of 128, and its input \(1408\) split 2 ways"):
        check_group_size(ModelArgs.from_dict({**V2_LITE, "intermediate_size": 10880,
                                              "quantization": {**q64, **q128}}), 2, "tensor")
    for size in (2, 4, 8):
        check_group_size(ModelArgs.from_dict({**V2, "quantization": q64}), size, "tensor")


def test_rank_weight_files_from_the_index():
    """The demo's shards: 1 = layers 0-1 + embeddings + head, 2 = layers 1-2, 3 = 2-3,
    4 = layer 3 + final norm. A rank needs the files of its layers and of no layer."""
    folder = mlx_mla.DEMO_MODEL
    assert rank_weight_files(folder, range(0, 2)) == [SHARDS[0], SHARDS[1], SHARDS[3]]
    assert rank_weight_files(folder, range(3, 4)) == [SHARDS[0], SHARDS[2], SHARDS[3]]
    assert rank_weight_files(folder, None) == SHARDS


def test_rank_weight_files_without_index_or_with_a_gap(tmp_path):
    folder = writable_copy(mlx_mla.DEMO_MODEL, tmp_path / "m")
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = {k: v for k, v in data["weight_map"].items() if ".layers.2." not in k}
    index.write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match=r"lists no tensors for layers \[2\]"):
        rank_weight_files(folder, range(2, 4))
    index.unlink()  # without an index only the headers would say: every file
    assert rank_weight_files(folder, range(2, 4)) == SHARDS
