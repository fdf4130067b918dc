"""Index metadata of vertical_slash_attention's kernel: which key tiles each query block visits, and how it masks them.

vertical_slash_index(vertical_idx [H, NV], slash_offsets [H, NS], Sq, Sk, q_offset, block_m, block_n) -> SlashIndex
vertical_slash_index_reference(same arguments) -> SlashIndex: the same tensors built by torch ops (tests compare
    every field with torch.equal)

Tiles. With BLOCK_M = RATIO * BLOCK_N, query block m and key block n meet on the "block diagonal"
t = q_offset // BLOCK_N + RATIO * m - n, and the tile (m, n) covers the BLOCK_M + BLOCK_N - 1 consecutive offsets
p - j of its window [phi + (t - 1) * BLOCK_N + 1, phi + t * BLOCK_N + BLOCK_M - 1] (phi = q_offset % BLOCK_N),
which depends on t only; row i, key j of the tile sits on bit i + BLOCK_N - 1 - j of the window. Tiles are numbered
t - t_min (t_min: the smallest t of any tile), NT of them. The windows of all tiles cover every offset d_lo .. d_hi - 1
that a causally visible (query, key) pair can have. The builders first mark the selected offsets in smask [H, W]
int8 (1 where offset d_lo + i is selected, W = d_hi - d_lo, out-of-range entries ignored) and make the tensors the
kernel reads from it:
  words  [H, NT, NW] int64   the window's selection bits: bit b % 64 of word b // 64 is offset window start + b
  bounds [H, NT, 2] int32    the first selected offset >= the window's start and the last one <= its end: the
                             window's own first and last when it holds any, else the nearest ones outside it
                             (d_hi, d_lo - 1 when there are none); the kernel reads those of run tiles only
  tlists [2, H, NT] int32    ascending t - t_min of the windows holding a selected offset: [0] those whose selected
                             offsets form one run (last - first + 1 == count), [1] the others; padded with 2^30
  ranges [H, num_m, 5] int32 per query block: the range [lo, hi) of its entries in tlists[0] and in tlists[1]
                             (key blocks 0 .. n_hi, n_hi the block of the last key the block sees) and its
                             visible vertical columns, searchsorted(vidx, last key, right=True)
  vidx   [H, max(NV, 1)] int32 the columns as int32 (one sentinel when NV = 0)

The Triton builder: five launches (six when vertical_idx is not int32 with rows of unit stride), no sort, no
[H, NT, span] temporaries, no host sync:
  * a zero fill of smask and _scatter_offsets_kernel, one program per (block of entries, head);
  * _tile_bits_kernel, one program per (block of tiles, head): each window's bits -> words, its own first and last
    selected offset, and a flag (0 empty, 1 one run, 2 scattered);
  * _tile_lists_kernel, one program per head, over the tiles in blocks: a suffix minimum of the firsts and a prefix
    maximum of the lasts give the bounds of windows without a selected offset (windows are monotone and cover
    every offset), prefix sums of the flags compact the two t-lists and count the entries before each tile;
  * _query_ranges_kernel, one program per (block of query blocks, head): the list ranges from those counts, the
    vertical count by torch.searchsorted's own binary search (so equal to it on any input).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sparsekv.kernels import _dispatch
from sparsekv.kernels._dispatch import cdiv, jit, next_power_of_2, tl

__all__ = [
    "SlashIndex",
    "TileGeometry",
    "offset_range",
    "slash_mask",
    "tile_geometry",
    "vertical_slash_index",
    "vertical_slash_index_reference",
]

SENTINEL = 1 << 30
# Largest blocks: (window bits per _tile_bits_kernel program, tiles per _tile_lists_kernel step, query blocks per
# _query_ranges_kernel program, entries per _scatter_offsets_kernel program); each is cut to the power of two that
# covers the work (the interpreter scans element by element: no padding). Tests shrink them to cross blocks.
MAX_BLOCKS = (4096, 1024, 128, 1024)
_POISON = -77  # tests: metadata buffers start as garbage, so an entry a kernel forgets to write fails


class TileGeometry(NamedTuple):
    """Host-side sizes shared by the builders and the attention launcher."""
    d_lo: int  # offsets [d_lo, d_hi) of the causally visible pairs: smask's columns
    d_hi: int
    phi: int  # q_offset % block_n
    t_min: int  # smallest block diagonal; tiles and list entries are t - t_min
    num_t: int  # NT
    t0: int  # t - t_min of the tile (query block 0, key block 0); query block m's is t0 + RATIO * m
    num_m: int  # query blocks
    block_m: int
    block_n: int


class SlashIndex(NamedTuple):
    """What _vs_fwd_kernel reads (module docstring)."""
    words: torch.Tensor  # [H, NT, NW] int64
    bounds: torch.Tensor  # [H, NT, 2] int32
    tlists: torch.Tensor  # [2, H, NT] int32
    ranges: torch.Tensor  # [H, num_m, 5] int32
    vidx: torch.Tensor  # [H, max(NV, 1)] int32
    geometry: TileGeometry


def offset_range(Sq: int, Sk: int, q_offset: int) -> tuple[int, int]:
    """[d_lo, d_hi): the offsets p - j that any causally visible (query, key) pair can have."""
    return max(0, q_offset - Sk + 1), q_offset + Sq


def tile_geometry(Sq: int, Sk: int, q_offset: int, block_m: int, block_n: int) -> TileGeometry:
    ratio = block_m // block_n
    num_m, num_n = cdiv(Sq, block_m), cdiv(Sk, block_n)
    d_lo, d_hi = offset_range(Sq, Sk, q_offset)
    qb, phi = divmod(q_offset, block_n)
    t_min = qb - (num_n - 1)
    return TileGeometry(d_lo, d_hi, phi, t_min, ratio * (num_m - 1) + num_n, num_n - 1, num_m, block_m, block_n)


def slash_mask(slash_offsets: torch.Tensor, d_lo: int, d_hi: int) -> torch.Tensor:
    """Dense [H, d_hi - d_lo] int8: 1 where offset d_lo + i is selected (out-of-range entries ignored)."""
    H = slash_offsets.shape[0]
    width = d_hi - d_lo
    s = slash_offsets.long()
    idx = torch.where((s >= d_lo) & (s < d_hi), s - d_lo, width)
    mask = torch.zeros((H, width + 1), dtype=torch.int8, device=s.device)
    mask.scatter_(1, idx, 1)
    return mask[:, :width].contiguous()


# ---------------------------------------------------------------------------------------- Triton kernels
@jit
def _min_op(a, b):
    return tl.minimum(a, b)


@jit
def _max_op(a, b):
    return tl.maximum(a, b)


@jit
def _scatter_offsets_kernel(SOFF, SMASK, stride_sh, stride_sn, stride_mh, NS, d_lo, d_hi, BLOCK: tl.constexpr):
    # smask[h, s - d_lo] = 1 for the entries s of slash_offsets[h] in [d_lo, d_hi) (smask zeroed by the launcher)
    head = tl.program_id(1)
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] entries
    s = tl.load(SOFF + head.to(tl.int64) * stride_sh + e.to(tl.int64) * stride_sn, mask=e < NS, other=0).to(tl.int64)
    ok = (e < NS) & (s >= d_lo) & (s < d_hi)
    tl.store(SMASK + head.to(tl.int64) * stride_mh + (s - d_lo), tl.full([BLOCK], 1, tl.int8), mask=ok)


@jit
def _tile_bits_kernel(
    SMASK, WORDS, BOUNDS, FLAGS, stride_mh, stride_wh, stride_bh, stride_fh,
    W, NT, start0, d_lo, BLOCK_N,
    WIDTH: tl.constexpr, NUM_WORDS: tl.constexpr, WORDS_P2: tl.constexpr, TILES: tl.constexpr,
):
    head = tl.program_id(1)
    tr = tl.program_id(0) * TILES + tl.arange(0, TILES)  # [TILES] tiles t - t_min
    t_ok = tr < NT
    b = tl.arange(0, 64 * WORDS_P2)  # [SPAN] bits of the window
    idx = (start0 + tr * BLOCK_N)[:, None] + b[None, :]  # [TILES, SPAN] column of smask (may be out of range)
    valid = t_ok[:, None] & (b < WIDTH)[None, :] & (idx >= 0) & (idx < W)
    sel = tl.load(SMASK + head.to(tl.int64) * stride_mh + idx, mask=valid, other=0) != 0  # [TILES, SPAN]
    count = tl.sum(sel.to(tl.int32), axis=1)  # [TILES]
    first = tl.min(tl.where(sel, idx, W), axis=1)  # W when none
    last = tl.max(tl.where(sel, idx, -1), axis=1)  # -1 when none
    flag = tl.where(count > 0, tl.where(last - first + 1 == count, 1, 2), 0)
    # 1 << 63 wraps to the sign bit: the sum of distinct powers of two stays exact
    weighted = sel.to(tl.int64) << (b % 64).to(tl.int64)[None, :]
    words = tl.sum(tl.reshape(weighted, [TILES, WORDS_P2, 64]), axis=2)  # [TILES, WORDS_P2]
    w = tl.arange(0, WORDS_P2)
    tl.store(WORDS + head.to(tl.int64) * stride_wh + tr[:, None] * NUM_WORDS + w[None, :], words,
             mask=t_ok[:, None] & (w < NUM_WORDS)[None, :])
    bounds = BOUNDS + head.to(tl.int64) * stride_bh + 2 * tr
    tl.store(bounds, first + d_lo, mask=t_ok)
    tl.store(bounds + 1, last + d_lo, mask=t_ok)
    tl.store(FLAGS + head.to(tl.int64) * stride_fh + tr, flag.to(tl.int8), mask=t_ok)


@jit
def _tile_lists_kernel(
    BOUNDS, FLAGS, TLISTS, COUNTS, stride_bh, stride_fh, stride_tl, stride_th, stride_cl, stride_ch,
    NT, num_blocks, d_lo, d_hi, SENTINEL_VALUE: tl.constexpr, BLOCK: tl.constexpr,
):
    head = tl.program_id(0)
    bounds = BOUNDS + head.to(tl.int64) * stride_bh  # [NT, 2]: the windows' own first / last selected offsets
    flags = FLAGS + head.to(tl.int64) * stride_fh  # [NT]
    run_list = TLISTS + head.to(tl.int64) * stride_th  # [NT]; the scattered tiles' list is stride_tl further
    run_count = COUNTS + head.to(tl.int64) * stride_ch  # [NT + 1]: list entries before each tile
    offs = tl.arange(0, BLOCK)
    zeros = tl.zeros([BLOCK], dtype=tl.int32)  # (loop-carried values are kept as vectors of one value)
    # first selected offset >= each window's start: suffix minimum over the tiles, from the last block back
    carry = zeros + d_hi
    for i in range(num_blocks):
        tr = (num_blocks - 1 - i) * BLOCK + offs
        first = tl.load(bounds + 2 * tr, mask=tr < NT, other=d_hi)
        first = tl.minimum(tl.associative_scan(first, 0, _min_op, reverse=True), carry)
        tl.store(bounds + 2 * tr, first, mask=tr < NT)
        carry = zeros + tl.min(first, 0)
    # last selected offset <= each window's end: prefix maximum; the two lists by prefix sums of the flags
    carry = zeros + (d_lo - 1)
    n_run = zeros
    n_part = zeros
    for i in range(num_blocks):
        tr = i * BLOCK + offs
        ok = tr < NT
        last = tl.load(bounds + 2 * tr + 1, mask=ok, other=d_lo - 1)
        last = tl.maximum(tl.associative_scan(last, 0, _max_op), carry)
        tl.store(bounds + 2 * tr + 1, last, mask=ok)
        carry = zeros + tl.max(last, 0)
        flag = tl.load(flags + tr, mask=ok, other=0)
        is_run = (flag == 1).to(tl.int32)
        is_part = (flag == 2).to(tl.int32)
        run_before = n_run + tl.cumsum(is_run, 0) - is_run  # [BLOCK] entries of the list before tile tr
        part_before = n_part + tl.cumsum(is_part, 0) - is_part
        tl.store(run_list + run_before, tr, mask=is_run != 0)
        tl.store(run_list + stride_tl + part_before, tr, mask=is_part != 0)
        tl.store(run_count + tr, run_before, mask=ok)
        tl.store(run_count + stride_cl + tr, part_before, mask=ok)
        n_run += tl.sum(is_run, 0)
        n_part += tl.sum(is_part, 0)
    tl.store(run_count + NT + offs, n_run, mask=offs == 0)
    tl.store(run_count + stride_cl + NT + offs, n_part, mask=offs == 0)
    for i in range(num_blocks):  # padding after each list's entries
        tr = i * BLOCK + offs
        tl.store(run_list + tr, zeros + SENTINEL_VALUE, mask=(tr < NT) & (tr >= n_run))
        tl.store(run_list + stride_tl + tr, zeros + SENTINEL_VALUE, mask=(tr < NT) & (tr >= n_part))


@jit
def _query_ranges_kernel(
    COUNTS, VIDX, RANGES, stride_cl, stride_ch, stride_vh, stride_rh, stride_rm,
    num_m, NV, search_steps, Sq, Sk, q_offset, t0,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RATIO: tl.constexpr, BLOCK: tl.constexpr,
):
    head = tl.program_id(1)
    mb = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] query blocks
    ok = mb < num_m
    key_last = tl.minimum(tl.minimum(q_offset + (mb + 1) * BLOCK_M - 1, q_offset + Sq - 1), Sk - 1)
    t_last = t0 + RATIO * mb  # the block's tile with key block 0
    t_first = t_last - key_last // BLOCK_N  # ... and with key block n_hi
    counts = COUNTS + head.to(tl.int64) * stride_ch  # [2, NT + 1]
    out = RANGES + head.to(tl.int64) * stride_rh + mb * stride_rm  # [BLOCK, 5]
    for i in tl.static_range(2):
        tl.store(out + 2 * i, tl.load(counts + i * stride_cl + t_first, mask=ok, other=0), mask=ok)
        tl.store(out + 2 * i + 1, tl.load(counts + i * stride_cl + t_last + 1, mask=ok, other=0), mask=ok)
    # columns <= key_last: torch.searchsorted(right=True)'s steps (start + ((end - start) >> 1); go right unless
    # vidx[mid] > key_last), so the count equals torch's even where vidx is not sorted
    vidx = VIDX + head.to(tl.int64) * stride_vh
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = lo + NV
    for _ in range(search_steps):
        active = ok & (lo < hi)
        mid = lo + ((hi - lo) >> 1)
        right = tl.load(vidx + mid, mask=active, other=0) <= key_last
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    tl.store(out + 4, lo, mask=ok)


# ---------------------------------------------------------------------------------------------- builders
def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if _dispatch.POISON_OUTPUTS:
        return torch.full(shape, _POISON, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _vertical_ints(vertical_idx: torch.Tensor) -> torch.Tensor:
    """The columns as the kernel reads them: int32 rows of unit stride (as they are when they already are)."""
    H, NV = vertical_idx.shape
    if NV == 0:
        return torch.full((H, 1), SENTINEL, dtype=torch.int32, device=vertical_idx.device)
    if vertical_idx.dtype == torch.int32 and vertical_idx.stride(1) == 1:
        return vertical_idx
    return vertical_idx.to(torch.int32).contiguous()


def vertical_slash_index(
    vertical_idx: torch.Tensor, slash_offsets: torch.Tensor, Sq: int, Sk: int, q_offset: int,
    block_m: int, block_n: int,
) -> SlashIndex:
    """The kernel's metadata (module docstring) by four Triton kernels and a zero fill; Sq, Sk >= 1,
    block_m a multiple of block_n."""
    g = tile_geometry(Sq, Sk, q_offset, block_m, block_n)
    H, NS = slash_offsets.shape
    dev = slash_offsets.device
    NT, W = g.num_t, g.d_hi - g.d_lo
    bits, list_block, range_block, scatter_block = MAX_BLOCKS

    smask = torch.zeros((H, W), dtype=torch.int8, device=dev)
    if NS > 0:
        block = min(scatter_block, next_power_of_2(NS))
        _scatter_offsets_kernel[(cdiv(NS, block), H)](
            slash_offsets, smask, *slash_offsets.stride(), smask.stride(0), NS, g.d_lo, g.d_hi, BLOCK=block)

    width = block_m + block_n - 1
    num_words = cdiv(width, 64)
    words_p2 = next_power_of_2(num_words)
    words = _alloc((H, NT, num_words), torch.int64, dev)
    bounds = _alloc((H, NT, 2), torch.int32, dev)
    flags = _alloc((H, NT), torch.int8, dev)
    tiles = min(max(1, bits // (64 * words_p2)), next_power_of_2(NT))
    _tile_bits_kernel[(cdiv(NT, tiles), H)](
        smask, words, bounds, flags, smask.stride(0), words.stride(0), bounds.stride(0), flags.stride(0),
        W, NT, g.phi + (g.t_min - 1) * block_n + 1 - g.d_lo, g.d_lo, block_n,
        WIDTH=width, NUM_WORDS=num_words, WORDS_P2=words_p2, TILES=tiles)

    tlists = _alloc((2, H, NT), torch.int32, dev)
    counts = _alloc((2, H, NT + 1), torch.int32, dev)
    list_block = min(list_block, next_power_of_2(NT))
    _tile_lists_kernel[(H,)](
        bounds, flags, tlists, counts, bounds.stride(0), flags.stride(0), *tlists.stride()[:2], *counts.stride()[:2],
        NT, cdiv(NT, list_block), g.d_lo, g.d_hi, SENTINEL_VALUE=SENTINEL, BLOCK=list_block)

    NV = vertical_idx.shape[1]
    vidx = _vertical_ints(vertical_idx)
    ranges = _alloc((H, g.num_m, 5), torch.int32, dev)
    range_block = min(range_block, next_power_of_2(g.num_m))
    _query_ranges_kernel[(cdiv(g.num_m, range_block), H)](
        counts, vidx, ranges, *counts.stride()[:2], vidx.stride(0), ranges.stride(0), ranges.stride(1),
        g.num_m, NV, NV.bit_length() + 1, Sq, Sk, q_offset, g.t0,
        BLOCK_M=block_m, BLOCK_N=block_n, RATIO=block_m // block_n, BLOCK=range_block)
    return SlashIndex(words, bounds, tlists, ranges, vidx, g)


# ----------------------------------------------------------------------------------------- torch reference
def _window_words(smask: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor:
    """smask [H, W] int8 per-offset selection, starts [NT] (index into smask of each tile's first offset, may lie
    outside [0, W)) -> [H, NT, ceil(width / 64)] int64: bit b of word b // 64 is smask[h, starts + b] (0 outside)."""
    H, W = smask.shape
    span = 64 * cdiv(width, 64)
    bits = starts[:, None] + torch.arange(span, device=smask.device)[None, :]  # [NT, span]
    valid = (bits >= 0) & (bits < W) & (torch.arange(span, device=smask.device) < width)[None, :]
    picked = smask[:, bits.clamp(0, max(W - 1, 0))].to(torch.int64) * valid  # [H, NT, span]
    weights = torch.ones(64, dtype=torch.int64, device=smask.device).bitwise_left_shift(
        torch.arange(64, device=smask.device))  # 1 << b; 1 << 63 is negative, the sum stays exact (no overflow)
    return (picked.view(H, bits.shape[0], -1, 64) * weights).sum(-1).contiguous()


