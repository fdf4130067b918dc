"""Backend selection shared by every kernel in sparsekv.kernels.

One function, :func:`attention_backend`, decides which implementation runs:

* ``'flash_attn'``: the flash-attn package (CUDA, fp16/bf16 only);
* ``'sdpa'``: torch's fused flash kernel via ``aten._scaled_dot_product_flash_attention``;
* ``'cudnn'``: torch's cuDNN attention via ``aten._scaled_dot_product_cudnn_attention`` (same limits as sdpa;
  not yet timed on a GPU, so forced only);
  (CUDA, fp16/bf16, non-causal or Sq == Sk because its causal mask is top-left aligned);
* ``'triton'``: our Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``);
* ``'torch'``: the pure-torch references.

``SPARSEKV_ATTN_BACKEND`` (torch|triton|flash_attn|sdpa|cudnn) forces a choice; a forced backend
that cannot run the given call falls back along flash_attn -> sdpa -> triton -> torch.
Merge and paged-decode kernels only distinguish Triton from torch (:func:`use_triton`).
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
# Kernel modules decorate with this; annotations stay strings (``from __future__ import
# annotations``), which Triton accepts, so kernel definitions need no triton at import.
jit = triton.jit if HAS_TRITON else (lambda fn: fn)

BACKENDS = ("torch", "triton", "flash_attn", "sdpa", "cudnn")
ENV_BACKEND = "SPARSEKV_ATTN_BACKEND"

# Tests flip this to True so that every output buffer the launchers allocate starts as NaN:
# any element a kernel forgets to write then fails the comparison with the reference.
POISON_OUTPUTS = False

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def triton_interpret() -> bool:
    """True when Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=None)
def has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _forced_backend() -> str | None:
    forced = os.environ.get(ENV_BACKEND, "").strip().lower()
    if not forced:
        return None
    if forced not in BACKENDS:
        raise ValueError(f"{ENV_BACKEND}={forced!r} is not one of {BACKENDS}")
    return forced


def attention_backend(
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    causal: bool = False,
    seqlen_q: int | None = None,
    seqlen_k: int | None = None,
    head_dim: int | None = None,
) -> str:
    """Pick the attention implementation for tensors on ``device``.

    Called with only ``device`` it returns the preferred backend for that device; the
    optional arguments describe a concrete call so that backends that cannot serve it
    (fp32 for flash kernels, bottom-right causal with Sq != Sk for sdpa, ...) are skipped.
    """
    # memoised on the call and the two environment variables that steer it (a decode step asks per layer)
    return _attention_backend(str(device), os.environ.get(ENV_BACKEND, ""), os.environ.get("TRITON_INTERPRET", ""),
                              dtype, causal, seqlen_q, seqlen_k, head_dim)


@functools.lru_cache(maxsize=1024)
def _attention_backend(device: str, forced_env: str, interpret_env: str, dtype: torch.dtype | None, causal: bool,
                       seqlen_q: int | None, seqlen_k: int | None, head_dim: int | None) -> str:
    device = torch.device(device)
    forced = _forced_backend()
    if device.type != "cuda":
        # Off-GPU the Triton kernels run only when asked for (SPARSEKV_ATTN_BACKEND=triton) under the interpreter
        # (TRITON_INTERPRET=1): the kernel tests do that; everything else runs the references at full speed.
        return "triton" if HAS_TRITON and triton_interpret() and forced == "triton" else "torch"
    if forced == "torch" or (forced == "triton" and HAS_TRITON):
        return forced
    half_ok = dtype is None or dtype in _HALF_DTYPES
    dim_ok = head_dim is None or (head_dim % 8 == 0 and head_dim <= 256)
    if forced in (None, "flash_attn") and has_flash_attn() and half_ok and dim_ok:
        return "flash_attn"
    causal_ok = not causal or seqlen_q is None or seqlen_q == seqlen_k
    # Measured on Hopper (H200, bf16, D=64/128/256): our Triton kernel beat torch's fused flash kernel by 1.4-1.6x,
    # so sdpa (and cudnn, not yet timed) run only when asked for.
    if forced in ("sdpa", "cudnn") and half_ok and dim_ok and causal_ok:
        return forced
    return "triton" if HAS_TRITON else "torch"


def use_triton(device: torch.device | str) -> bool:
    """Whether the Triton kernels (merge, paged decode, the fused elementwise ops) should run for ``device``:
    triton is importable and the backend is not the torch reference (flash_attn/sdpa attention still means the
    other kernels are Triton's)."""
    return HAS_TRITON and attention_backend(device) != "torch"


