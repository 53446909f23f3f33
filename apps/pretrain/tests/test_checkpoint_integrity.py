"""Checkpoint files are never run and never trusted blindly.

A planted ``.metadata`` pickle runs nothing (load, inspect); flipped bits and truncated
shards are named with the way out; a full disk is named with free and needed MiB; a
``latest`` naming a vanished folder names the newest complete checkpoint; ``inspect``
takes a run folder and prints a summary.
"""

from __future__ import annotations

import errno
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_pretrain.build import Built, build, gpt_config, parallel_config
from mega_pretrain.checkpoint import (
    CheckpointError,
    inspect_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from mega_pretrain.ckpt.meta import dcp_failure
from mega_pretrain.ckpt.reader import SafeReader, read_dcp_metadata
from mega_pretrain.cli import main
from mega_pretrain.config import load_config
from mega_pretrain.step import StepRunner


def _trained(steps: int, tp: int = 1) -> tuple[Built, Any, StepRunner]:
    config = load_config(None, [("model.num_layers", "2"), ("train.seq_len", "16"),
                                ("train.micro_batch_size", "2"), ("train.global_batch_size", "2"),
                                ("parallel.tp", str(tp))])  # fmt: skip
    groups = init_process_groups(parallel_config(config))
    built = build(config, groups, rank_device())
    model = gpt_config(config)
    runner = StepRunner(built, groups, seq_len=16, micro_batch_size=2, hidden_size=model.hidden_size,
                        dtype=torch.float32, device=rank_device(), sequence_parallel=False)  # fmt: skip
    tokens = torch.randint(0, model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        runner.train_step([(tokens[:, :-1], tokens[:, 1:])], 1e-3)
    return built, groups, runner


def _save_two(run_dir: str) -> list[str]:
    """Checkpoints at steps 1 and 2 of a tiny 2-layer GPT."""
    built, groups, runner = _trained(1)
    first = save_checkpoint(Path(run_dir), 1, built, groups, {"consumed_samples": 2})
    tokens = torch.zeros(2, 17, dtype=torch.long)
    runner.train_step([(tokens[:, :-1], tokens[:, 1:])], 1e-3)
    second = save_checkpoint(Path(run_dir), 2, built, groups, {"consumed_samples": 4})
    return [str(first), str(second)]


def _load(path: str) -> str | None:
    """Load ``path`` into a fresh model: None, or the CheckpointError's sentence."""
    built, groups, _ = _trained(0)
    try:
        load_checkpoint(Path(path), built, groups)
    except CheckpointError as exc:
        return str(exc)
    return None


@pytest.fixture
def saved(dist_pool: DistPool, tmp_path: Path) -> list[Path]:
    return [Path(p) for p in dist_pool.run(_save_two, 1, args=(str(tmp_path),))[0]]


def _drop_checksums(path: Path) -> None:
    """Make ``path`` look like a checkpoint saved before checksums."""
    meta = json.loads((path / "meta.json").read_text())
    del meta["files"]
    (path / "meta.json").write_text(json.dumps(meta))


# 0. a planted pickle runs nothing -------------------------------------------------------


class _Payload:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("checksums", [True, False])
def test_planted_metadata_pickle_runs_nothing(
    dist_pool: DistPool, saved: list[Path], tmp_path: Path, checksums: bool
) -> None:
    path = saved[1]
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    if not checksums:  # an old checkpoint, or one whose meta.json was rewritten too
        _drop_checksums(path)
    error = dist_pool.run(_load, 1, args=(str(path),))[0]
    report = inspect_checkpoint(path, tensors=True)
    assert main(["inspect", str(path), "--tensors"]) == 1
    with pytest.raises(CheckpointError, match=r"names (io|builtins)\.open, .* tampered with"):
        read_dcp_metadata(path)
    assert not marker.exists()
    assert error is not None and report.damage is not None
    if checksums:
        want = f"checkpoint file {path}/.metadata is (damaged|\\d+ bytes)"
    else:
        want = f"{path}/.metadata names (io|builtins).open, which no mega/DCP checkpoint metadata"
    for text in (error, report.damage):
        assert __import__("re").match(want, text), text
        assert "\n" not in text


def test_reader_refuses_bytes_items(tmp_path: Path) -> None:
    """torch would read a non-tensor item with torch.load(weights_only=False)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    marker = tmp_path / "pwned"
    with pytest.warns(UserWarning):
        save({"x": _Payload(marker)}, storage_writer=FileSystemWriter(tmp_path / "c"), no_dist=True)
    with pytest.raises(CheckpointException) as info, pytest.warns(UserWarning):
        load({"x": None}, storage_reader=SafeReader(tmp_path / "c"), no_dist=True)
    assert "lists 'x' as bytes" in dcp_failure(info.value)
    assert not marker.exists()


# 6. integrity ----------------------------------------------------------------------------


def _flip_mantissas(path: Path, count: int = 1024) -> Path:
    """Flip the lowest mantissa bit of ``count`` float32 values of one saved tensor."""
    index = read_dcp_metadata(path)
    key = next(
        k
        for k, v in index.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and v.size.numel() >= count and "model/" in k
    )
    info = next(v for k, v in index.storage_data.items() if k.fqn == key)
    file = path / info.relative_path
    blob = bytearray(file.read_bytes())
    tensor = torch.load(
        __import__("io").BytesIO(bytes(blob[info.offset : info.offset + info.length])),
        weights_only=True,
    )
    start = blob.find(tensor.numpy().tobytes(), info.offset)
    assert start >= 0
    for i in range(count):
        blob[start + 4 * i] ^= 1
    file.write_bytes(bytes(blob))
    return file


def test_flipped_bits_are_named_with_the_earlier_checkpoint(
    dist_pool: DistPool, saved: list[Path]
) -> None:
    file = _flip_mantissas(saved[1])
    error = dist_pool.run(_load, 1, args=(str(saved[1]),))[0]
    report = inspect_checkpoint(saved[1].parent.parent)  # the run folder: its latest
    assert main(["inspect", str(saved[1])]) == 1
    for text in (error, report.damage):
        assert text == (
            f"checkpoint file {file} is damaged (CRC-32 {text.split('CRC-32 ')[1][:8]}, saved "
            f"{json.loads((saved[1] / 'meta.json').read_text())['files'][file.name]['crc32']}); "
            f"load the earlier checkpoint with --checkpoint.load {saved[0]}"
        )
    assert f"integrity: DAMAGED: checkpoint file {file} is damaged" in report.text
    assert dist_pool.run(_load, 1, args=(str(saved[0]),))[0] is None


def test_truncated_shard_is_named_with_or_without_checksums(
    dist_pool: DistPool, saved: list[Path]
) -> None:
    old = saved[0]
    _drop_checksums(old)
    assert dist_pool.run(_load, 1, args=(str(old),))[0] is None  # old checkpoints still load
    assert "shard sizes match the index" in inspect_checkpoint(old).text
    for path in saved:
        shard = next(path.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:-100])
    new_error = dist_pool.run(_load, 1, args=(str(saved[1]),))[0]
    old_error = dist_pool.run(_load, 1, args=(str(old),))[0]
    assert new_error is not None and f"{saved[1]}/__0_0.distcp is " in new_error
    assert "bytes but was saved with" in new_error
    assert old_error is not None and f"{old}/__0_0.distcp is " in old_error
    assert "bytes but its index needs" in old_error and "start fresh" in old_error
    assert inspect_checkpoint(old).damage == old_error


def _disk_full(run_dir: str) -> tuple[list[str], str]:
    """Save step 1, then step 2 on a 'full disk' (a failing shard write; 64 KiB free)."""
    import torch.distributed.checkpoint.filesystem as fs

    built, groups, _ = _trained(1, tp=2)
    save_checkpoint(Path(run_dir), 1, built, groups, {})
    write, usage = fs._write_item, shutil.disk_usage

    def full_write(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "[enforce fail at inline_container.cc:783] . unexpected pos 4288 vs 4196"
        )

    def full_usage(path: Any) -> Any:
        return usage(path)._replace(free=2**16)

    fs._write_item, shutil.disk_usage = full_write, full_usage  # type: ignore[assignment]
    errors = []
    try:
        with pytest.raises(CheckpointError) as info:
            save_checkpoint(Path(run_dir), 2, built, groups, {})
        errors.append(str(info.value))
    finally:
        fs._write_item, shutil.disk_usage = write, usage  # type: ignore[assignment]
    save, rank = torch.save, torch.distributed.get_rank()

    def rng_fails(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    torch.save = rng_fails if rank == 1 else save  # type: ignore[assignment]
    try:  # one rank's RNG file fails: every rank says so (none waits at the commit)
        with pytest.raises(CheckpointError) as info:
            save_checkpoint(Path(run_dir), 3, built, groups, {})
        errors.append(str(info.value))
    finally:
        torch.save = save
    latest = latest_checkpoint(Path(run_dir))
    return errors, str(latest)


def test_disk_full_is_named_and_latest_kept(dist_pool: DistPool, tmp_path: Path) -> None:
    results = dist_pool.run(_disk_full, 2, args=(str(tmp_path),))
    ckpts = tmp_path / "checkpoints"
    for errors, latest in results:
        assert latest == str(ckpts / "step_00000001")
        dcp, rng = errors
        assert dcp.startswith(
            f"writing checkpoint {ckpts}/step_00000002.tmp failed: the disk holding {ckpts} is "
            "full (0.1 MiB free, this rank writes up to "
        ), dcp
        assert "RuntimeError: [enforce fail" in dcp
        assert f"{ckpts}/latest still names step_00000001, so free space" in dcp
        assert rng.startswith(f"writing checkpoint {ckpts}/step_00000003.tmp failed: ")
        assert "OSError: [Errno 28] No space left on device" in rng
    assert dist_pool.run(_load_tp2, 2, args=(str(ckpts / "step_00000001"),)) == [None, None]


def _load_tp2(path: str) -> str | None:
    built, groups, _ = _trained(0, tp=2)
    load_checkpoint(Path(path), built, groups)
    return None


def test_dcp_failure_names_the_cause() -> None:
    """With this torch, CheckpointException.failures maps ranks to (exception, traceback)."""
    exc = CheckpointException("write", {1: (OSError(errno.ENOSPC, "No space left on device"), [])})
    assert dcp_failure(exc) == "OSError: [Errno 28] No space left on device"


# latest and inspect ----------------------------------------------------------------------


def test_latest_naming_a_vanished_folder_names_the_previous_one(tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    (ckpts / "step_00000001").mkdir(parents=True)
    (ckpts / "step_00000003").mkdir()  # an unfinished save: no meta.json
    (ckpts / "latest").write_text("step_00000004\n")
    with pytest.raises(CheckpointError) as info:
        latest_checkpoint(tmp_path)
    assert str(info.value) == (
        f"{ckpts}/latest names step_00000004, which no longer exists; no complete checkpoint "
        "is left: start fresh with --checkpoint.load none"
    )
    (ckpts / "step_00000001" / "meta.json").write_text("{}")
    with pytest.raises(CheckpointError) as info:
        latest_checkpoint(tmp_path)
    assert str(info.value) == (
        f"{ckpts}/latest names step_00000004, which no longer exists; the newest complete "
        f"checkpoint is {ckpts}/step_00000001: resume from it with --checkpoint.load "
        f"{ckpts}/step_00000001"
    )


def test_inspect_takes_a_run_folder_and_summarises(
    saved: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    run = saved[1].parent.parent
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "kind": "train", "loss": 5.5}\n{"step": 2, "kind": "train", "loss": 5.25}\n'
        '{"step": 2, "kind": "valid", "loss": 9.0}\n{"step": 3, "kind": "train", "loss": 1.0}\n'
    )
    assert main(["inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert main(["inspect", str(run / "checkpoints")]) == 0
    assert capsys.readouterr().out == out
    lines = out.splitlines()
    assert lines[0] == f"checkpoint {saved[1]}"
    assert lines[1] == "step: 2"
    assert __import__("re").fullmatch(r"parameters: [\d,]+ in \d+ tensors", lines[2])
    assert lines[3].startswith("size on disk: ") and lines[3].endswith(" MiB")
    assert lines[4] == f"last loss: 5.2500 (step 2, {run}/metrics.jsonl)"
    assert lines[5].startswith("layout: tp=1 pp=1 cp=1 dp=1 ep=1")
    assert lines[-1] == "integrity: ok, 3 files match their CRC-32"
    assert "model/" not in out
    assert main(["inspect", str(run), "--tensors"]) == 0
    full = capsys.readouterr().out
    assert full.startswith(out) and "model/embedding.word.weight/tp0of1 [" in full
    assert main(["inspect", str(run.parent)]) == 2
    assert "holds no meta.json and no latest file" in capsys.readouterr().err