def _selected_bounds(smask: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """smask [H, W] int8, windows [lo, hi) [NT] of indices into it -> (first, last) [H, NT] int64: the first and the
    last selected index of each window (first > last when none is)."""
    H, W = smask.shape
    idx = torch.arange(W, device=smask.device).expand(H, -1)
    selected = smask != 0
    edge = torch.full((H, 1), W, dtype=torch.int64, device=smask.device)
    nxt = torch.cat([torch.where(selected, idx, W).flip(1).cummin(1).values.flip(1), edge], dim=1)  # [H, W+1]: >= i
    prv = torch.cat([edge * 0 - 1, torch.where(selected, idx, -1).cummax(1).values], dim=1)  # [H, W+1]: <= i - 1
    return nxt[:, lo], prv[:, hi]


def vertical_slash_index_reference(
    vertical_idx: torch.Tensor, slash_offsets: torch.Tensor, Sq: int, Sk: int, q_offset: int,
    block_m: int, block_n: int,
) -> SlashIndex:
    """The same metadata by torch ops (the launcher's former construction; ~100 small kernels)."""
    g = tile_geometry(Sq, Sk, q_offset, block_m, block_n)
    H = slash_offsets.shape[0]
    dev = slash_offsets.device
    ratio = block_m // block_n
    d_lo, d_hi, phi = g.d_lo, g.d_hi, g.phi

    # per-offset selection mask and its prefix counts
    smask = slash_mask(slash_offsets, d_lo, d_hi)  # [H, W] int8
    cs = torch.nn.functional.pad(smask.to(torch.int32).cumsum(1, dtype=torch.int32), (1, 0))  # [H, W+1]

    # block diagonals t; the tile (m, n) covers offsets [phi + (t-1)*BN + 1, phi + t*BN + BM - 1]
    t = torch.arange(g.t_min, g.t_min + g.num_t, device=dev)
    lo = torch.clamp(phi + (t - 1) * block_n + 1, min=d_lo)
    hi = torch.clamp(phi + t * block_n + block_m, max=d_hi)  # exclusive
    lo_i = (lo - d_lo).clamp(0, d_hi - d_lo)
    hi_i = torch.maximum(lo_i, (hi - d_lo).clamp(0, d_hi - d_lo))
    count = cs[:, hi_i] - cs[:, lo_i]  # [H, NT] selected offsets in each tile's window
    words = _window_words(smask, phi + (t - 1) * block_n + 1 - d_lo, block_m + block_n - 1)  # [H, NT, words]
    first, last = _selected_bounds(smask, lo_i, hi_i)  # [H, NT] indices into smask
    bounds = torch.stack([first + d_lo, last + d_lo], dim=2).to(torch.int32).contiguous()  # [H, NT, 2] offsets
    needed = count > 0
    run = last - first + 1 == count
    t_rel = (t - g.t_min).to(torch.int32)[None, :]
    sentinel = torch.full_like(t_rel, SENTINEL)
    tlists = torch.stack([torch.where(needed & run, t_rel, sentinel),
                          torch.where(needed & ~run, t_rel, sentinel)]).sort(dim=2).values.contiguous()

    # per query block: its range of t in each list (key blocks 0..n_hi visible) and its visible columns
    mb = torch.arange(g.num_m, device=dev)
    p_last = torch.clamp(q_offset + (mb + 1) * block_m - 1, max=q_offset + Sq - 1)
    key_last = torch.clamp(p_last, max=Sk - 1)  # last key any row of the block may see
    tq = g.t0 + ratio * mb
    n_hi = key_last // block_n
    t_first = (tq - n_hi).to(torch.int32)[None, :].expand(H, -1).contiguous()
    t_last = tq.to(torch.int32)[None, :].expand(H, -1).contiguous()
    ranges = torch.zeros((H, g.num_m, 5), dtype=torch.int32, device=dev)
    for i in range(2):
        ranges[:, :, 2 * i] = torch.searchsorted(tlists[i], t_first, right=False)
        ranges[:, :, 2 * i + 1] = torch.searchsorted(tlists[i], t_last, right=True)
    if vertical_idx.shape[1] > 0:
        ranges[:, :, 4] = torch.searchsorted(vertical_idx.to(torch.int32).contiguous(),
                                             key_last.to(torch.int32)[None, :].expand(H, -1).contiguous(), right=True)
    return SlashIndex(words, bounds, tlists, ranges, _vertical_ints(vertical_idx), g)
