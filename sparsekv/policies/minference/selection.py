"""Selection helpers of the MInference policy (policy.py beside this file): top-k over long rows, the k-th value
of running top-k, diagonal masses per band or granule, and the compaction of selection masks into the sorted,
sentinel-padded index lists vertical_slash_attention reads."""
from __future__ import annotations

import torch

SENTINEL = 1 << 30  # pads ragged per-head index lists (ignored by the kernel: out of range)
_INF = float("inf")


def band_sums(diag: torch.Tensor, band: int) -> torch.Tensor:
    """diag [h, W] per-offset masses -> [h, ceil(W / band)]: the sum over offsets band*b .. band*b + band - 1."""
    h, W = diag.shape
    nb = -(-W // band)
    return torch.nn.functional.pad(diag, (0, nb * band - W)).view(h, nb, band).sum(-1)


def band_offsets(bands: torch.Tensor, band: int) -> torch.Tensor:
    """bands [h, nb] sorted band indices -> [h, nb * band] int32 sorted offsets of those bands."""
    offsets = bands[:, :, None] * band + torch.arange(band, device=bands.device)  # [h, nb, band]
    return offsets.flatten(1).to(torch.int32)


def top_indices(x: torch.Tensor, k: int, segment: int = 16) -> torch.Tensor:
    """Indices [h, k] (unsorted) of the k largest entries of each row of x [h, W], as torch.topk (ties may pick
    other indices). Long rows go through segment maxima: an entry of the top k lies in a segment whose maximum is
    among the k largest segment maxima (else k other segments each hold a larger entry), so a top-k over those
    k segments' k * segment entries finds them; two small top-k instead of one over the whole row."""
    h, W = x.shape
    if not segment or W < 4 * k * segment:
        return torch.topk(x, k, dim=1, sorted=False).indices
    if W % segment:
        x = torch.nn.functional.pad(x, (0, segment - W % segment), value=-_INF)
        W = x.shape[1]
    seg_max = x.view(h, W // segment, segment).amax(-1)  # [h, W / segment]
    segs = torch.topk(seg_max, k, dim=1, sorted=False).indices  # [h, k]
    cand = (segs[:, :, None] * segment + torch.arange(segment, device=x.device)).flatten(1)  # [h, k * segment]
    pick = torch.topk(x.gather(1, cand), k, dim=1, sorted=False).indices
    return cand.gather(1, pick)


def add_to_granules(masses: torch.Tensor, diag: torch.Tensor, d0: int, g: int) -> None:
    """masses [h, NG] per granule of g offsets += diag [h, w], the masses of offsets d0 .. d0 + w - 1."""
    left = d0 % g
    sums = band_sums(torch.nn.functional.pad(diag, (left, 0)), g) if g > 1 else diag
    masses[:, d0 // g:d0 // g + sums.shape[1]] += sums


def offsets_kept(kept: torch.Tensor, e0: int, e1: int, g: int) -> torch.Tensor:
    """kept [h, NG] bool per granule -> [h, e1 - e0] bool per offset e0 .. e1 - 1."""
    if g == 1:
        return kept[:, e0:e1]
    return kept[:, torch.arange(e0, e1, device=kept.device) // g]


def top_values(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest values per row [h, k] in no particular order (unsorted top-k: k runs to thousands), padded with
    -inf when a row has fewer."""
    if x.shape[1] < k:
        x = torch.nn.functional.pad(x, (0, k - x.shape[1]), value=-_INF)
    return torch.topk(x, k, dim=1, sorted=False).values


def kth_value(top: torch.Tensor, k: int) -> torch.Tensor:
    """[h, 1] threshold: the k-th largest value, the least of top_values' k (+inf when k == 0: nothing but forced
    entries is kept)."""
    if k == 0:
        return torch.full((top.shape[0], 1), _INF, device=top.device)
    return top.amin(dim=1, keepdim=True)


def compact(selected: torch.Tensor, base: int) -> torch.Tensor:
    """selected [h, W] bool -> [h, W] int32 sorted positions base + j of the selected entries, padded with
    an out-of-range sentinel (the kernel ignores it); a prefix sum and a scatter, no sort."""
    h, W = selected.shape
    slot = torch.where(selected, selected.cumsum(1) - 1, W)  # [h, W]: where each selected entry goes
    out = torch.full((h, W + 1), SENTINEL, dtype=torch.int32, device=selected.device)
    positions = torch.arange(base, base + W, dtype=torch.int32, device=selected.device)
    out.scatter_(1, slot, positions.expand(h, -1))
    return out[:, :W]
