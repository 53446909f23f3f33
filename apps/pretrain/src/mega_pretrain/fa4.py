"""FlashAttention-4 behind torch's SDPA (``train.attention_kernel fa4``).

The ``flash-attn-4`` package (CuTe DSL kernels for sm90 and sm100, forward and backward)
registers with torch's dispatcher through ``torch.nn.attention.activate_flash_attention_impl
("FA4")``: afterwards SDPA's FlashAttention backend, eager and compiled, runs its kernels,
so the models keep calling ``F.scaled_dot_product_attention``. The activation is
process-wide and lasts for the process. Where it cannot run, :func:`activate_fa4` says why in
one sentence at start-up instead of failing inside the first forward.

Not yet run on a GPU (2026-12-07): its wheels are larger than one device call can carry
(``bench/NOTES.md``, nineteenth session, gives the two-call route).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

__all__ = ["FA4_MODULE", "activate_fa4", "fa4_unavailable"]

#: The module torch's FA4 glue imports (it must expose ``_flash_attn_fwd`` / ``_flash_attn_bwd``).
FA4_MODULE = "flash_attn.cute.interface"

#: Compute-capability majors FlashAttention-4 has kernels for: Hopper and Blackwell.
_MAJORS = (9, 10)


def _torch_entry() -> Callable[[str], None] | None:
    """torch's activation function, where this torch has one."""
    import torch.nn.attention as attention

    entry: Callable[[str], None] | None = getattr(attention, "activate_flash_attention_impl", None)
    return entry


def _torch_impls() -> list[str] | None:
    """The flash attention implementations this torch registers, where it can list them."""
    import torch.nn.attention as attention

    lister = getattr(attention, "list_flash_attention_impls", None)
    return None if lister is None else [str(name) for name in lister()]


def _module_problem() -> str | None:
    """Why :data:`FA4_MODULE` cannot be found, or None where it can (finding it imports its
    parent packages, whose own imports may fail)."""
    try:
        spec = importlib.util.find_spec(FA4_MODULE)
    except ModuleNotFoundError:  # no flash_attn package at all
        spec = None
    except ImportError as err:
        return f"{FA4_MODULE} cannot be imported ({err})"
    return None if spec is not None else f"the flash-attn-4 package ({FA4_MODULE}) is not installed"


def fa4_unavailable(device: torch.device) -> str | None:
    """Why FlashAttention-4 cannot run on ``device``, or None where it can."""
    if device.type != "cuda":
        return f"it needs a CUDA GPU, not {device.type}"
    if _torch_entry() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.activate_flash_attention_impl"
    impls = _torch_impls()
    if impls is not None and "FA4" not in impls:
        return (
            f"torch {torch.__version__} registers no FA4 flash attention implementation "
            f"(it has {', '.join(impls) or 'none'})"
        )
    problem = _module_problem()
    if problem is not None:
        return problem
    major, minor = torch.cuda.get_device_capability(device)
    if major not in _MAJORS:
        return (
            f"this GPU has compute capability {major}.{minor}, and FlashAttention-4 has kernels "
            "for 9.x (Hopper) and 10.x (Blackwell) only"
        )
    return None


def activate_fa4(device: torch.device) -> None:
    """Route SDPA's FlashAttention backend to FlashAttention-4, or raise ``ValueError``."""
    reason = fa4_unavailable(device)
    if reason is None:
        entry = _torch_entry()
        assert entry is not None  # checked above
        try:
            entry("FA4")  # torch imports FA4_MODULE and registers its kernels here
            return
        except Exception as err:  # one sentence at start-up, not a traceback
            first = next(iter(str(err).splitlines()), "")  # its first line only
            reason = f"torch's activation failed ({type(err).__name__}: {first})"
    raise ValueError(
        f"train.attention_kernel fa4 cannot run here: {reason}; install flash-attn-4 on a "
        "Hopper or Blackwell GPU with a torch that has it, or pick another kernel (auto)"
    )
