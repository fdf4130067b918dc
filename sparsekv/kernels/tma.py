"""Tensor Memory Accelerator (TMA) helpers shared by the attention kernels: whether a call's tensors can move
through host-side TMA descriptors (triton.tools.tensor_descriptor.TensorDescriptor, Triton >= 3.3), which describe
q/k/v/o as [S, heads * D] views."""

from __future__ import annotations

import torch

from ._dispatch import INTERPRET

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - old or absent triton
    TensorDescriptor = None

__all__ = ["TensorDescriptor", "tma_device_ok", "tma_view_ok", "use_tma"]


def tma_view_ok(t: torch.Tensor) -> bool:
    """Whether [S, heads, D] tensor t can be read as a TMA [S, heads * D] view: heads and D contiguous, 16-byte
    aligned base and row stride."""
    es = t.element_size()
    return (t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])
            and t.data_ptr() % 16 == 0 and (t.stride(0) * es) % 16 == 0 and (t.shape[2] * es) % 16 == 0)


def tma_device_ok(device: torch.device) -> bool:
    """Whether kernels on ``device`` can take host-side TMA descriptors: triton.tools.tensor_descriptor and sm_90+
    (or the interpreter)."""
    return TensorDescriptor is not None and (
        INTERPRET or (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9))


def use_tma(q, k, v, o) -> bool:
    """Whether the dense kernels can move q/k/v/o through TMA descriptors: :func:`tma_device_ok` and
    TMA-compatible layouts."""
    return tma_device_ok(q.device) and o.dtype == q.dtype and all(tma_view_ok(t) for t in (q, k, v, o))
