"""``run.wandb``: the W&B sink, with a fake ``wandb`` module in ``sys.modules`` (no network).

Only rank 0 logs; it logs the scalars the JSONL file gets, and the resolved config once; a
resumed run continues the same W&B run; a missing package is one sentence naming the extra.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from mega_parallel_grid.testing import DistPool
from mega_pretrain.cli import main
from mega_pretrain.config import load_config
from mega_pretrain.metrics import MetricsLogger
from mega_pretrain.train import train
from mega_pretrain.wandb_sink import WANDB_ID_FILE, check_wandb


class _FakeConfig(dict[str, Any]):
    def update(self, values: Any = (), /, **kwargs: Any) -> None:
        self.setdefault("_updates", []).append(kwargs)
        super().update(values)


class _FakeRun:
    def __init__(self, calls: list[Any], kwargs: dict[str, Any]) -> None:
        self.calls, self.id = calls, kwargs["id"]
        self.config = _FakeConfig(kwargs.get("config", {}))

    def log(self, values: dict[str, float], step: int) -> None:
        self.calls.append(("log", step, values))

    def finish(self) -> None:
        self.calls.append(("finish",))


def _fake_wandb() -> types.ModuleType:
    module = types.ModuleType("wandb")
    calls: list[Any] = []
    runs: list[_FakeRun] = []

    def init(**kwargs: Any) -> _FakeRun:
        calls.append(("init", kwargs))
        runs.append(_FakeRun(calls, kwargs))
        return runs[-1]

    module.init = init  # type: ignore[attr-defined]
    module.calls = calls  # type: ignore[attr-defined]
    module.runs = runs  # type: ignore[attr-defined]
    return module


def _config(*pairs: tuple[str, str]) -> Any:
    return load_config(None, [("run.wandb", "true"), *pairs])


def test_rank_0_logs_the_same_scalars_and_the_config_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = _config(("run.wandb_project", "p"), ("run.wandb_entity", "team"),
                     ("run.wandb_mode", "offline"), ("run.name", "r"))  # fmt: skip
    quiet = MetricsLogger(tmp_path, enabled=False, tensorboard=False, config=config)
    quiet.log(1, {"loss": 1.0})
    quiet.close()
    assert fake.calls == []  # another rank: nothing
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, config=config,
                           layout={"world_size": 2, "dp": 2})  # fmt: skip
    logger.log(1, {"loss": 2.5, "lr": 0.1})
    logger.log(1, {"loss": 2.0}, kind="valid")
    logger.close()
    (kind, kwargs), *rest = fake.calls
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert kind == "init" and kwargs.pop("config")["layout"] == {"world_size": 2, "dp": 2}
    assert kwargs == {"project": "p", "entity": "team", "name": "r", "dir": str(tmp_path),
                      "id": run_id, "resume": "allow", "mode": "offline"}  # fmt: skip
    assert rest == [("log", 1, {"train/loss": 2.5, "train/lr": 0.1}),
                    ("log", 1, {"valid/loss": 2.0}), ("finish",)]  # fmt: skip
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k not in ("step", "kind", "time")} for r in jsonl] == [
        {"loss": 2.5, "lr": 0.1},
        {"loss": 2.0},
    ]
    # resumed: the same W&B run, the config updated (not logged again), mode auto left to W&B
    again = MetricsLogger(
        tmp_path, enabled=True, tensorboard=False, config=_config(("run.name", "r"))
    )
    again.close()
    kwargs = fake.calls[-2][1]
    assert kwargs["id"] == run_id and "config" not in kwargs and "mode" not in kwargs
    assert fake.runs[-1].config["_updates"] == [{"allow_val_change": True}]
    assert fake.runs[-1].config["train"]["steps"] == 300


def test_a_missing_wandb_is_one_sentence_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    check_wandb(load_config(None, []))  # off: never looked for
    sentence = (
        "run.wandb is true but the wandb package is not installed; install the extra with "
        "pip install 'mega-pretrain[wandb]', or set run.wandb false"
    )
    with pytest.raises(ValueError) as info:
        MetricsLogger(tmp_path, enabled=True, tensorboard=False, config=_config())
    assert str(info.value) == sentence
    assert main(["--dry-run", "--run.wandb", "true", "--run.device", "cpu"]) == 2
    assert sentence in capsys.readouterr().err


def _train_with_fake(out_dir: str, extra: list[tuple[str, str]]) -> list[Any]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    fake = _fake_wandb()
    sys.modules["wandb"] = fake
    try:
        config = load_config(None, [
            ("train.steps", "4"), ("train.log_interval", "1"), ("train.seq_len", "32"),
            ("train.micro_batch_size", "2"), ("train.global_batch_size", "4"),
            ("train.eval_interval", "0"), ("run.tensorboard", "false"), ("model.num_layers", "2"),
            ("run.out_dir", out_dir), ("run.name", "w"), ("run.wandb", "true"), *extra,
        ])  # fmt: skip
        train(config)
    finally:
        del sys.modules["wandb"]
    return list(fake.calls)


def test_a_run_and_its_resume_log_into_one_wandb_run(dist_pool: DistPool, tmp_path: Path) -> None:
    first = dist_pool.run(_train_with_fake, 2, args=(str(tmp_path), [("train.exit_interval", "2")]))
    assert first[1] == []  # rank 1 logs nothing
    second = dist_pool.run(_train_with_fake, 2, args=(str(tmp_path), []))
    assert second[1] == []
    (_, init1), (_, init2) = first[0][0], second[0][0]
    assert init1["id"] == init2["id"] == (tmp_path / "w" / WANDB_ID_FILE).read_text().strip()
    assert init1["config"]["layout"] == {"world_size": 2, "dp": 2}
    logged = [c for c in first[0] + second[0] if c[0] == "log"]
    lines = (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(step, values) for _, step, values in logged] == [
        (
            r["step"],
            {f"{r['kind']}/{k}": v for k, v in r.items() if k not in ("step", "kind", "time")},
        )
        for r in records
    ]
    assert [step for _, step, _ in logged] == [1, 2, 3, 4]
