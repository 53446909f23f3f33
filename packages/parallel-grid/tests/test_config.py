"""ParallelConfig and RankLayout reject bad input with one sentence naming the numbers."""

from __future__ import annotations

import pytest

from mega_parallel_grid import ParallelConfig, RankLayout


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, r"tp \(0\) must be a positive integer"),
        ({"pp": -2}, r"pp \(-2\) must be a positive integer"),
        ({"cp": 0}, r"cp \(0\) must be a positive integer"),
        ({"ep": 0}, r"ep \(0\) must be a positive integer"),
        ({"etp": 0}, r"etp \(0\) must be a positive integer, or None"),
        ({"vpp": 0, "pp": 2}, r"vpp \(0\) must be a positive integer"),
        ({"vpp": 2}, r"vpp \(2\) needs pipeline parallelism, but pp is 1"),
        ({"order": "tp-xx-dp-pp"}, r"unknown dimension 'xx'"),
        ({"order": "tp-dp-tp-pp"}, r"repeats tp"),
        ({"tp": 2, "order": "dp-pp"}, r"leaves out tp, whose size is 2"),
    ],
)
def test_bad_config_raises_one_sentence(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        ParallelConfig(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("world", "kwargs", "message"),
    [
        (6, {"tp": 4}, r"world size \(6\) is not divisible by tp\*cp\*pp \(4\*1\*1 = 4\)"),
        (8, {"tp": 2, "cp": 2, "pp": 4}, r"world size \(8\) is not divisible by tp\*cp\*pp"),
        (12, {"tp": 2, "ep": 4}, r"ep\*etp \(4\*2 = 8\) does not divide tp\*cp\*dp \(12"),
        (
            8,
            {"tp": 2, "pp": 2, "ep": 8, "etp": 1},
            r"ep\*etp \(8\*1 = 8\) does not divide tp\*cp\*dp \(4 ranks",
        ),
        (0, {}, r"world_size \(0\) must be a positive integer"),
        (4, {"order": "tp-pp"}, r"leaves out dp, but 4 ranks give dp = 4"),
        (
            8,
            {"tp": 2, "pp": 2, "ep": 2, "etp": 2, "order": "tp-cp-ep-pp-dp"},
            r"with pp \(2\) not last .* puts pipeline stages on other ranks",
        ),
    ],
)
def test_bad_world_raises_one_sentence(world: int, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        RankLayout(world, ParallelConfig(**kwargs))  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_bad_dimension_names_in_groups() -> None:
    layout = RankLayout(8, ParallelConfig(tp=2, ep=2))
    with pytest.raises(ValueError, match=r"unknown dimension 'xp'"):
        layout.groups("tp-xp")
    with pytest.raises(ValueError, match=r"names a dimension twice"):
        layout.groups("tp-tp")
    with pytest.raises(ValueError, match=r"mixes dense \(tp\) and expert \(ep\)"):
        layout.groups("tp-ep")
    with pytest.raises(ValueError, match=r"rank \(8\) is outside the world of 8 ranks"):
        layout.coords(8)


def test_config_derived_values() -> None:
    config = ParallelConfig(tp=4, pp=2, cp=2)
    assert config.expert_tp == 4
    assert ParallelConfig(tp=4, etp=1).expert_tp == 1
    assert config.model_parallel_size == 16
    assert ParallelConfig(order="tp-dp-pp").ordered_names == ("tp", "dp", "pp", "cp", "ep")
    layout = RankLayout(64, config)
    assert layout.dp == 4 and layout.edp == 8
    with pytest.raises(AttributeError):
        config.tp = 2  # type: ignore[misc]