ENV_FUSED = "SPARSEKV_FUSED_ELEMENTWISE"


def use_fused_elementwise(device: torch.device | str) -> bool:
    """Whether the fused RMSNorm / rotary / SiLU kernels run: wherever Triton runs, unless
    SPARSEKV_FUSED_ELEMENTWISE=0 selects the unfused torch ops (to compare, or to rule the kernels out)."""
    if not use_triton(device):
        return False
    return os.environ.get(ENV_FUSED, "1").strip().lower() not in ("0", "false", "no", "off")


ENV_GEMV = "SPARSEKV_GEMV"
GEMV_CHOICES = ("", "auto", "torch", "triton")
# auto: the rows counts at which the skinny kernel measured faster than cuBLAS on an H100 inside the whole decode
# step (docs/benchmarks.md, session 6: batch 1 gained, batch 8 did not)
AUTO_GEMV_MAX_ROWS = 1


def use_triton_gemv(device: torch.device | str, rows: int, max_rows: int) -> bool:
    """Whether a linear layer with `rows` input rows runs sparsekv.kernels.gemv's skinny kernel on ``device``.
    SPARSEKV_GEMV=auto (or unset): on CUDA for up to AUTO_GEMV_MAX_ROWS rows; =triton: wherever the Triton
    kernels run (:func:`use_triton`, the interpreter included) for up to `max_rows` rows; =torch: never (F.linear)."""
    choice = os.environ.get(ENV_GEMV, "").strip().lower()
    if choice not in GEMV_CHOICES:
        raise ValueError(f"{ENV_GEMV}={choice!r} is not one of {GEMV_CHOICES[1:]} (or unset)")
    if choice == "torch" or rows <= 0 or not use_triton(device):
        return False
    if choice == "triton":
        return rows <= max_rows
    return torch.device(device).type == "cuda" and rows <= min(max_rows, AUTO_GEMV_MAX_ROWS)


ENV_DECODE_FUSION = "SPARSEKV_DECODE_FUSION"


@functools.lru_cache(maxsize=None)
def decode_fusion() -> bool:
    """SPARSEKV_DECODE_FUSION (read once per process; default 1): the model's fused forward (the residual add in
    the next RMSNorm, silu(gate) * up in the down projection's loads, the KV write in the q/k norm + rotary
    kernel); 0 runs the unfused ops, to compare. Either computes the same values."""
    choice = os.environ.get(ENV_DECODE_FUSION, "1").strip().lower()
    if choice not in ("", "0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"{ENV_DECODE_FUSION}={choice!r}: use 1 (fused decode ops) or 0 (unfused, to compare)")
    return choice not in ("0", "false", "no", "off")


ENV_PDL = "SPARSEKV_PDL"


@functools.lru_cache(maxsize=None)
def pdl_requested() -> bool:
    """SPARSEKV_PDL (read once per process; tests clear this cache; default 1): launch the decode kernels of
    sparsekv.kernels.{gemv,rmsnorm,rotary,activation,paged_attention} with programmatic dependent launch where the
    GPU has it (use_pdl). On by default: the batch-1 4K decode step took 4.35 ms with it against 4.51 ms without
    (H100, docs/benchmarks.md, session 8); SPARSEKV_PDL=0 turns it off."""
    choice = os.environ.get(ENV_PDL, "1").strip().lower()
    if choice not in ("", "0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"{ENV_PDL}={choice!r}: use 1 (launch with programmatic dependent launch) or 0 (off)")
    return choice in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=None)
def _pdl_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9  # griddepcontrol needs sm_90+


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch (PDL): SPARSEKV_PDL=1, CUDA of
    compute capability >= 9 (Hopper), not the interpreter. Such a launch may start while the previous kernel on
    the stream is still running, so a PDL kernel must call ``gdc_wait`` before it reads anything a previous
    kernel wrote and before its first store (an output buffer can be memory a previous kernel still reads), and
    every program must call it (a program that exits without waiting lets the next kernel pass its own wait
    before this kernel's predecessor is done). Loads of weights, and of the step's inputs that the host copies in
    before its first kernel (positions, slots, context lengths, block tables), may come before the wait."""
    if device.type != "cuda" or not HAS_TRITON or not pdl_requested() or triton_interpret():
        return False
    return _pdl_capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch_options(device: torch.device) -> dict:
    """Launch keyword arguments for a kernel with a ``USE_PDL: tl.constexpr`` parameter: USE_PDL and, where
    :func:`use_pdl` says so, Triton's ``launch_pdl``."""
    return {"USE_PDL": True, "launch_pdl": True} if use_pdl(device) else {"USE_PDL": False}


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
