"""Llama 3.x decoder (and the base that Qwen3 extends with q/k norm)."""
from __future__ import annotations

import torch
from torch import nn

from sparsekv.distributed.sharding import Shard, head_shards
from sparsekv.distributed.state import get_tp
from sparsekv.kernels.backend import KernelChoice
from sparsekv.kernels.rotary import KVWrite, apply_rotary
from sparsekv.layers.attention import Attention
from sparsekv.layers.embedding import VocabParallelEmbedding
from sparsekv.layers.linear import ColumnParallelLinear, Linear, ParallelLMHead, RowParallelLinear
from sparsekv.layers.norm import RMSNorm
from sparsekv.layers.rotary import Rope, RotaryEmbedding
from sparsekv.models.spec import MLP_SLICE_TOKENS, ModelSpec


class SelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int, qk_norm: bool, *, kernels: KernelChoice):
        super().__init__()
        tp = get_tp()
        heads = head_shards(spec.num_attention_heads, spec.num_key_value_heads, tp.rank, tp.size)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, spec.head_dim
        self.q_size = self.num_heads * self.head_dim  # this rank's heads (all of them on one GPU)
        self.kv_size = self.num_kv_heads * self.head_dim
        if tp.size == 1:
            self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias,
                                   kernels=kernels)
            self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.attention_bias, kernels=kernels)
        else:
            d = self.head_dim
            q = Shard(0, heads.first_head * d, self.q_size, spec.num_attention_heads * d)
            kv = Shard(0, heads.first_kv_head * d, self.kv_size, spec.num_key_value_heads * d)
            self.qkv_proj = ColumnParallelLinear(spec.hidden_size, [q, kv, kv], bias=spec.attention_bias,
                                                 kernels=kernels)
            self.o_proj = RowParallelLinear(q, spec.hidden_size, bias=spec.attention_bias, kernels=kernels, tp=tp)
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, kernels=kernels) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, kernels=kernels) if qk_norm else None
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim)
        self.pdl = kernels.pdl

    def project_qkv(self, hidden: torch.Tensor, rope: Rope, kv_target: tuple | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [N, hidden] (normed) -> q [N, H, D], k/v [N, KVH, D] after q/k norm and rotary. With kv_target
        (k_cache, v_cache, slot_mapping; only on the Triton path, rope.cos None) the kernel also stores k and v
        into the KV cache."""
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)  # [N, H, D]
        k = k.view(n, self.num_kv_heads, self.head_dim)  # [N, KVH, D]
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if rope.cos is None:  # Triton: q/k norm and rotary in one kernel, cos/sin from the positions
            qk_norm = self.q_norm is not None
            q, k = apply_rotary(q, k, rope.positions, rope.inv_freq, rope.attention_scaling,
                                self.q_norm.weight if qk_norm else None, self.k_norm.weight if qk_norm else None,
                                self.q_norm.eps if qk_norm else 1e-6,
                                KVWrite(v, *kv_target) if kv_target is not None else None, pdl=self.pdl)
            return q, k, v
        if kv_target is not None:
            raise ValueError("project_qkv stores k/v into the cache only in the fused kernel (rope.cos None); "
                             "on the torch path pass kv_target=None and let the KV store write them")
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(q, rope.cos, rope.sin), RotaryEmbedding.apply(k, rope.cos, rope.sin)
        return q, k, v


class GatedMLP(nn.Module):
    def __init__(self, spec: ModelSpec, *, kernels: KernelChoice):
        super().__init__()
        tp = get_tp()
        self.intermediate_size = spec.intermediate_size // tp.size  # this rank's columns
        if tp.size == 1:
            self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False, kernels=kernels)
            self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=False, kernels=kernels)
        else:
            part = Shard(0, tp.rank * self.intermediate_size, self.intermediate_size, spec.intermediate_size)
            self.gate_up_proj = ColumnParallelLinear(spec.hidden_size, [part, part], bias=False, kernels=kernels)
            self.down_proj = RowParallelLinear(part, spec.hidden_size, bias=False, kernels=kernels, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # silu(gate) * up: in the down projection's loads for decode on Triton, else one kernel (or torch's ops)
        if x.shape[0] > MLP_SLICE_TOKENS:
            return self._in_slices(x)
        return self.down_proj.silu_mul_forward(self.gate_up_proj(x))

    def _in_slices(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, hidden] -> [T, hidden], MLP_SLICE_TOKENS rows at a time, each slice's down projection written in place
        out = x.new_empty(x.shape[0], self.down_proj.out_features)
        for part, dest in zip(x.split(MLP_SLICE_TOKENS), out.split(MLP_SLICE_TOKENS)):
            self.down_proj.silu_mul_forward(self.gate_up_proj(part), out=dest)
        return out

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(self(x), residual) -> (normed, self(x) + residual), the sum written into `residual` (the caller's
        to overwrite) where the GEMM can add into it: the down projection, the residual add and the next RMSNorm
        fused where the skinny GEMV runs. x, residual [T, ...]: more than MLP_SLICE_TOKENS tokens go through the
        MLP in slices, each adding into its rows of `residual`, then through the norm."""
        if x.shape[0] > MLP_SLICE_TOKENS:
            for part, dest in zip(x.split(MLP_SLICE_TOKENS), residual.split(MLP_SLICE_TOKENS)):
                self.down_proj.add_into(self.gate_up_proj(part), dest, gated=True)
            return norm(residual), residual
        return self.down_proj.add_norm_forward(self.gate_up_proj(x), residual, norm, gated=True,
                                               residual_in_place=True)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int, qk_norm: bool, *, kernels: KernelChoice):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels=kernels)
        self.self_attn = SelfAttention(spec, layer_id, qk_norm, kernels=kernels)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels=kernels)
        self.mlp = GatedMLP(spec, kernels=kernels)
        # the rotary kernel also stores k/v into the paged cache (no index copies)
        self.write_kv_in_rotary = kernels.triton and kernels.decode_fusion

    # forward = post_attention(hidden, attention(*pre_attention(hidden))): decode with graph.mode=segmented
    # captures the two halves as CUDA graphs and runs the attention between them eagerly.
    def pre_attention(self, hidden: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm, qkv projection, q/k norm, rotary: hidden [N, hidden] -> q [N, H, D], k/v [N, KVH, D]."""
        return self.self_attn.project_qkv(self.input_layernorm(hidden), rope)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.self_attn.attn(q, k, v)  # the KV store of the step's Context: [N, H, D]

    def post_attention(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """o projection, residual, post norm, MLP, residual: -> the layer's output [N, hidden]. Reads `hidden`
        without writing it (the segmented graph runner copies the result into its static buffer)."""
        # o projection, residual add and post norm: normed = norm(o + hidden), hidden = o + hidden
        normed, hidden = self.project_out_add_norm(attn_out, hidden)
        return hidden + self.mlp(normed)

    def project_out_add_norm(self, attn_out: torch.Tensor, residual: torch.Tensor, residual_in_place: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """attn_out [N, H, D] -> (post_attention_layernorm(o + residual), o + residual), o the o projection; with
        residual_in_place the sum may be written into `residual`."""
        attn = self.self_attn
        return attn.o_proj.add_norm_forward(attn_out.reshape(attn_out.shape[0], attn.q_size), residual,
                                            self.post_attention_layernorm, residual_in_place=residual_in_place)

    def forward(self, normed: torch.Tensor, residual: torch.Tensor, rope: Rope, next_norm: nn.Module
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on its input already normed: normed = input_layernorm(residual), residual the stream, which
        this overwrites. Returns (next_norm(stream'), stream'), stream' = the layer's output, with next_norm the next
        layer's input norm (or the model's final norm). Where the skinny kernels run (decode), the same values as
        post_attention(residual, attention(*pre_attention(residual))) followed by next_norm, each norm with its
        residual add in the launch after its linear layer (sparsekv.kernels.linear_norm); on the GEMM path each
        GEMM adds into the stream in its epilogue (one rounding where the separate add rounds twice)."""
        kv_target = self.self_attn.attn.kv_write_target() if self.write_kv_in_rotary else None
        q, k, v = self.self_attn.project_qkv(normed, rope, kv_target)
        attn_out = self.self_attn.attn(q, k, v, kv_written=kv_target is not None)
        normed, residual = self.project_out_add_norm(attn_out, residual, residual_in_place=True)
        return self.mlp.add_norm_forward(normed, residual, next_norm)


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    supports_tensor_parallel = True  # built from the TensorParallel of sparsekv.distributed.state.get_tp()
    # checkpoint name -> (packed parameter, shard index) for fused projections
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, spec: ModelSpec, *, kernels: KernelChoice):
        super().__init__()
        self.spec = spec
        self.kernels = kernels
        tp = get_tp()
        self.tp_size = tp.size
        if tp.size == 1:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp=tp)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, self.qk_norm, kernels=kernels)
                                    for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels=kernels)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling, kernels=kernels)
        if tp.size == 1:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False, kernels=kernels)
        else:  # logits gathered on every rank
            self.lm_head = ParallelLMHead(spec.hidden_size, spec.vocab_size, kernels=kernels, tp=tp)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def shard_sizes(self, packed_name: str) -> list[int]:
        """Rows of each packed part in this rank's parameter (the whole model's on one GPU)."""
        spec, tp = self.spec, self.tp_size
        if packed_name == "qkv_proj":
            heads = head_shards(spec.num_attention_heads, spec.num_key_value_heads, 0, tp)
            kv = heads.num_kv_heads * spec.head_dim
            return [heads.num_heads * spec.head_dim, kv, kv]
        return [spec.intermediate_size // tp, spec.intermediate_size // tp]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Rope]:
        """input_ids, positions [N] -> hidden [N, hidden] and the Rope every layer uses (on the torch path it
        holds the cos/sin tables [N, D], built once per forward)."""
        hidden = self.embed_tokens(input_ids)
        return hidden, self.rotary(positions, hidden.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions [N] -> hidden [N, hidden]
        hidden, rope = self.embed(input_ids, positions)
        if not self.layers:
            return self.norm(hidden)
        normed = self.layers[0].input_layernorm(hidden)
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            normed, hidden = layer(normed, hidden, rope, next_norm)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [B, vocab]
