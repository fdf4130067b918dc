"""The fp8 host tier (offload.host_dtype=float8_e4m3fn): host blocks hold fp8 K/V with one float32 scale per
(layer, block, KV head), so host memory and PCIe carry about half the bytes of bf16.

  quantize   at offload, on the GPU, from the model-dtype prefill/decode buffers (the policies' metadata hooks
             saw those unquantized keys first); the fp8 block and its scales go to the host on the D2H stream
  scales     pinned float32 slabs [L, blocks_per_slab, KVH] beside each HostPool slab (K and V), and a ring of
             scales [2, num_slots, KVH] on the GPU beside the ring slots, loaded with the blocks (copy engines or
             the gather kernel, the same paths as the blocks)
  dequantize on the GPU as the ring is read: the prefill kernel (kernels/fp8_attention.py) and the decode split
             kernel read fp8 slots and scales directly (RingReader.scaled_groups); readers that compute on
             model-dtype K/V themselves (MInference's prefill) get the group dequantized into a ring-sized scratch by
             one kernel launch (RingReader.groups)
The GPU block cache (gpu_block_cache.py) holds blocks as the ring does: fp8 with their scales, copied with the
blocks (host -> cache, cache -> ring) and written through from the quantized offload. The ring engine calls this;
policies never see it.
"""
from __future__ import annotations

import torch

from sparsekv.config import HostDType
from sparsekv.kernels.block_gather import gather_host_blocks, gather_missing_blocks, slab_word_offsets
from sparsekv.kernels.fp8_kv import FP8_DTYPE, dequantize_blocks, quantize_kv_block
from sparsekv.kvcache.host_pool import HostPool

SCALE_DTYPE = torch.float32


