"""Gather host KV blocks into GPU slots from a device-side list of block ids (zero-copy reads over PCIe).

gather_host_blocks(dst [2, slots, *block], base, slab_offsets [2, num_slabs], block_ids [n], layer,
                   blocks_per_slab, first_slot)
copies, for i < n, K and V of host block block_ids[i] of `layer` into dst[0/1, first_slot + i]. The host blocks live
in pinned slabs [L, blocks_per_slab, *block] (HostPool); slab_offsets[kv, s] is where slab s of K (kv=0) or V (kv=1)
starts, in 32-bit words from base's first word (slab_word_offsets). Every address is computed on the device from
block_ids, so a block-selecting policy whose choice is a device tensor (Quest) loads its blocks without a host sync: the
GPU reads the pinned pages directly (unified virtual addressing), and the CPU keeps queueing work.

Copy engines (cudaMemcpyAsync) stay the path for host-known block lists: they need no SMs. This kernel is for the
case where waiting for the ids on the host would stall the pipeline once per layer.

gather_missing_blocks(dst, base, slab_offsets, block_ids [n], slot_of_block [m], staging [n], layer, table, counts)
is the same copy behind a device-side lookup (the GPU block cache's): a block whose slot_of_block entry is a slot is
already on the device and is not copied; one whose entry is -1 is copied into dst[:, staging[i]]. table[i] gets the
slot that holds block i afterwards, and counts [2] adds the hits and misses, so the host learns neither. An id
outside [0, m) is padding: not copied, not counted, its table entry staging[i].
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ._dispatch import INTERPRET, cdiv, default_kernels, jit, tl

if TYPE_CHECKING:
    from .backend import KernelChoice

__all__ = ["gather_host_blocks", "gather_host_blocks_reference", "gather_missing_blocks",
           "gather_missing_blocks_reference"]

CHUNK_WORDS = 4096  # 32-bit words one program copies (16 KiB)
NUM_WARPS = 4


def gather_host_blocks_reference(dst: torch.Tensor, slabs: tuple[list[torch.Tensor], list[torch.Tensor]],
                                 block_ids: torch.Tensor, layer: int, first_slot: int) -> None:
    """The same copy with torch indexing, from the slab tensors themselves (one host sync for the ids)."""
    blocks_per_slab = slabs[0][0].shape[1]
    for i, block in enumerate(block_ids.tolist()):
        slab, index = divmod(block, blocks_per_slab)
        for kv in range(2):
            dst[kv, first_slot + i].copy_(slabs[kv][slab][layer, index])


def gather_missing_blocks_reference(dst: torch.Tensor, slabs: tuple[list[torch.Tensor], list[torch.Tensor]],
                                    block_ids: torch.Tensor, slot_of_block: torch.Tensor, staging: torch.Tensor,
                                    layer: int, table: torch.Tensor | None = None,
                                    counts: torch.Tensor | None = None) -> None:
    """The same lookup and copy with torch indexing (host syncs for the ids)."""
    lut, stage = slot_of_block.tolist(), staging.tolist()
    hits = misses = 0
    slots = []
    for i, block in enumerate(block_ids.tolist()):
        slot = lut[block] if 0 <= block < len(lut) else -1
        if slot >= 0:
            hits += 1
        elif 0 <= block < len(lut):
            misses += 1
            gather_host_blocks_reference(dst, slabs, torch.tensor([block]), layer, stage[i])
        slots.append(slot if slot >= 0 else stage[i])
    if table is not None:
        table.copy_(torch.tensor(slots, dtype=torch.int64))
    if counts is not None:
        counts += torch.tensor([hits, misses], dtype=counts.dtype, device=counts.device)


@jit
def _gather_kernel(DST, BASE, SLAB_OFF, IDS, layer, blocks_per_slab, num_slabs, block_words, dst_kv_stride,
                   dst_slot_stride, first_slot, CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
    i = tl.program_id(0)  # which selected block
    chunk = tl.program_id(1)  # which CHUNK words of it
    kv = tl.program_id(2)  # 0: K, 1: V
    block = tl.load(IDS + i).to(tl.int64)
    slab = block // blocks_per_slab
    src = tl.load(SLAB_OFF + kv * num_slabs + slab) + (layer * blocks_per_slab + block % blocks_per_slab) * block_words
    dst = kv * dst_kv_stride + (first_slot + i).to(tl.int64) * dst_slot_stride
    if ALIGNED:  # slabs are page-aligned and blocks a multiple of 16 bytes: 128-bit loads
        src = tl.multiple_of(src, 4)
        dst = tl.multiple_of(dst, 4)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = offs < block_words
    words = tl.load(BASE + src + offs, mask=ok)
    tl.store(DST + dst + offs, words, mask=ok)


@jit
def _gather_missing_kernel(DST, BASE, SLAB_OFF, IDS, LUT, STAGING, TABLE, COUNTS, lut_size, layer, blocks_per_slab,
                           num_slabs, block_words, dst_kv_stride, dst_slot_stride, CHUNK: tl.constexpr,
                           ALIGNED: tl.constexpr, WRITE_TABLE: tl.constexpr, COUNT: tl.constexpr):
    i = tl.program_id(0)  # which requested block
    chunk = tl.program_id(1)  # which CHUNK words of it
    kv = tl.program_id(2)  # 0: K, 1: V
    block = tl.load(IDS + i).to(tl.int64)
    valid = (block >= 0) & (block < lut_size)  # else padding
    slot = tl.load(LUT + block, mask=valid, other=-1).to(tl.int64)
    staged = tl.load(STAGING + i).to(tl.int64)
    miss = valid & (slot < 0)
    first = (chunk == 0) & (kv == 0)  # one program per block writes its entry and counts it
    if WRITE_TABLE:
        tl.store(TABLE + i, tl.where(slot >= 0, slot, staged), mask=first)
    if COUNT:
        one = block * 0 + 1
        tl.atomic_add(COUNTS, one, mask=first & (slot >= 0))
        tl.atomic_add(COUNTS + 1, one, mask=first & miss)
    slab = tl.where(miss, block, 0) // blocks_per_slab
    src = tl.load(SLAB_OFF + kv * num_slabs + slab, mask=miss, other=0) + (
        layer * blocks_per_slab + tl.where(miss, block, 0) % blocks_per_slab) * block_words
    dst = kv * dst_kv_stride + staged * dst_slot_stride
    if ALIGNED:
        src = tl.multiple_of(src, 4)
        dst = tl.multiple_of(dst, 4)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = offs < tl.where(miss, block_words, 0)  # a hit or padding moves nothing
    words = tl.load(BASE + src + offs, mask=ok)
    tl.store(DST + dst + offs, words, mask=ok)


def _check_gather(dst: torch.Tensor, k_slabs: list[torch.Tensor], v_slabs: list[torch.Tensor],
                  block_ids: torch.Tensor) -> int:
    """The shapes both gathers need; returns the bytes of one block."""
    if not k_slabs or len(k_slabs) != len(v_slabs):
        raise ValueError(f"expected as many K as V slabs, at least one; got {len(k_slabs)} and {len(v_slabs)}")
    block_shape = k_slabs[0].shape[2:]
    if dst.dim() != 2 + len(block_shape) or dst.shape[0] != 2 or dst.shape[2:] != block_shape \
            or not dst.is_contiguous():
        raise ValueError(f"expected dst [2, slots, {', '.join(map(str, block_shape))}] contiguous; "
                         f"got {tuple(dst.shape)}")
    if dst.dtype != k_slabs[0].dtype:
        raise ValueError(f"dst dtype {dst.dtype} differs from the host blocks' {k_slabs[0].dtype}")
    if block_ids.dim() != 1 or block_ids.dtype != torch.int64:
        raise ValueError(f"expected block_ids [n] int64; got {tuple(block_ids.shape)} {block_ids.dtype}")
    return math.prod(block_shape) * dst.element_size()


def gather_missing_blocks(dst: torch.Tensor, slabs: tuple[list[torch.Tensor], list[torch.Tensor]],
                          slab_offsets: torch.Tensor | None, block_ids: torch.Tensor, slot_of_block: torch.Tensor,
                          staging: torch.Tensor, layer: int, table: torch.Tensor | None = None,
                          counts: torch.Tensor | None = None, *, kernels: KernelChoice | None = None) -> None:
    """dst [2, slots, *block] (contiguous) and slabs as for gather_host_blocks; block_ids [n], slot_of_block [m]
    (a host block's slot in dst, -1: not there), staging [n] (where a missing block i goes), table [n] (optional
    out: the slot holding each block) and counts [2] (optional: hits and misses added), all int64 on dst's device.
    Nothing here waits on the host."""
    k_slabs, v_slabs = slabs
    block_bytes = _check_gather(dst, k_slabs, v_slabs, block_ids)
    n = block_ids.shape[0]
    for name, tensor, size in (("slot_of_block", slot_of_block, None), ("staging", staging, n),
                               ("table", table, n), ("counts", counts, 2)):
        if tensor is not None and (tensor.dim() != 1 or tensor.dtype != torch.int64
                                   or (size is not None and tensor.shape[0] != size)):
            raise ValueError(f"expected {name} [{size if size is not None else 'm'}] int64; "
                             f"got {tuple(tensor.shape)} {tensor.dtype}")
    if n == 0:
        return
    triton = (kernels if kernels is not None else default_kernels(dst.device)).triton
    if slab_offsets is None or not triton or block_bytes % 4 or slot_of_block.shape[0] == 0:
        gather_missing_blocks_reference(dst, slabs, block_ids, slot_of_block, staging, layer, table, counts)
        return
    block_words = block_bytes // 4
    chunk = 256 if INTERPRET else CHUNK_WORDS
    _gather_missing_kernel[(n, cdiv(block_words, chunk), 2)](
        dst.view(torch.int32), k_slabs[0].view(torch.int32), slab_offsets, block_ids, slot_of_block, staging,
        table if table is not None else block_ids, counts if counts is not None else block_ids,
        slot_of_block.shape[0], layer, k_slabs[0].shape[1], len(k_slabs), block_words,
        dst.stride(0) * dst.element_size() // 4, dst.stride(1) * dst.element_size() // 4,
        CHUNK=chunk, ALIGNED=block_words % 4 == 0, WRITE_TABLE=table is not None, COUNT=counts is not None,
        num_warps=NUM_WARPS,
    )


def gather_host_blocks(dst: torch.Tensor, slabs: tuple[list[torch.Tensor], list[torch.Tensor]],
                       slab_offsets: torch.Tensor | None, block_ids: torch.Tensor, layer: int,
                       first_slot: int, *, kernels: KernelChoice | None = None) -> None:
    """dst [2, slots, *block] (contiguous), slabs (K slabs, V slabs) each [L, blocks_per_slab, *block] pinned,
    slab_offsets [2, num_slabs] int64 on dst's device (HostPool.slab_offsets), block_ids [n] int64 on dst's device.

    Triton where ``kernels`` says so (default: the process default for dst's device), else the reference. Nothing
    here waits on the host."""
    k_slabs, v_slabs = slabs
    block_bytes = _check_gather(dst, k_slabs, v_slabs, block_ids)
    n = block_ids.shape[0]
    if first_slot < 0 or first_slot + n > dst.shape[1]:
        raise ValueError(f"slots [{first_slot}, {first_slot + n}) do not fit the {dst.shape[1]} slots of dst")
    if n == 0:
        return
    triton = (kernels if kernels is not None else default_kernels(dst.device)).triton
    if slab_offsets is None or not triton or block_bytes % 4:
        gather_host_blocks_reference(dst, slabs, block_ids, layer, first_slot)
        return
    base = k_slabs[0].view(torch.int32)
    block_words = block_bytes // 4
    chunk = 256 if INTERPRET else CHUNK_WORDS
    _gather_kernel[(n, cdiv(block_words, chunk), 2)](
        dst.view(torch.int32), base, slab_offsets, block_ids, layer, k_slabs[0].shape[1], len(k_slabs), block_words,
        dst.stride(0) * dst.element_size() // 4, dst.stride(1) * dst.element_size() // 4, first_slot,
        CHUNK=chunk, ALIGNED=block_words % 4 == 0, num_warps=NUM_WARPS,
    )


def slab_word_offsets(k_slabs: list[torch.Tensor], v_slabs: list[torch.Tensor]) -> list[list[int]]:
    """[2][num_slabs]: each slab's start in 32-bit words from the first K slab's (the kernel's base)."""
    base = k_slabs[0].data_ptr()
    offsets = []
    for slabs in (k_slabs, v_slabs):
        row = []
        for slab in slabs:
            delta = slab.data_ptr() - base
            if delta % 4:
                raise ValueError("host slabs must be 4-byte aligned for the block gather")
            row.append(delta // 4)
        offsets.append(row)
    return offsets
