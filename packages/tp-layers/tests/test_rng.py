"""The tracked RNG: per-tp-rank streams inside a fork, the shared stream untouched outside."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_tp_layers import RNGStatesTracker, tp_rng_tracker
from mega_tp_layers.rng import TP_SEED_OFFSET

SEED = 42


def _get_state(dev: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state()


def _set_state(dev: torch.device, state: torch.Tensor) -> None:
    if dev.type == "cuda":
        torch.cuda.set_rng_state(state, dev)
    else:
        torch.set_rng_state(state)


def _draws(tp: int) -> dict[str, list[float]]:
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank, dev = dist.get_rank(g), rank_device()
    tracker = tp_rng_tracker(SEED, g, device=dev)
    start = _get_state(dev)
    outside_1 = torch.rand(4, device=dev)
    with tracker.fork():
        forked_1 = torch.rand(4, device=dev)
        mask = F.dropout(torch.ones(64, device=dev), p=0.5)  # e.g. dropout on a head slice
    outside_2 = torch.rand(4, device=dev)
    with tracker.fork("tp"):
        forked_2 = torch.rand(4, device=dev)

    # the shared stream went on as if no fork had happened (draw by draw: on CUDA each
    # launch advances the Philox offset, so two draws of 4 are not one draw of 8)
    _set_state(dev, start)
    assert torch.equal(outside_1, torch.rand(4, device=dev))
    assert torch.equal(outside_2, torch.rand(4, device=dev))
    # the forked stream is this rank's own, and continues from one fork to the next
    own = torch.Generator(device=dev)
    own.manual_seed(SEED + TP_SEED_OFFSET + rank)
    _set_state(dev, own.get_state())
    assert torch.equal(forked_1, torch.rand(4, device=dev))
    assert torch.equal(mask, F.dropout(torch.ones(64, device=dev), p=0.5))
    assert torch.equal(forked_2, torch.rand(4, device=dev))

    # saved states replay a fork exactly (activation recompute, checkpoint resume)
    saved = tracker.state_dict()
    with tracker.fork():
        first = torch.rand(4, device=dev)
    tracker.load_state_dict(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(4, device=dev), first)
    return {
        "outside": outside_1.cpu().tolist(),
        "forked": forked_1.cpu().tolist(),
        "mask": mask.cpu().tolist(),
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_forked_streams_differ_per_rank_shared_stream_agrees(dist_pool: DistPool, tp: int) -> None:
    results = dist_pool.run(_draws, tp, args=(tp,))
    assert all(r["outside"] == results[0]["outside"] for r in results)
    assert len({tuple(r["forked"]) for r in results}) == tp
    assert len({tuple(r["mask"]) for r in results}) == tp


def test_tracker_rejects_bad_names_and_seeds() -> None:
    tracker = RNGStatesTracker("cpu")
    tracker.add("tp", 1)
    with pytest.raises(ValueError, match=r"RNG state 'tp' is already tracked"):
        tracker.add("tp", 2)
    with pytest.raises(ValueError, match=r"seed 1 already seeds another tracked RNG state"):
        tracker.add("expert", 1)
    with pytest.raises(ValueError, match=r"RNG state 'expert' is not tracked \(tracked: tp\)"):
        with tracker.fork("expert"):
            pass
    with pytest.raises(ValueError, match=r"RNG states \['x'\] are not tracked"):
        tracker.load_state_dict({"x": torch.zeros(1)})
    assert tracker.names == ("tp",)


def test_fork_restores_the_state_after_an_exception() -> None:
    tracker = RNGStatesTracker()
    tracker.add("tp", 7)
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="boom"):
        with tracker.fork():
            torch.rand(3)
            raise RuntimeError("boom")
    assert torch.equal(torch.get_rng_state(), before)


def test_a_nested_fork_of_the_same_state_is_one_sentence() -> None:
    tracker = RNGStatesTracker()
    tracker.add("a", 11)
    tracker.add("b", 12)
    with tracker.fork("a"):
        first = torch.rand(3)
        with tracker.fork("b"):  # another state nests fine
            torch.rand(1)
        with pytest.raises(ValueError, match=r"RNG state 'a' is already forked"):
            with tracker.fork("a"):
                pass
        second = torch.rand(3)
    assert not torch.equal(first, second)
    with tracker.fork("a"):  # usable again after the failed nesting
        torch.rand(1)
