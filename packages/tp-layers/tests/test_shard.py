"""Shard metadata, shard/unshard helpers, vocabulary padding and deterministic init."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_tp_layers import (
    ColumnParallelLinear,
    Normal,
    PaddedRows,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    XavierUniform,
    gather_full,
    init_full,
    init_parameters,
    mark_replicated,
    padded_vocab_size,
    param_generator,
    set_shard_spec,
    shard_spec,
    shard_tensor,
    unshard,
    vocab_range,
)


def test_shard_spec_geometry() -> None:
    spec = ShardSpec(
        dim=1, num_shards=4, shard_rank=2, group="tp", full_shape=(6, 8), duplicate=False
    )
    assert spec.local_shape == (6, 2)
    assert spec.local_slice == (slice(None), slice(4, 6))
    assert not spec.is_replicated
    replica = ShardSpec(None, 4, 0, "tp", (6,), False)
    assert replica.local_shape == (6,) and replica.is_replicated
    assert replica.with_rank(3).duplicate and not replica.with_rank(0).duplicate
    assert spec.with_rank(0).local_slice == (slice(None), slice(0, 2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_shards": 0}, r"num_shards \(0\) must be a positive integer"),
        ({"shard_rank": 4}, r"shard_rank \(4\) must lie in \[0, 4\)"),
        ({"dim": 2}, r"dim \(2\) is not a dimension of full_shape \(6, 8\)"),
        ({"full_shape": (6, 9)}, r"full_shape\[1\] \(9\) is not divisible by num_shards \(4\)"),
    ],
)
def test_bad_shard_spec_raises_one_sentence(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {
        "dim": 1, "num_shards": 4, "shard_rank": 0, "group": "tp",
        "full_shape": (6, 8), "duplicate": False,
    }  # fmt: skip
    with pytest.raises(ValueError, match=message) as info:
        ShardSpec(**{**base, **kwargs})  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("dim", [0, 1, -1, None])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_shard_then_unshard_is_identity(dim: int | None, n: int) -> None:
    full = torch.arange(6 * 12, dtype=torch.float32).reshape(6, 12)
    shards = [shard_tensor(full, dim, r, n) for r in range(n)]
    assert torch.equal(unshard(shards, dim), full)
    assert shards[0].data_ptr() != full.data_ptr()  # a copy, never a view of the full tensor


def test_shard_tensor_pads_a_short_vocabulary() -> None:
    spec = ShardSpec(0, 4, 3, "tp", (12, 2), False)
    full = torch.ones(10, 2)  # vocabulary 10, padded to 12 for tp 4
    assert torch.equal(shard_tensor(full, spec), torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match=r"needs rank and num_shards"):
        shard_tensor(full, 0)
    with pytest.raises(ValueError, match=r"dimension 0 of the full tensor \(10\) is not divisible"):
        shard_tensor(full, 0, 0, 4)


def test_set_shard_spec_checks_the_shape() -> None:
    param = nn.Parameter(torch.zeros(3, 8))
    set_shard_spec(param, ShardSpec(0, 2, 1, "tp", (6, 8), False))
    assert shard_spec(param) == ShardSpec(0, 2, 1, "tp", (6, 8), False)
    assert shard_spec(nn.Parameter(torch.zeros(2))) is None
    with pytest.raises(ValueError, match=r"parameter shape \(3, 8\) does not match the shard"):
        set_shard_spec(param, ShardSpec(0, 3, 1, "tp", (6, 8), False))


@pytest.mark.parametrize(
    ("vocab", "tp", "multiple", "padded"),
    [(10, 1, 1, 10), (10, 2, 1, 10), (10, 3, 1, 12), (10, 4, 1, 12), (50257, 8, 128, 51200)],
)
def test_padded_vocab_size_rule(vocab: int, tp: int, multiple: int, padded: int) -> None:
    assert padded_vocab_size(vocab, tp, multiple) == padded
    ranges = [vocab_range(padded, tp, r) for r in range(tp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == padded
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    with pytest.raises(ValueError, match=r"tp \(0\) must be a positive integer"):
        padded_vocab_size(vocab, 0)


def test_param_generator_is_stable_and_name_specific() -> None:
    a = torch.rand(4, generator=param_generator(3, "layers.0.weight"))
    assert torch.equal(a, torch.rand(4, generator=param_generator(3, "layers.0.weight")))
    assert not torch.equal(a, torch.rand(4, generator=param_generator(3, "layers.1.weight")))
    assert not torch.equal(a, torch.rand(4, generator=param_generator(4, "layers.0.weight")))


def test_padded_rows_draw_the_unpadded_weights() -> None:
    unpadded = init_full((10, 4), Normal(1.0), param_generator(0, "w"))
    padded = init_full((12, 4), PaddedRows(Normal(1.0), 10), param_generator(0, "w"))
    assert torch.equal(padded[:10], unpadded) and not padded[10:].any()
    xavier = init_full((12, 4), PaddedRows(XavierUniform(), 10), param_generator(0, "w"))
    assert torch.equal(xavier[:10], init_full((10, 4), XavierUniform(), param_generator(0, "w")))


def _check_full_weights_and_meta(tp: int) -> None:
    """Rule 2 across layouts, metadata after to_empty, and init_parameters by full names."""
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    dev = rank_device()
    model = nn.ModuleDict(
        {
            "fc1": ColumnParallelLinear(16, 32, tp_group=g, seed=1, name="fc1", device=dev),
            "fc2": RowParallelLinear(32, 16, tp_group=g, seed=1, name="fc2", device=dev),
            "embed": VocabParallelEmbedding(10, 16, tp_group=g, seed=1, name="embed", device=dev),
        }
    )
    expected = {
        "fc1.weight": init_full((32, 16), Normal(0.02), param_generator(1, "fc1.weight")),
        "fc2.weight": init_full((16, 32), Normal(0.02), param_generator(1, "fc2.weight")),
        "embed.weight": init_full((10, 16), Normal(0.02), param_generator(1, "embed.weight")),
    }
    padded = padded_vocab_size(10, tp)

    def check(m: nn.Module) -> None:
        for name, param in m.named_parameters():
            spec = shard_spec(param)
            assert spec is not None, name
            full = gather_full(param, spec, g).cpu()
            if name in expected:
                want = expected[name]
                if name == "embed.weight":
                    want = torch.cat([want, torch.zeros(padded - 10, 16)])
                assert torch.equal(full, want), name
            else:
                assert not full.any(), name  # biases start at zero

    check(model)
    # build on the meta device, materialise, initialise by full parameter names
    meta = nn.ModuleDict(
        {
            "fc1": ColumnParallelLinear(16, 32, tp_group=g, device="meta"),
            "fc2": RowParallelLinear(32, 16, tp_group=g, device="meta"),
            "embed": VocabParallelEmbedding(10, 16, tp_group=g, device="meta"),
        }
    )
    meta.to_empty(device=dev)
    assert sorted(init_parameters(meta, seed=1)) == sorted(n for n, _ in meta.named_parameters())
    check(meta)
    # parameters made elsewhere can be marked replicated: rank 0 counts them
    norm = nn.LayerNorm(16)
    spec = mark_replicated(norm.weight, g)
    assert spec.dim is None and spec.duplicate == (dist.get_rank(g) != 0)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_full_weights_do_not_depend_on_tp(dist_pool: DistPool, tp: int) -> None:
    dist_pool.run(_check_full_weights_and_meta, tp, args=(tp,))


def _default_generator_weights(tp: int) -> list[float]:
    """Without a seed the full weight comes from the default generator, alike on all ranks."""
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    layer = ColumnParallelLinear(8, 12, tp_group=g, bias=False, device=rank_device())
    spec = shard_spec(layer.weight)
    assert spec is not None
    full: list[float] = gather_full(layer.weight, spec, g).flatten().tolist()
    return full


def test_unseeded_layers_are_tp_independent_too(dist_pool: DistPool) -> None:
    one = dist_pool.run(_default_generator_weights, 1, args=(1,), seed=9)[0]
    assert dist_pool.run(_default_generator_weights, 2, args=(2,), seed=9) == [one, one]
    assert dist_pool.run(_default_generator_weights, 4, args=(4,), seed=9)[3] == one


def test_shard_tensor_rejects_a_full_tensor_of_another_shape() -> None:
    from mega_tp_layers import ShardSpec, shard_tensor

    spec = ShardSpec(
        dim=0, num_shards=2, shard_rank=0, group="tp", full_shape=(8, 4), duplicate=False
    )
    assert shard_tensor(torch.ones(7, 4), spec).shape == (4, 4)  # shorter: padded (vocabulary)
    for bad in (torch.ones(10, 4), torch.ones(8, 5)):
        with pytest.raises(ValueError, match=r"but the shard spec describes \(8, 4\)"):
            shard_tensor(bad, spec)
