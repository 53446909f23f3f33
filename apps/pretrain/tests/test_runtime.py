"""Start-up choices made without a GPU: precision, TF32, intra-op threads, collective timeout."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from mega_pretrain.build import param_dtype
from mega_pretrain.config import load_config
from mega_pretrain.runtime import (
    collective_timeout,
    configure_attention_kernel,
    configure_tf32,
    intra_op_threads,
    precision_phrase,
    resolve_precision,
    sdpa_backend,
    with_precision,
)


@pytest.mark.parametrize(
    ("choice", "device", "bf16", "expected"),
    [
        ("auto", "cuda", True, "bf16"),
        ("auto", "cuda", False, "fp32"),  # a GPU without bf16 (pre-Ampere)
        ("auto", "cpu", True, "fp32"),
        ("fp32", "cuda", True, "fp32"),  # an explicit choice is kept
        ("fp16", "cuda", True, "fp16"),
        ("bf16", "cpu", False, "bf16"),
    ],
)
def test_precision_resolution(choice: str, device: str, bf16: bool, expected: str) -> None:
    assert resolve_precision(choice, device, bf16) == expected


def test_the_default_precision_is_auto_and_resolves_per_device() -> None:
    config = load_config(None, [("model.size", "1b-bench")])  # no config file, as in the issue
    assert config.train.precision == "auto"
    assert with_precision(config, "cuda", True).train.precision == "bf16"
    assert with_precision(config, "cpu").train.precision == "fp32"
    assert param_dtype(config, torch.device("cpu")) == torch.float32


def test_the_precision_phrase_names_tf32() -> None:
    config = load_config(None, [("train.precision", "fp32")])
    assert precision_phrase(config, "cuda") == "fp32 + tf32 matmuls"
    off = load_config(None, [("train.precision", "fp32"), ("train.tf32", "false")])
    assert precision_phrase(off, "cuda") == "fp32 (tf32 off)"
    assert precision_phrase(config, "cpu") == "fp32"
    assert precision_phrase(load_config(None, []), "cuda") in ("bf16", "fp32 + tf32 matmuls")


def test_tf32_is_left_alone_on_cpu() -> None:
    before = torch.get_float32_matmul_precision()
    assert configure_tf32(torch.device("cpu"), True) is False
    assert torch.get_float32_matmul_precision() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 exists on CUDA only")
def test_tf32_is_on_for_fp32_on_cuda() -> None:
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())  # fmt: skip
    try:
        assert configure_tf32(torch.device("cuda"), True) is True
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "high"
        assert configure_tf32(torch.device("cuda"), False) is False
        assert not torch.backends.cuda.matmul.allow_tf32
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


@pytest.mark.parametrize(
    ("env", "cores", "expected"),
    [
        ({"OMP_NUM_THREADS": "3", "LOCAL_WORLD_SIZE": "8"}, 16, (3, "OMP_NUM_THREADS")),
        ({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "16"}, 16, (4, "16 cores / 4 local rank(s)")),
        ({"WORLD_SIZE": "2"}, 16, (8, "16 cores / 2 local rank(s)")),
        ({}, 2, (2, "2 cores / 1 local rank(s)")),
        ({"LOCAL_WORLD_SIZE": "4"}, 2, (1, "2 cores / 4 local rank(s)")),  # at least one
        ({"OMP_NUM_THREADS": ""}, 6, (6, "6 cores / 1 local rank(s)")),
    ],
)
def test_intra_op_threads_share_the_cores(
    env: dict[str, str], cores: int, expected: tuple[int, str]
) -> None:
    assert intra_op_threads(env, cores) == expected


def test_collective_timeout_is_the_setting() -> None:
    config = load_config(None, [("run.timeout_minutes", "2.5")])
    assert collective_timeout(config.run.timeout_minutes) == timedelta(seconds=150)


def test_the_attention_kernel_goes_first_in_torchs_order() -> None:
    from torch.nn.attention import SDPBackend

    default = torch._C._get_sdp_priority_order()
    try:  # the order is a process-wide setting of torch's, there on CPU builds too
        assert configure_attention_kernel(torch.device("cpu"), "cudnn") == "auto"
        assert torch._C._get_sdp_priority_order() == default  # CPU: left alone
        assert configure_attention_kernel(torch.device("cuda"), "auto") == "auto"
        assert torch._C._get_sdp_priority_order() == default
        assert configure_attention_kernel(torch.device("cuda"), "cudnn") == "cudnn"
        order = torch._C._get_sdp_priority_order()
        assert order[0] == int(SDPBackend.CUDNN_ATTENTION) == int(sdpa_backend("cudnn"))
        assert sorted(order) == sorted(default)  # the others stay, in torch's order
        assert [b for b in order if b != order[0]] == [b for b in default if b != order[0]]
    finally:
        torch._C._set_sdp_priority_order(default)


def test_a_bad_attention_kernel_is_one_sentence() -> None:
    with pytest.raises(ValueError, match=r"train.attention_kernel \('fa3'\) is not one of auto, "
                                         r"flash, cudnn, efficient, fa4; pick one of those$"):  # fmt: skip
        configure_attention_kernel(torch.device("cuda"), "fa3")
    with pytest.raises(ValueError, match=r"\('auto'\) is not one of"):
        sdpa_backend("auto")  # auto names no backend
    with pytest.raises(ValueError, match=r"attention_kernel") as info:
        load_config(None, [("train.attention_kernel", "fa3")])
    assert "\n" not in str(info.value)
