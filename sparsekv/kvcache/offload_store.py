"""offload=cpu: KV blocks live in pinned host memory; attention runs through the policy's ring pipelines."""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

from sparsekv.engine.context import Context, PrefillChunk
from sparsekv.engine.sequence import Sequence
from sparsekv.kvcache.base import KVStore, available_host_memory, join_rows
from sparsekv.kvcache.batched_decode import batched_decode_attention, selected_decode_attention
from sparsekv.kvcache.host_pool import GIB, HostPool
from sparsekv.kvcache.host_quant import host_block_bytes
from sparsekv.kvcache.offload_engine import OffloadEngine, RingCapture
from sparsekv.kvcache.reader import RingReader
from sparsekv.kvcache.staged_decode import staged_decode_attention
from sparsekv.policies.base import SparsePolicy
from sparsekv.policies.context import KVLayout, PolicyContext, check_attention_output

HOST_HEADROOM = 4 * GIB


def host_pool_blocks(host_pool_gib: float | None, bytes_per_block: int) -> int:
    limit = host_pool_gib * GIB if host_pool_gib else 0.9 * available_host_memory() - HOST_HEADROOM
    return max(0, int(limit // bytes_per_block))


class OffloadKVStore(KVStore):
    engine_class = OffloadEngine  # the ring engine (the quality harness substitutes a recording one)

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, num_gpu_blocks: int,
                 prefill_tokens: int, max_num_seqs: int, host_pool_gib: float | None, dtype: torch.dtype,
                 device: torch.device, prefill_policy, decode_policy, initial_prefill_buffer: int,
                 check_selections: bool = False, host_dtype: torch.dtype | None = None,
                 cache_slots_per_layer: int = 0, expected_blocks: int = 0):
        self.block_size = block_size
        self.chunk_tokens = prefill_tokens
        self.prefill_token_budget = prefill_tokens
        self.chunk_alignment = block_size
        host_dtype = host_dtype or dtype  # fp8 (offload.host_dtype): scales beside the blocks, host_quant.py
        self.bytes_per_block = host_block_bytes(num_layers, block_size, num_kv_heads, head_dim, host_dtype)
        self.num_blocks = host_pool_blocks(host_pool_gib, self.bytes_per_block)
        self.host = HostPool(num_layers, max(1, self.num_blocks), block_size, num_kv_heads, head_dim, host_dtype,
                             pin_memory=device.type == "cuda")
        # cache_slots_per_layer: the GPU block cache's size (0: none); sizing.gpu_cache_slots sizes it
        self.engine = self.engine_class(self.host, num_gpu_blocks, initial_prefill_buffer, max_num_seqs, device,
                                        model_dtype=dtype, cache_slots_per_layer=cache_slots_per_layer)
        # the policies whose metadata hooks see every offloaded block
        self.policies = [prefill_policy] if prefill_policy is decode_policy else [prefill_policy, decode_policy]
        self.layout = KVLayout(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               block_size=block_size, max_blocks=self.num_blocks, dtype=dtype, device=device,
                               expected_blocks=min(expected_blocks, self.num_blocks))
        for policy in self.policies:
            policy.initialize(self.layout)
        self.prefill_policy, self.decode_policy = prefill_policy, decode_policy
        # validate device-tensor selections too: one host sync per layer and step (list selections always are)
        self.check_selections = check_selections
        self.readers = [RingReader(self.engine, layer, check_selections=check_selections)
                        for layer in range(num_layers)]
        self.device = device
        self.decode_rows: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (seq, row of the decode buffer)
        self.free_rows = list(range(max_num_seqs))
        self.filled: list[int] = []  # decode: batch indices whose block fills this step
        self.batched_blocks: list[list[int]] | None = None  # decode: per sequence its full blocks, when batched
        self.batched_in_cache = False  # decode, batched: the GPU block cache holds every block of the batch
        self.num_layers, self.max_num_seqs = num_layers, max_num_seqs
        # captured decode steps (bind_static_decode_inputs): each step's decode slots and tail lengths
        self.static_decode_inputs: torch.Tensor | None = None
        self.reserved_blocks = 0  # host blocks kept pinned while idle (reserve); the rest is released when idle

    @property
    def transfer_stats(self) -> dict[str, int]:
        """The engine's counters, with what the device counted so far (a host sync when it counted any)."""
        self.engine.collect_device_counts()
        return self.engine.transfer_stats

    @property
    def cache_stats(self) -> dict[str, int]:
        """The GPU block cache's counters (OffloadEngine.cache_stats); empty without a cache."""
        return self.engine.cache_stats

    def capacity_hint(self) -> str:
        return (f"the host pool holds {self.num_blocks} blocks of {self.block_size} tokens; raise "
                "offload.host_pool_gib, free host memory, or shorten the prompt")

    def reserve(self, num_tokens: int) -> float:
        """Pin host memory for `num_tokens` tokens of KV now rather than while prefilling; returns seconds spent.
        Pinning runs at a few GB/s, so a first long request otherwise pays it inside its prefill."""
        start = time.perf_counter()
        self.reserved_blocks = min(self.num_blocks, -(-num_tokens // self.block_size))
        self.host.ensure_capacity(self.reserved_blocks)
        return time.perf_counter() - start

    # ---- what the policies see
    def prefix_blocks(self, seq: Sequence) -> list[int]:
        """Host blocks before the prefill chunk being computed (all full)."""
        return seq.block_table[: seq.num_computed_tokens // self.block_size]

    def full_blocks(self, seq: Sequence) -> list[int]:
        """Decode: host blocks before the block of the token being computed."""
        return seq.block_table[: (len(seq) - 1) // self.block_size]

    @property
    def decode_pipeline_standard(self) -> bool:
        """Does the decode policy attend its selection (or every block) with the base pipeline? Then a batch can be
        attended by one paged call over the GPU block cache (sparsekv/kvcache/batched_decode.py)."""
        return type(self.decode_policy).compute_chunked_decode is SparsePolicy.compute_chunked_decode

    @property
    def decode_attends_all(self) -> bool:
        """Does the decode policy keep every block (full attention: no selection to ask for)?"""
        return type(self.decode_policy).select_blocks is SparsePolicy.select_blocks

    def decode_tail(self, seq: Sequence, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Decode: (k, v, length) of the unfinished block, the new token included. Eager steps: k/v [n, KVH, D] hold
        exactly its n tokens and length is None. Captured steps: k/v are the whole block [block_size, KVH, D] and
        length [1] on the device counts the valid rows (a replay does not know n on the host)."""
        row = self.decode_rows[seq.seq_id][1]
        if self.static_decode_inputs is None:
            return (*self.engine.get_decode_layer_kv(row, layer, (len(seq) - 1) % self.block_size + 1), None)
        return (*self.engine.get_decode_layer_kv(row, layer, self.block_size), self._tail_lengths[seq.seq_id])

    # ---- for the graph runners (sparsekv/graphs/offload_graph.py): what a captured decode step needs
    def static_decode_inputs_size(self) -> int:
        """int64 elements of the buffer bind_static_decode_inputs takes."""
        return self.max_num_seqs * (self.num_layers + 1)

    def bind_static_decode_inputs(self, buffer: torch.Tensor) -> None:
        """Captured decode: each step's decode slots and tail lengths go to `buffer` (one fixed device buffer the
        runner owns), so a step replays with nothing but that buffer changed."""
        if buffer.dtype != torch.int64 or buffer.numel() < self.static_decode_inputs_size():
            raise ValueError(f"static decode inputs: need {self.static_decode_inputs_size()} int64 elements, got "
                             f"{buffer.numel()} {buffer.dtype}")
        self.static_decode_inputs = buffer

    def decode_layout(self, seqs: list[Sequence]) -> tuple:
        """What a captured decode step bakes in: per sequence its decode row and full host blocks, the host slabs
        the gather reads, and the device-side id lists it was captured with."""
        cache = self.engine.cache
        return (self.host.generation, self.engine.device_ids_generation, cache.epoch if cache is not None else 0,
                *((self.decode_rows[s.seq_id][1], *self.full_blocks(s)) for s in seqs))

    def block_fills(self) -> bool:
        """A block fills this step (after begin_step): its offload and the policy hooks run on the host."""
        return bool(self.filled)

    @property
    def decode_graph_safe(self) -> bool:
        return self.decode_policy.decode_graph_safe

    def forget_device_ids(self) -> None:
        self.engine.forget_device_ids()

    @contextlib.contextmanager
    def capturing(self, capture: RingCapture) -> Iterator[None]:
        """The ring engine in capture mode for the block: its loads are ordered inside the capture and counted
        into capture.moved."""
        self.engine.start_capture(capture)
        try:
            yield
        finally:
            self.engine.finish_capture()

    def offloads_issued(self) -> int:
        return self.engine.offloads_issued()

    def order_after_offloads(self) -> None:
        """A replay queued from now on waits for the offloads so far (its gathers read those host blocks)."""
        self.engine.order_after_offloads()

    def replayed(self, moved: dict[str, int]) -> None:
        """A replay was queued that read every ring slot and moved `moved` (its capture's transfer counts)."""
        for key, value in moved.items():
            self.engine.transfer_stats[key] += value
        self.engine.mark_ring_read()

    # ---- step
    def _row(self, seq: Sequence, in_step: set[int]) -> int:
        if seq.seq_id in self.decode_rows:
            return self.decode_rows[seq.seq_id][1]
        if not self.free_rows:  # reclaim rows of preempted sequences (their KV is recomputed anyway)
            for seq_id, (other, row) in list(self.decode_rows.items()):
                if seq_id not in in_step and other.num_computed_tokens == 0:
                    del self.decode_rows[seq_id]
                    self.free_rows.append(row)
        row = self.free_rows.pop()
        self.decode_rows[seq.seq_id] = (seq, row)
        return row

    def begin_step(self, context: Context) -> None:
        self.host.ensure_capacity(1 + max(max(seq.block_table) for seq in context.seqs))
        self.engine.begin_step()
        in_step = {seq.seq_id for seq in context.seqs}
        rows = [self._row(seq, in_step) for seq in context.seqs]
        if context.is_prefill:
            self.engine.ensure_prefill_capacity(context.chunks[-1].end)
            return
        offsets = [(len(seq) - 1) % self.block_size for seq in context.seqs]
        self.filled = [b for b, seq in enumerate(context.seqs) if len(seq) % self.block_size == 0]
        self.batched_blocks = self._batched_blocks(context.seqs)
        batch = len(rows)
        if self.static_decode_inputs is None:
            if self.batched_blocks is None:
                self.decode_slots = self.engine.decode_slots(rows, offsets)  # [L, B]
                return
            # one copy: [L * B] decode slots, then [B] tail lengths (what the batched attention reads)
            host = self.engine.decode_slot_table(rows, offsets) + [offset + 1 for offset in offsets]
            table = torch.tensor(host, dtype=torch.int64, pin_memory=self.device.type == "cuda").to(
                self.device, non_blocking=True)
        else:  # the same, into the runner's static buffer (a graph is captured per batch size, so the views of one
            # B are the same buffers at every replay)
            host = self.engine.decode_slot_table(rows, offsets) + [offset + 1 for offset in offsets]
            table = self.static_decode_inputs[:len(host)]
            table.copy_(torch.tensor(host, dtype=torch.int64, pin_memory=self.device.type == "cuda"),
                        non_blocking=True)
        self.decode_slots = table[:-batch].view(-1, batch)  # [L, B]
        self.tail_lengths = table[-batch:]  # [B]
        if self.static_decode_inputs is not None:
            self._tail_lengths = {seq.seq_id: self.tail_lengths[b:b + 1]
                                  for b, seq in enumerate(context.seqs)}  # each [1]

    def _batched_blocks(self, seqs: list[Sequence]) -> list[list[int]] | None:
        """Each sequence's full host blocks when this decode step attends the whole batch at once, with a decode
        policy that has the standard pipeline: through the GPU block cache when it can hold the batch's blocks of a
        layer (batched_decode.py), else a selecting policy's choices resolved against what the cache holds (one
        sequence too: its device-side choice reaches the cache only this way), else through the ring
        (staged_decode.py) for several sequences; None: one sequence through its own pipeline (one sequence with
        full attention reads its cached runs in place already)."""
        cache = self.engine.cache
        self.batched_in_cache = False
        if not self.decode_pipeline_standard or (len(seqs) < 2 and (cache is None or self.decode_attends_all)):
            return None
        blocks = [self.full_blocks(seq) for seq in seqs]
        self.batched_in_cache = cache is not None and sum(map(len, blocks)) <= cache.capacity
        # a selection the cache cannot hold whole is resolved against what it holds (selected_decode_attention)
        return blocks if self.batched_in_cache or len(seqs) > 1 or not self.decode_attends_all else None

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               context: Context) -> torch.Tensor:
        return (self._prefill if context.is_prefill else self._decode)(layer_id, q, k, v, scale, context)

    def _prefill(self, layer: int, q, k, v, scale: float, context: Context) -> torch.Tensor:
        engine, bs = self.engine, self.block_size
        engine.write_prefill_buffer(layer, k, v)
        outs = []
        policy, reader = self.prefill_policy, self.readers[layer]
        # every chunk's early copy before any attention: the layer's offloads wait for the copies, not the attention
        views = [self._sequence_kv(layer, chunk, k[chunk.start:chunk.end], v[chunk.start:chunk.end])
                 for chunk in context.chunks]
        for chunk, view in zip(context.chunks, views):  # attention first: its loads need not queue behind offloads
            rows = slice(chunk.start, chunk.end)
            ctx = PolicyContext(phase="prefill", layer=layer, query=q[rows], candidates=self.prefix_blocks(chunk.seq),
                                block_size=bs, query_start=chunk.num_cached,
                                kv_len=chunk.num_cached + chunk.num_tokens, softmax_scale=scale, chunk_keys=k[rows],
                                prompt_len=chunk.seq.num_prompt_tokens, ids_source=engine.device_block_ids,
                                sequence_kv=view)
            outs.append(check_attention_output(policy, "compute_chunked_prefill", layer, q[rows],
                                               policy.compute_chunked_prefill(q[rows], k[rows], v[rows], ctx, reader)))
        for chunk in context.chunks:  # the D2H copies overlap the rest of the layer
            seq, first = chunk.seq, chunk.num_cached // bs
            for i, start in enumerate(range(chunk.start, chunk.end, bs)):
                block, n = seq.block_table[first + i], min(bs, chunk.end - start)
                keys = engine.prefill_keys(layer, start, n)  # [n, KVH, D]
                for hooked in self.policies:
                    hooked.on_prefill_offload(block, layer, keys, n)
                engine.offload_prefill_buffer_async(layer, block, n, start)
            tail = (chunk.num_cached + chunk.num_tokens) % bs
            if tail and chunk.num_cached + chunk.num_tokens == len(seq):
                engine.copy_prefill_tail_to_decode(layer, self.decode_rows[seq.seq_id][1], chunk.end - tail, tail)
        return join_rows(outs)

    def _sequence_kv(self, layer: int, chunk: PrefillChunk, k: torch.Tensor, v: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The chunk's PolicyContext.sequence_kv: its prefix and its own k/v [n, KVH, D] as one view each, when the
        GPU block cache holds the prefix in one run and can take the chunk's blocks after it (the chunk's rows are
        written into the cache now); else None."""
        bs = self.block_size
        if self.engine.cache is None or not chunk.num_cached or chunk.num_cached % bs:
            return None
        first, count = chunk.num_cached // bs, -(-chunk.num_tokens // bs)  # the last block may be partial
        table = chunk.seq.block_table
        return self.engine.sequence_view(layer, table[:first], table[first:first + count], k, v)

    def _decode(self, layer: int, q, k, v, scale: float, context: Context) -> torch.Tensor:
        engine = self.engine
        engine.write_decode_tokens(layer, self.decode_slots[layer], k, v)
        if self.batched_blocks is not None:  # the whole batch at once: over the cache, else through the ring
            selections = None if self.decode_attends_all else self._selections(layer, q, scale, context.seqs)
            out = None
            if self.batched_in_cache:
                out = batched_decode_attention(engine, layer, q, scale, self.batched_blocks,
                                               self.decode_slots[layer], self.tail_lengths, selections)
            elif selections is not None and engine.cache is not None:  # None: more than the region can stage
                out = selected_decode_attention(engine, layer, q, scale, self.batched_blocks,
                                                self.decode_slots[layer], self.tail_lengths, selections)
            if out is None:
                out = staged_decode_attention(self.readers[layer], q, scale, self.batched_blocks,
                                              self.decode_slots[layer], self.tail_lengths, selections)
        else:
            outs = [self._decode_one(layer, q[b:b + 1], scale, seq) for b, seq in enumerate(context.seqs)]
            out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [B, H, D]
        for b in self.filled:
            seq = context.seqs[b]
            row, block = self.decode_rows[seq.seq_id][1], seq.block_table[(len(seq) - 1) // self.block_size]
            keys = engine.decode_keys(row, layer)  # [block_size, KVH, D]
            for hooked in self.policies:
                hooked.on_decode_offload(block, layer, keys, self.block_size)
            engine.offload_decode_buffer_async(layer, row, block)
        return out

    def _selections(self, layer: int, q: torch.Tensor, scale: float, seqs: list[Sequence]
                    ) -> list[list[int] | torch.Tensor]:
        """The decode policy's checked choices among each sequence's full blocks (batched decode), one policy call
        for the sequences that have any."""
        ctxs = {b: PolicyContext(phase="decode", layer=layer, query=q[b:b + 1], candidates=blocks,
                                 block_size=self.block_size, query_start=len(seq) - 1, kv_len=len(seq),
                                 softmax_scale=scale, ids_source=self.engine.device_block_ids)
                for b, (seq, blocks) in enumerate(zip(seqs, self.batched_blocks)) if blocks}
        chosen = dict(zip(ctxs, self.decode_policy.checked_selections(list(ctxs.values()), self.readers[layer])))
        return [chosen.get(b, []) for b in range(len(seqs))]

    def _decode_one(self, layer: int, q: torch.Tensor, scale: float, seq: Sequence) -> torch.Tensor:
        n = len(seq)
        ctx = PolicyContext(phase="decode", layer=layer, query=q, candidates=self.full_blocks(seq),
                            block_size=self.block_size, query_start=n - 1, kv_len=n, softmax_scale=scale,
                            ids_source=self.engine.device_block_ids)
        reader = RingReader(self.engine, layer, self.decode_tail(seq, layer), self.check_selections)
        return self.decode_policy.compute_chunked_decode(q, ctx, reader)

    def release(self, seq: Sequence) -> None:
        entry = self.decode_rows.pop(seq.seq_id, None)
        if entry is not None:
            self.free_rows.append(entry[1])
        if not self.decode_rows:  # idle: per-sequence policy state, device-side id lists and host slabs can go
            self.engine.forget_device_ids()
            for policy in self.policies:
                policy.reset()
            if self.device.type == "cuda":  # no copy or gather may touch a slab being freed
                torch.cuda.synchronize(self.device)
            self.host.release_slabs(self.reserved_blocks)
            if self.engine.cache is not None:
                self.engine.cache.release_staging()
