"""``train.attention_kernel fa4``: FlashAttention-4 activated behind SDPA's flash backend
where it can run, one sentence naming the reason where it cannot (checked on CPU with the
GPU's answers stood in; the kernels themselves need a Hopper or Blackwell GPU)."""

from __future__ import annotations

import pytest
import torch

import mega_pretrain.fa4 as fa4
from mega_pretrain.runtime import configure_attention_kernel

CUDA = torch.device("cuda")
_REAL_MODULE_PROBLEM = fa4._module_problem


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A Hopper GPU with flash-attn-4 installed, as far as the checks can see; returns the
    implementations torch was asked to activate."""
    activated: list[str] = []
    monkeypatch.setattr(fa4, "_torch_entry", lambda: activated.append)
    monkeypatch.setattr(fa4, "_torch_impls", lambda: ["FA3", "FA4"])
    monkeypatch.setattr(fa4, "_module_problem", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return activated


def test_fa4_goes_first_behind_the_flash_backend(gpu: list[str]) -> None:
    from torch.nn.attention import SDPBackend

    default = torch._C._get_sdp_priority_order()
    try:
        assert configure_attention_kernel(CUDA, "fa4") == "fa4"
        assert gpu == ["FA4"]
        assert torch._C._get_sdp_priority_order()[0] == int(SDPBackend.FLASH_ATTENTION)
    finally:
        torch._C._set_sdp_priority_order(default)


def test_on_cpu_fa4_is_auto_and_activates_nothing(gpu: list[str]) -> None:
    assert configure_attention_kernel(torch.device("cpu"), "fa4") == "auto"
    assert gpu == []


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("no package", r"the flash-attn-4 package \(flash_attn.cute.interface\) is not installed"),
        ("broken package", r"flash_attn.cute.interface cannot be imported \(libcuda.so.1: cannot "
                           r"open shared object file\)"),
        ("activation fails", r"torch's activation failed \(RuntimeError: Module "
                             r"'flash_attn.cute.interface' does not expose FA4 kernels\)"),
        ("old torch", r"torch \S+ has no torch.nn.attention.activate_flash_attention_impl"),
        ("fa3 only", r"torch \S+ registers no FA4 flash attention implementation \(it has FA3\)"),
        ("ampere", r"this GPU has compute capability 8.0, and FlashAttention-4 has kernels for "
                   r"9.x \(Hopper\) and 10.x \(Blackwell\) only"),
    ],
)  # fmt: skip
def test_where_fa4_cannot_run_is_one_sentence(
    gpu: list[str], monkeypatch: pytest.MonkeyPatch, case: str, reason: str
) -> None:
    if case in ("no package", "broken package"):
        error = (
            ModuleNotFoundError("No module named 'flash_attn'")
            if case == "no package"
            else ImportError("libcuda.so.1: cannot open shared object file")
        )

        def find_spec(name: str) -> None:
            raise error

        monkeypatch.setattr(fa4.importlib.util, "find_spec", find_spec)
        monkeypatch.setattr(fa4, "_module_problem", _REAL_MODULE_PROBLEM)  # the fixture's undone
    elif case == "activation fails":

        def activate(name: str) -> None:
            raise RuntimeError("Module 'flash_attn.cute.interface' does not expose FA4 kernels")

        monkeypatch.setattr(fa4, "_torch_entry", lambda: activate)
    elif case == "old torch":
        monkeypatch.setattr(fa4, "_torch_entry", lambda: None)
    elif case == "fa3 only":
        monkeypatch.setattr(fa4, "_torch_impls", lambda: ["FA3"])
    else:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    default = torch._C._get_sdp_priority_order()
    with pytest.raises(ValueError, match=rf"^train.attention_kernel fa4 cannot run here: {reason}; "
                                         r"install flash-attn-4 .* pick another kernel \(auto\)$"):  # fmt: skip
        configure_attention_kernel(CUDA, "fa4")
    assert gpu == []
    assert torch._C._get_sdp_priority_order() == default  # refused before anything changed


def test_the_real_checks_on_this_machine() -> None:
    """Unpatched: the package lookup answers without raising, and a CPU device is refused."""
    problem = fa4._module_problem()
    assert problem is None or "flash_attn.cute.interface" in problem
    impls = fa4._torch_impls()
    assert impls is None or all(isinstance(name, str) for name in impls)
    assert fa4.fa4_unavailable(torch.device("cpu")) == "it needs a CUDA GPU, not cpu"
