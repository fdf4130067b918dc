"""The kernels a run uses, resolved once when the engine is built.

:func:`resolve_kernels` turns the device (and the one override, ``SPARSEKV_ATTN_BACKEND``) into a frozen
:class:`KernelChoice` that the model and its layers receive at construction; no layer asks again per call.
On CUDA with Triton that is the measured fastest path: the fused elementwise kernels, the decode fusions, the
Triton skinny GEMV for single-row inputs and programmatic dependent launch on Hopper and newer. Without CUDA
(or with ``SPARSEKV_ATTN_BACKEND=torch``) the pure-torch references run. Tests build a KernelChoice themselves
to run the Triton kernels under the CPU interpreter, or the references on CUDA.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from ._dispatch import BACKENDS, ENV_BACKEND, HAS_TRITON, INTERPRET, has_flash_attn, pdl_supported

log = logging.getLogger(__name__)

__all__ = ["KernelChoice", "resolve_kernels"]


@dataclass(frozen=True)
class KernelChoice:
    attention: str  # preferred prefill attention backend: flash_attn, sdpa, cudnn, triton or torch
    triton: bool  # the Triton kernels run: fused RMSNorm / rotary / SiLU, paged decode, merge
    gemv_max_rows: int  # Linear runs the Triton skinny GEMV for inputs of 1..gemv_max_rows rows (0: never)
    decode_fusion: bool  # residual add + norm after the GEMV, silu*up in the down GEMV, KV write in rotary
    pdl: bool  # decode kernels launch with programmatic dependent launch

    def __post_init__(self) -> None:
        if self.attention not in BACKENDS:
            raise ValueError(f"KernelChoice.attention={self.attention!r} is not one of {BACKENDS}")
        if (self.decode_fusion or self.pdl or self.gemv_max_rows) and not self.triton:
            raise ValueError(f"{self}: decode_fusion, pdl and gemv_max_rows need triton=True (they are Triton "
                             "kernels); set them to False / 0 for the torch path")

    @classmethod
    def torch_reference(cls) -> KernelChoice:
        """The pure-torch references everywhere (the CPU path, and the oracle of the kernel tests)."""
        return cls(attention="torch", triton=False, gemv_max_rows=0, decode_fusion=False, pdl=False)


def resolve_kernels(device: torch.device | str, *, backend: str | None = None) -> KernelChoice:
    """The KernelChoice for ``device``. ``backend`` (default: the ``SPARSEKV_ATTN_BACKEND`` environment
    variable, read here) forces the attention backend: torch selects the references for every kernel."""
    device = torch.device(device)
    forced = (os.environ.get(ENV_BACKEND, "") if backend is None else backend).strip().lower()
    if forced and forced not in BACKENDS:
        raise ValueError(f"{ENV_BACKEND}={forced!r} is not one of {BACKENDS} (or unset)")
    if device.type != "cuda":
        # Off-GPU the Triton kernels run only when asked for, under the interpreter (TRITON_INTERPRET=1)
        if forced == "triton" and HAS_TRITON and INTERPRET:
            return KernelChoice(attention="triton", triton=True, gemv_max_rows=0, decode_fusion=True, pdl=False)
        if forced and forced != "torch":
            log.warning(f"{ENV_BACKEND}={forced} on device {device}: runs the torch references there ("
                        + ("Triton runs off-GPU only under TRITON_INTERPRET=1, a slow mode for tests)"
                           if forced == "triton" else f"{forced} needs CUDA)"))
        return KernelChoice.torch_reference()
    if forced == "torch" or not HAS_TRITON:
        return KernelChoice.torch_reference() if forced == "torch" or not has_flash_attn() else KernelChoice(
            attention="flash_attn", triton=False, gemv_max_rows=0, decode_fusion=False, pdl=False)
    attention = forced or ("flash_attn" if has_flash_attn() else "triton")
    # one row: the skinny GEMV beat cuBLAS inside the whole decode step on an H100 at batch 1, not at batch 8
    return KernelChoice(attention=attention, triton=True, gemv_max_rows=1, decode_fusion=True,
                        pdl=pdl_supported(device))