def resolve_host_dtype(host_dtype: HostDType | str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of host KV blocks for offload.host_dtype; fp8 needs torch's float8_e4m3fn and, on CUDA, a GPU of
    compute capability 8.9 or newer (fp8 conversions in the Triton kernels)."""
    name = HostDType(host_dtype)
    if name == HostDType.auto:
        return model_dtype
    if not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"offload.host_dtype={name.value} needs torch>=2.1 (float8_e4m3fn); this torch "
                         f"{torch.__version__} lacks it; upgrade torch or use offload.host_dtype=auto")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"offload.host_dtype={name.value} needs a GPU of compute capability 8.9 or newer (fp8); "
                             f"{torch.cuda.get_device_name(device)} is {major}.{minor}; use offload.host_dtype=auto")
    return FP8_DTYPE


def host_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                     host_dtype: torch.dtype) -> int:
    """Host bytes of one block in all layers, K and V, fp8 scales included."""
    scales = num_kv_heads * SCALE_DTYPE.itemsize if host_dtype == FP8_DTYPE else 0
    return 2 * num_layers * (block_size * num_kv_heads * head_dim * host_dtype.itemsize + scales)


class Fp8Ring:
    """What the ring engine adds for fp8 host blocks: the scales (host slabs and ring slots), quantization on the
    way out and dequantization of ring groups for readers that want the model dtype."""

    def __init__(self, host: HostPool, num_slots: int, model_dtype: torch.dtype | None, device: torch.device):
        if model_dtype is None or not model_dtype.is_floating_point or model_dtype.itemsize < 2:
            raise ValueError(f"an fp8 host pool needs the model dtype of the ring's readers; got {model_dtype}")
        self.host, self.model_dtype, self.device = host, model_dtype, device
        kvh = host.num_kv_heads
        self.scale_bytes = kvh * SCALE_DTYPE.itemsize  # per block, layer and K or V
        self.k_slabs: list[torch.Tensor] = []  # each [L, blocks_per_slab, KVH] float32, beside host.k_slabs[i]
        self.v_slabs: list[torch.Tensor] = []
        self.slot_scales = torch.zeros((2, num_slots, kvh), dtype=SCALE_DTYPE, device=device)  # [2, slots, KVH]
        self._scratch: torch.Tensor | None = None  # [2, slots, bs, KVH, D] model dtype, made on first use
        self._offsets: torch.Tensor | None = None

    def _grow(self) -> None:
        """One scale slab per host slab (the pool grows in slabs)."""
        host = self.host
        while len(self.k_slabs) < len(host.k_slabs):
            shape = (host.num_layers, host.blocks_per_slab, host.num_kv_heads)
            for slabs in (self.k_slabs, self.v_slabs):
                slabs.append(torch.zeros(shape, dtype=SCALE_DTYPE, pin_memory=host.pin_memory))

    def _host_scales(self, layer: int, first_block: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[count, KVH] K and V scales of consecutive blocks of one slab."""
        self._grow()
        slab, index = divmod(first_block, self.host.blocks_per_slab)
        return self.k_slabs[slab][layer, index:index + count], self.v_slabs[slab][layer, index:index + count]

    # ---- out: quantize a block on the GPU, hand the engine its (host destination, device source) copies
    def quantize_for_offload(self, layer: int, cpu_block: int, k: torch.Tensor, v: torch.Tensor,
                             d2h: torch.cuda.Stream | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """k, v [n, KVH, D] model dtype on the device -> the copies that store them as host block `cpu_block`:
        fp8 rows [:n] of K and V, and their scales. The quantized tensors are queued on the current stream; the
        caller's D2H stream (`d2h`) must wait for it, and they stay allocated until that stream used them."""
        n = k.shape[0]
        host_k, host_v = self.host.block(layer, cpu_block)
        host_ks, host_vs = self._host_scales(layer, cpu_block, 1)
        staged = torch.empty((2, *k.shape), dtype=FP8_DTYPE, device=k.device)  # [2, n, KVH, D]
        scales = torch.empty((2, k.shape[1]), dtype=SCALE_DTYPE, device=k.device)  # [2, KVH]
        quantize_kv_block(k, v, staged, scales)
        if d2h is not None:  # the allocator must not hand them out again before the D2H copies ran
            staged.record_stream(d2h)
            scales.record_stream(d2h)
        return [(host_k[:n], staged[0]), (host_v[:n], staged[1]), (host_ks[0], scales[0]), (host_vs[0], scales[1])]

    # ---- in: the scales travel with their blocks
    def copy_scales(self, layer: int, first_block: int, count: int, first_slot: int,
                    into: torch.Tensor | None = None) -> None:
        """The scales of `count` consecutive host blocks of one slab into scale slots `into` [2, slots, KVH] (default:
        the ring's), on the current stream: the engine calls this where it copies the blocks."""
        host_ks, host_vs = self._host_scales(layer, first_block, count)
        into = self.slot_scales if into is None else into
        into[0, first_slot:first_slot + count].copy_(host_ks, non_blocking=True)
        into[1, first_slot:first_slot + count].copy_(host_vs, non_blocking=True)

    def gather_scales(self, layer: int, block_ids: torch.Tensor, first_slot: int) -> None:
        """The scales of host blocks held in a device tensor, by the same gather kernel as the blocks."""
        gather_host_blocks(self.slot_scales, (self.k_slabs, self.v_slabs), self._slab_offsets(), block_ids, layer,
                           first_slot)

    def gather_missing_scales(self, layer: int, block_ids: torch.Tensor, slot_of_block: torch.Tensor,
                              staging: torch.Tensor, into: torch.Tensor) -> None:
        """The scales beside OffloadEngine.resolve_selected's blocks: those of missing blocks into their staging
        slots of `into` [2, slots, KVH] (the GPU block cache's scales)."""
        gather_missing_blocks(into, (self.k_slabs, self.v_slabs), self._slab_offsets(), block_ids, slot_of_block,
                              staging, layer)

    def _slab_offsets(self) -> torch.Tensor:
        self._grow()
        if self._offsets is None or self._offsets.shape[1] != len(self.k_slabs):
            self._offsets = torch.tensor(slab_word_offsets(self.k_slabs, self.v_slabs),
                                         dtype=torch.int64).to(self.device)
        return self._offsets

    # ---- reading the ring
    def scales_for_slots(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V scales of `count` consecutive ring slots: [count, KVH] float32 each."""
        return self.slot_scales[0, first:first + count], self.slot_scales[1, first:first + count]

    def dequantized_slots(self, k_slots: torch.Tensor, v_slots: torch.Tensor, first: int,
                          count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Model-dtype K and V of `count` consecutive ring slots ([count * block_size, KVH, D] each), dequantized
        into the scratch slots of the same index (one launch each): reusing them follows the ring's order."""
        if self._scratch is None:
            self._scratch = torch.empty((2, *k_slots.shape), dtype=self.model_dtype, device=self.device)
        out = []
        for kv, slots in enumerate((k_slots, v_slots)):
            dst = self._scratch[kv, first:first + count]
            dequantize_blocks(slots[first:first + count], self.slot_scales[kv, first:first + count], dst)
            out.append(dst.flatten(0, 1))
        return out[0], out[1]

    def dequantized(self, k: torch.Tensor, v: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 k, v [n * block_size, KVH, D] read in place (GPU block cache runs, of any length) with their scales
        [n, KVH] -> model-dtype copies of the same shape, in new tensors (one launch each)."""
        out = []
        for x, scale in zip((k, v), scales):
            blocks = x.unflatten(0, (scale.shape[0], -1))  # [n, block_size, KVH, D]
            dst = torch.empty(blocks.shape, dtype=self.model_dtype, device=self.device)
            dequantize_blocks(blocks, scale, dst)
            out.append(dst.flatten(0, 1))
        return out[0], out[1]
