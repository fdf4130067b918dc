"""What every kernel module shares: the Triton import, launch helpers, and the attention backends.

The run's choice is resolved once (sparsekv.kernels.backend.resolve_kernels); :func:`attention_backend` then
picks, per call, the first of the preferred backend's fallbacks that can serve it. The backends:

* ``'flash_attn'``: the flash-attn package (CUDA, fp16/bf16 only);
* ``'sdpa'``: torch's fused flash kernel via ``aten._scaled_dot_product_flash_attention``;
* ``'cudnn'``: torch's cuDNN attention via ``aten._scaled_dot_product_cudnn_attention`` (same limits as sdpa;
  not yet timed on a GPU, so forced only);
  (CUDA, fp16/bf16, non-causal or Sq == Sk because its causal mask is top-left aligned);
* ``'triton'``: our Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``);
* ``'torch'``: the pure-torch references.

``SPARSEKV_ATTN_BACKEND`` (torch|triton|flash_attn|sdpa|cudnn) forces the preferred one; a backend that
cannot run a given call falls back along flash_attn -> sdpa -> triton -> torch (forced on a CPU device where it
cannot run, resolve_kernels logs a warning and takes the torch references).
Merge and paged-decode kernels only distinguish Triton from torch (KernelChoice.triton).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

try:  # triton is an optional dependency: without it only torch / flash-attn / sdpa run
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

HAS_TRITON = triton is not None


def jit(fn=None, **options):
    """triton.jit (``@jit`` or ``@jit(do_not_specialize=[...])``), or the plain function without Triton. Kernel
    annotations stay strings (``from __future__ import annotations``), which Triton accepts, so kernel definitions
    need no triton at import."""
    if not HAS_TRITON:
        return fn if fn is not None else (lambda function: function)
    return triton.jit(fn, **options) if fn is not None else triton.jit(**options)

BACKENDS = ("torch", "triton", "flash_attn", "sdpa", "cudnn")
ENV_BACKEND = "SPARSEKV_ATTN_BACKEND"

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")

# Tests flip this to True so that every output buffer the launchers allocate starts as NaN:
# any element a kernel forgets to write then fails the comparison with the reference.
POISON_OUTPUTS = False

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def triton_interpret() -> bool:
    """True when Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1, read once at import)."""
    return INTERPRET


@functools.lru_cache(maxsize=None)
def has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def attention_backend(preferred: str, dtype: torch.dtype | None = None, causal: bool = False,
                      seqlen_q: int | None = None, seqlen_k: int | None = None, head_dim: int | None = None) -> str:
    """The backend that runs one attention call, given the run's preferred one (KernelChoice.attention): backends
    that cannot serve the call (fp32 for the flash kernels, bottom-right causal with Sq != Sk for sdpa/cudnn, odd
    head dims) fall back along flash_attn -> sdpa -> triton -> torch."""
    if preferred in ("torch", "triton"):
        return preferred
    half_ok = dtype is None or dtype in _HALF_DTYPES
    dim_ok = head_dim is None or (head_dim % 8 == 0 and head_dim <= 256)
    if preferred == "flash_attn" and has_flash_attn() and half_ok and dim_ok:
        return "flash_attn"
    causal_ok = not causal or seqlen_q is None or seqlen_q == seqlen_k
    if preferred in ("sdpa", "cudnn") and half_ok and dim_ok and causal_ok:
        return preferred
    return "triton" if HAS_TRITON else "torch"


_ACTIVE: dict = {}  # (device type, index) -> the KernelChoice of the engine built last for that device


def activate_kernels(device: torch.device | str, choice) -> None:
    """Make `choice` (the engine's KernelChoice, resolved once when it is built) what kernels use on `device` when
    their caller passes none: the KV stores, the policies and third-party plugins call the public kernels so."""
    device = torch.device(device)
    _ACTIVE[(device.type, device.index)] = choice


def default_kernels(device: torch.device | str):
    """The KernelChoice of kernels whose caller passes none: the one activate_kernels set for the device, else
    resolve_kernels' choice, resolved on first use and kept (no environment read per call)."""
    device = torch.device(device)
    key = (device.type, device.index)
    choice = _ACTIVE.get(key)
    if choice is None:
        from .backend import resolve_kernels  # backend imports this module

        choice = _ACTIVE[key] = resolve_kernels(device)
    return choice


def use_triton(device: torch.device | str) -> bool:
    """Whether the Triton kernels run for ``device`` in a call that passes no KernelChoice."""
    return default_kernels(device).triton


@functools.lru_cache(maxsize=None)
def _pdl_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9  # griddepcontrol needs sm_90+


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch with programmatic dependent launch (PDL): CUDA of compute
    capability >= 9 (Hopper), compiled Triton. Such a launch may start while the previous kernel on the stream is
    still running, so a PDL kernel must call ``pdl_wait`` before it reads anything a previous kernel wrote and
    before its first store (an output buffer can be memory a previous kernel still reads), and every program must
    call it (a program that exits without waiting lets the next kernel pass its own wait before this kernel's
    predecessor is done). Loads of weights, and of the step's inputs that the host copies in before its first
    kernel (positions, slots, context lengths, block tables), may come before the wait."""
    if device.type != "cuda" or not HAS_TRITON or INTERPRET:
        return False
    return _pdl_capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch_options(pdl: bool) -> dict:
    """Launch keyword arguments for a kernel with a ``USE_PDL: tl.constexpr`` parameter: USE_PDL and, with
    ``pdl`` (KernelChoice.pdl, or :func:`pdl_supported`), Triton's ``launch_pdl``."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl else {"USE_PDL": False}


@jit
def exact_dot(a, b, acc):
    """``tl.dot(a, b, acc)`` that keeps float32 operands in IEEE float32. Triton's tl.dot rounds float32 inputs
    to TF32 unless told otherwise (its default_dot_input_precision launch option does not reach tl.dot), which
    leaves a relative error near 1e-3: enough to flip greedy tokens against HF in dtype=float32, the correctness
    mode. 16-bit operands compile to the same tl.dot as before."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Inside a kernel launched with :func:`pdl_launch_options`: wait until the previous kernel on the stream has
    finished and its writes are visible, and let the next one launch (its own wait keeps it correct)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


def alloc_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty, or a NaN-filled buffer when POISON_OUTPUTS is set (tests)."""
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None) -> int:
    """Streaming multiprocessors of a CUDA device (132 on H100); 132 off-GPU."""
    if device_index is None or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def choose_splits(work_items: int, length: int, device: torch.device, *, min_split_tokens: int,
                  programs_per_sm: int, max_splits: int) -> int:
    """Flash-decoding split count: each of ``work_items`` independent programs (e.g. sequence x kv head) reduces
    over ``length`` keys, cut into splits of at least ``min_split_tokens`` keys (shorter ones cost more in merging
    than they save), as many as fill ``programs_per_sm`` programs per SM, at most ``max_splits``."""
    if length <= min_split_tokens:
        return 1
    sms = num_sms(device.index if device.type == "cuda" else None)
    by_parallelism = cdiv(programs_per_sm * sms, max(1, work_items))
    by_length = cdiv(length, min_split_tokens)
    return max(1, min(by_parallelism, by_length, max_splits))


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
