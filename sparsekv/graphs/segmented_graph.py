"""graph.mode=segmented: decode graphs around eager attention (see sparsekv/graphs/cuda_graph.py for the
capture, the batch-size ladder and the wiring).

segmented: per batch size one graph for the embedding (+ the rotary cos/sin tables on the torch path), then for
every layer one pre-attention graph (input norm, qkv projection, q/k norm, rotary) and one post-attention graph
(o projection, residual, post norm, MLP, residual), and one for the final norm. A step replays embed, then per
layer pre -> attention -> post, then the final norm. The hidden state lives in one static buffer that every
layer's graphs read and update in place, so no copies run between the segments beyond the attention output.

The attention between them runs eagerly, except offloaded with the Triton kernels and a decode_graph_safe policy:
then, per KV layout, each whole layer (pre-attention, the attention with its ring loads, post-attention) is
captured as well (sparsekv.graphs.offload_graph.LayoutGraphs, as graph=cudagraph does for the whole step), and a
step replays embed, one graph per layer, the final norm. On an H100 at 8K (docs/decisions.md) eager
attention left the step at 1.42x its PCIe floor (about 0.2 ms of host time per layer); captured, 1.28-1.31x. A
layer's loads cannot start before its graph does, so they never run under the previous layer's GEMVs as they do
in the whole-step graph (1.07-1.09x).

Per-layer graphs (2 x num_layers per batch size) rather than one graph per segment with the weights as inputs:
a graph bakes in the addresses of its weights, so sharing one graph across layers would mean copying each
layer's weights into static buffers before every replay - twice the HBM traffic of the weight reads that
bound decode (Qwen3-4B: ~220 MB per layer, ~75 us per layer at 3 TB/s, ~2.7 ms per step). Per-layer graphs cost
only graph objects and the tiny activations of decode. tools/bench_cuda_graph.py times both.
"""
from __future__ import annotations

import functools

import torch

from sparsekv.config import GraphMode
from sparsekv.engine.context import Context
from sparsekv.graphs.cuda_graph import DecodeGraphRunner, step_context


class SegmentedGraphRunner(DecodeGraphRunner):
    """graph.mode=segmented: per layer a pre- and a post-attention graph, attention eager between them."""
    mode = GraphMode.segmented
    REQUIRED = ("embed", "norm", "layers")
    REQUIRED_LAYER = ("pre_attention", "attention", "post_attention")

    def __init__(self, model, kv_store, device: torch.device, batch_sizes: list[int], emulate: bool = False):
        super().__init__(model, kv_store, device, batch_sizes, emulate)
        missing = [name for name in self.REQUIRED if not hasattr(model, name)]
        missing += [f"layers[i].{name}" for name in self.REQUIRED_LAYER
                    if hasattr(model, "layers") and not all(hasattr(layer, name) for layer in model.layers)]
        if missing:
            raise ValueError(f"graph.mode=segmented needs a model split around attention; {type(model).__name__} "
                             f"lacks {', '.join(missing)} (see sparsekv/models/llama.py); use graph=eager")
        self.graphs: dict[int, tuple] = {}

    def _allocate(self) -> None:
        from sparsekv.graphs.offload_graph import LayoutGraphs
        from sparsekv.kernels._dispatch import use_triton
        from sparsekv.kvcache.offload_store import OffloadKVStore

        store = self.kv_store  # offloaded, on the Triton kernels: layers captured per layout (if the policy allows)
        mb, dev = self.max_batch_size, self.device
        self.layouts, self.decode_inputs = None, None
        if isinstance(store, OffloadKVStore) and (self.emulate or use_triton(self.device)):
            self.decode_inputs = torch.zeros(store.static_decode_inputs_size(), dtype=torch.int64, device=dev)
            self.layouts = LayoutGraphs(store, self.capturer, self.stats, self.emulate, self.decode_inputs)
        self.inputs = torch.zeros(2 * mb, dtype=torch.int64, device=dev)  # [2 * bs]: input ids, positions
        with step_context(None):
            hidden, rope = self.model.embed(self.inputs[:1], self.inputs[1:2])
            q, _, _ = self.model.layers[0].pre_attention(hidden, rope)
        self.hidden = torch.zeros(mb, *hidden.shape[1:], dtype=hidden.dtype, device=dev)  # [bs, hidden]
        self.attn_out = torch.zeros(mb, *q.shape[1:], dtype=q.dtype, device=dev)  # [bs, H, D]

    def _static_buffers(self) -> list[torch.Tensor]:
        extra = [self.decode_inputs] if self.decode_inputs is not None else []
        return [self.inputs, self.hidden, self.attn_out, *extra]

    def _capture(self, bs: int) -> None:
        ids, positions = self.inputs[:2 * bs].view(2, bs)
        ids.zero_(), positions.zero_()  # overlaps earlier steps' inputs of another batch size (lazy capture)
        hidden, attn_out = self.hidden[:bs], self.attn_out[:bs]
        capture = self.capturer.capture
        embed, rope = capture(functools.partial(self._embed, ids, positions, hidden))
        layers = []
        for layer in self.model.layers:
            pre, qkv = capture(functools.partial(layer.pre_attention, hidden, rope))
            post, _ = capture(functools.partial(self._post, layer, hidden, attn_out))
            layers.append((layer, pre, qkv, post))
        final = capture(functools.partial(self.model.norm, hidden))
        self.graphs[bs] = ((embed, rope), layers, final)

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor):
        h, rope = self.model.embed(ids, positions)  # rope: positions (the static view), inv_freq, cos/sin or None
        hidden.copy_(h)
        return rope

    @staticmethod
    def _post(layer, hidden: torch.Tensor, attn_out: torch.Tensor) -> None:
        hidden.copy_(layer.post_attention(hidden, attn_out))  # every layer updates the one static hidden state

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        n = input_ids.shape[0]
        self.ensure_bucket(n)
        bs = self.bucket(n)
        static = self.inputs[:2 * bs].view(2, bs)
        static[0, :n].copy_(input_ids)
        static[1, :n].copy_(positions)
        if n < bs:  # buckets share the buffer: a smaller size's positions may sit in these padding ids
            static[:, n:].zero_()
        (embed, rope), layers, (final, normed) = self.graphs[bs]
        embed()
        layout, entry = self.layouts.plan_step(context.seqs) if self.layouts else (None, None)
        if entry is None:
            for layer, pre, (q, k, v), post in layers:
                pre()
                self.attn_out[:n].copy_(layer.attention(q[:n], k[:n], v[:n]))  # the store of the step's Context
                post()
            if layout is not None:  # one graph per layer: its loads start with its pre-attention GEMVs
                self.layouts.capture(layout, [functools.partial(self._layer, layer, rope, n, bs)
                                              for layer in self.model.layers])
        else:
            with self.layouts.replaying(entry) as layer_graphs:
                for replay in layer_graphs:
                    replay()
        final()
        self.replayed_steps += 1
        return normed[:n]

    def _layer(self, layer, rope, n: int, bs: int) -> None:
        """One decoder layer on the static hidden state (pre-attention, attention of the n real rows, post)."""
        hidden, attn_out = self.hidden[:bs], self.attn_out[:bs]
        q, k, v = layer.pre_attention(hidden, rope)
        attn_out[:n].copy_(layer.attention(q[:n], k[:n], v[:n]))
        self._post(layer, hidden, attn_out)
