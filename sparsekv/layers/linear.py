from __future__ import annotations

import dataclasses
import functools
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from sparsekv.kernels.activation import silu_and_mul, silu_and_mul_reference
from sparsekv.distributed.sharding import Shard, vocab_rows
from sparsekv.distributed.state import TensorParallel
from sparsekv.kernels.backend import KernelChoice
from sparsekv.kernels.gemv import MAX_M, silu_mul_linear, skinny_linear
from sparsekv.kernels.linear_norm import linear_add_rms_norm


def write_into(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """y, or y copied into `out` when one is given (the paths that cannot write there directly)."""
    return y if out is None else out.copy_(y)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) whose inputs of 1..kernels.gemv_max_rows rows (decode)
    run the Triton skinny-GEMV kernel; others F.linear (cuBLAS)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, kernels: KernelChoice):
        super().__init__(in_features, out_features, bias=bias)
        self.gemv_rows = min(kernels.gemv_max_rows, MAX_M)
        self.fuse = kernels.decode_fusion and self.gemv_rows > 0  # the fusions ride on the skinny GEMV
        self.pdl = kernels.pdl
        self.silu_and_mul = (functools.partial(silu_and_mul, pdl=kernels.pdl) if kernels.triton
                             else silu_and_mul_reference)

    def _rows(self, x: torch.Tensor, width: int) -> int:
        """Input rows of x [..., width] if the skinny GEMV takes them, else 0."""
        rows = x.numel() // width if width else 0
        return rows if rows <= self.gemv_rows else 0

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # x [..., in_features] -> [..., out_features]; `out` (x 2-D): a contiguous [rows, out_features] to write into
        rows = self._rows(x, self.in_features)
        if rows:
            y = skinny_linear(x.reshape(rows, self.in_features), self.weight, self.bias, pdl=self.pdl)
            return write_into(y.view(*x.shape[:-1], self.out_features), out)  # [rows, out] as [..., out]
        if out is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)

    def silu_mul_forward(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The down projection of a gated MLP: self(silu_and_mul(gate_up)), gate_up [..., 2 * in_features] ->
        [..., out_features] (or into `out`). Where the fused skinny kernel runs, silu(gate) * up is computed as the
        kernel loads its input: one launch and no [rows, I] tensor."""
        rows = self._rows(gate_up, 2 * self.in_features) if self.fuse else 0
        if rows:
            y = silu_mul_linear(gate_up.reshape(rows, 2 * self.in_features), self.weight, self.bias, pdl=self.pdl)
            return write_into(y.view(*gate_up.shape[:-1], self.out_features), out)  # [..., out_features]
        return self(self.silu_and_mul(gate_up), out=out)

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module, gated: bool = False,
                         residual_in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(out, residual) of out = self(x) (gated: self.silu_mul_forward(x)), an RMSNorm with its residual add:
        -> (normed, out + residual), each [..., out_features]. Where the fused skinny kernel runs, the GEMV's split-K
        reduction, the add and the norm are one launch after it (sparsekv.kernels.linear_norm). Elsewhere, with
        residual_in_place (the caller owns `residual`), the GEMM adds its product into `residual` (see add_into)
        and the norm runs alone; else the add runs in the norm's kernel."""
        width = (2 if gated else 1) * self.in_features
        rows = self._rows(x, width)
        if rows and self.fuse and residual.shape == (*x.shape[:-1], self.out_features):
            normed, new_residual = linear_add_rms_norm(
                x.reshape(rows, width), self.weight, self.bias, residual.reshape(rows, self.out_features),
                norm.weight, norm.eps, gated=gated, pdl=self.pdl)
            return normed.view(residual.shape), new_residual.view(residual.shape)
        if residual_in_place and not rows:
            self.add_into(x, residual, gated)
            return norm(residual), residual
        return norm(self.silu_mul_forward(x) if gated else self(x), residual)

    def add_into(self, x: torch.Tensor, residual: torch.Tensor, gated: bool = False) -> None:
        """residual += self(x) (gated: of silu_and_mul(x)), in place: x [T, in_features] (gated: [T, 2 *
        in_features]), residual [T, out_features] contiguous. Without a bias the GEMM reads `residual` in its
        epilogue (C = A B + C, one rounding to x's dtype) instead of writing the product for a separate add to read
        back: a [T, out_features] round trip less per layer and linear (docs/decisions.md)."""
        if self.bias is not None or not residual.is_contiguous() or x.dim() != 2 \
                or residual.shape != (x.shape[0], self.out_features):
            residual.add_(self.silu_mul_forward(x) if gated else self(x))
            return
        residual.addmm_(self.silu_and_mul(x) if gated else x, self.weight.t())


# ---- tensor parallelism (sparsekv/distributed): built only when tensor_parallel_size > 1
@runtime_checkable
class ShardedParameters(Protocol):
    """A module whose parameters hold one rank's part of the checkpoint tensors (the loader reads only that part)."""

    def checkpoint_shard(self, leaf: str, index: int) -> Shard | None:
        """The part of packed shard `index` of parameter `leaf` ("weight", "bias") this rank holds; None when
        the rank holds the whole tensor."""


class ColumnParallelLinear(Linear):
    """Output features split over the ranks: each rank holds its rows of every packed part (q | k | v, gate | up),
    so the packed output stays a local [.., sum of parts] with the parts in the same order. No collective."""

    def __init__(self, in_features: int, shards: list[Shard], bias: bool = True, *, kernels: KernelChoice):
        super().__init__(in_features, sum(s.size for s in shards), bias=bias, kernels=kernels)
        self.shards = shards

    def checkpoint_shard(self, leaf: str, index: int) -> Shard | None:
        return self.shards[index]  # weight rows and bias entries alike


class RowParallelLinear(Linear):
    """Input features split over the ranks (each holds columns [start, start + in_features) of the weight); the
    partial products are summed over the ranks, then the (replicated) bias is added once."""

    def __init__(self, shard: Shard, out_features: int, bias: bool = True, *, kernels: KernelChoice,
                 tp: TensorParallel):
        """`shard`: the input features this rank holds (the matching column-parallel layer's output rows)."""
        super().__init__(shard.size, out_features, bias=bias, kernels=kernels)
        self.shard, self.tp = dataclasses.replace(shard, dim=1), tp

    def checkpoint_shard(self, leaf: str, index: int) -> Shard | None:
        return self.shard if leaf == "weight" else None

    def _reduced(self, out: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # x [..., in_features (this rank's)] -> [..., out_features], summed over the ranks (copied into `out`)
        rows = self._rows(x, self.in_features)
        if rows:
            y = skinny_linear(x.reshape(rows, self.in_features), self.weight, None, pdl=self.pdl)
            return write_into(self._reduced(y.view(*x.shape[:-1], self.out_features)), out)
        return write_into(self._reduced(F.linear(x, self.weight)), out)

    def silu_mul_forward(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = self._rows(gate_up, 2 * self.in_features) if self.fuse else 0
        if rows:
            y = silu_mul_linear(gate_up.reshape(rows, 2 * self.in_features), self.weight, None, pdl=self.pdl)
            return write_into(self._reduced(y.view(*gate_up.shape[:-1], self.out_features)), out)
        return self(self.silu_and_mul(gate_up), out=out)

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module, gated: bool = False,
                         residual_in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(out, residual) with out reduced over the ranks first (the fused linear + norm kernel would
        normalise a partial sum): the add and the norm run in one kernel after the all-reduce. `residual` is
        never written."""
        return norm(self.silu_mul_forward(x) if gated else self(x), residual)

    def add_into(self, x: torch.Tensor, residual: torch.Tensor, gated: bool = False) -> None:
        """residual += the reduced output (a partial product cannot go into the GEMM's epilogue)."""
        residual.add_(self.silu_mul_forward(x) if gated else self(x))


class ParallelLMHead(ColumnParallelLinear):
    """The LM head over a vocabulary split in `rows`-row slices: local logits, gathered on every rank into the
    whole vocabulary (every rank samples the same greedy token from the same logits)."""

    def __init__(self, in_features: int, vocab_size: int, *, kernels: KernelChoice, tp: TensorParallel):
        rows = vocab_rows(vocab_size, tp.size)
        super().__init__(in_features, [Shard(0, tp.rank * rows, rows, vocab_size)], bias=False, kernels=kernels)
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [B, hidden] -> [B, vocab]
        return self.tp.all_gather_last(super().forward(x))[..., :self.vocab_size]
