"""GPU micro-benchmarks of the kernels:
``python tools/bench_kernels.py [--quick] [--elementwise] [--decode] [--gemv] [--rotary-sweep]``.

Times every applicable attention backend (triton, sdpa, cudnn, flash_attn) on prefill/chunk shapes and
the paged decode kernel over context lengths and split counts, so that the CUDA default of
sparsekv.kernels.backend.resolve_kernels and the module constants can be chosen by measurement; and the fused
elementwise kernels (RMSNorm, q/k norm + rotary, SiLU-and-mul) against the torch ops they replace.
``--decode`` times only the decode-shaped attention (Sq = 1): the flash-decoding kernel of decode_attention.py
against the prefill kernel it replaced, the paged decode kernel, and both over candidate tuning constants.
``--gemv`` times only the skinny linear of decode (gemv.skinny_linear against F.linear, M <= 16) and sweeps its
config table (``--quick``: the sweep at M = 1 and 16 only). ``--rotary-sweep`` times apply_rotary's prefill tiling
over candidate PREFILL_TILE values against its decode tiling.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import time

import torch

from sparsekv.kernels import attention as A
from sparsekv.kernels import decode_attention as DA
from sparsekv.kernels import paged_attention as P
from sparsekv.kernels._dispatch import cdiv, has_flash_attn
from sparsekv.kernels.external_attention import flash_attn_package, torch_fused_attention


def _bench_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep)


def _causal_pairs(sq: int, sk: int) -> int:
    """Number of visible (query, key) pairs under bottom-right causal masking."""
    off = sk - sq
    return sum(max(0, min(sk, i + off + 1)) for i in range(sq))


def bench_attention(sq: int, sk: int, causal: bool, h: int = 32, kvh: int = 8, d: int = 128,
                    dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    q = torch.randn(sq, h, d, device="cuda", dtype=dtype)  # [Sq, H, D]
    k = torch.randn(sk, kvh, d, device="cuda", dtype=dtype)  # [Sk, KVH, D]
    v = torch.randn(sk, kvh, d, device="cuda", dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    pairs = _causal_pairs(sq, sk) if causal else sq * sk
    flops = 4.0 * pairs * h * d
    impls = {"triton": functools.partial(A._flash_attn_triton, pdl=False)}
    if not causal or sq == sk:
        impls["sdpa"] = functools.partial(torch_fused_attention, backend="sdpa")
        if hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
            impls["cudnn"] = functools.partial(torch_fused_attention, backend="cudnn")
    if has_flash_attn():
        impls["flash_attn"] = flash_attn_package
    res = {}
    for name, fn in impls.items():
        ms = _bench_ms(lambda: fn(q, k, v, scale, causal))
        res[name] = ms
        print(f"attn  Sq={sq:6d} Sk={sk:6d} causal={causal!s:5} D={d:3d} {name:10s} "
              f"{ms * 1e3:9.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
    return res


def _paged_inputs(lens: list[int], h: int, kvh: int, d: int, block_size: int, dtype: torch.dtype):
    """q [B, H, D], caches [num_blocks, block_size, KVH, D] and shuffled block tables for sequences of `lens`."""
    b = len(lens)
    used = [-(-n // block_size) for n in lens]
    k_cache = torch.randn(sum(used) + 1, block_size, kvh, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.zeros(b, max(used), dtype=torch.int32, device="cuda")
    perm = torch.randperm(sum(used), device="cuda").int()
    start = 0
    for i, n in enumerate(used):
        tables[i, :n] = perm[start:start + n]
        start += n
    q = torch.randn(b, h, d, device="cuda", dtype=dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, tables, lens_t


def bench_paged(lens: list[int], h: int = 32, kvh: int = 8, d: int = 128, block_size: int = 16,
                num_splits: int | None = None, dtype: torch.dtype = torch.bfloat16) -> float:
    b = len(lens)
    q, k_cache, v_cache, tables, lens_t = _paged_inputs(lens, h, kvh, d, block_size, dtype)
    max_len = max(lens)
    ms = _bench_ms(lambda: P.paged_decode_attention(
        q, k_cache, v_cache, tables, lens_t, max_context_len=max_len, num_splits=num_splits))
    splits = num_splits or P.choose_num_splits(b, kvh, max_len, q.device)
    gbytes = 2 * sum(lens) * kvh * d * k_cache.element_size() / 1e9
    print(f"paged B={b:3d} max_ctx={max_len:7d} splits={splits:3d} {ms * 1e3:9.1f} us  "
          f"{gbytes / ms * 1e3:6.0f} GB/s", flush=True)
    return ms


# ---------------------------------------------------------------------------------------------- decode (--decode)
# Candidate tuning constants, applied by overriding the kernel modules' globals (read at each launch). Tile
# settings (each a recompile) are swept at the default split heuristic, split settings at the default tile.
TILE_CANDIDATES = [dict(BLOCK_N=n, NUM_WARPS=w) for n in (32, 64, 128) for w in (4, 8)] + [
    dict(NUM_STAGES=2), dict(NUM_STAGES=4)]
SPLIT_CANDIDATES = [dict(MIN_SPLIT_TOKENS=m, PROGRAMS_PER_SM=p) for m in (64, 128, 256) for p in (2, 4, 8)]
TUNABLE = ("BLOCK_N", "NUM_WARPS", "NUM_STAGES", "MIN_SPLIT_TOKENS", "PROGRAMS_PER_SM")


@contextlib.contextmanager
def override_constants(module, **values):
    """Set module-level tuning constants for the duration of the block. An explicit BLOCK_N also lifts the
    KV_TILE_BYTES cap (sized for fp32 rows of D = 256), so that the asked-for tile is the one that runs."""
    if "BLOCK_N" in values and hasattr(module, "KV_TILE_BYTES"):
        values.setdefault("KV_TILE_BYTES", max(module.KV_TILE_BYTES, values["BLOCK_N"] * 256 * 4))
    saved = {name: getattr(module, name) for name in values}
    try:
        for name, value in values.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _call_us(fn, calls: int = 200) -> float:
    """Wall time per call of back-to-back calls (no cache flush): launch-bound when the kernels are short, as
    eager offloaded decode is."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _settings(module) -> str:
    return " ".join(f"{name}={getattr(module, name):<4d}" for name in TUNABLE)


def _tuning_table(label: str, module, length: int, nbytes: int, fn, splits_fn) -> None:
    """Time fn() under each candidate setting of module's constants; the first row is the defaults."""
    rows = []
    for values in [{}] + TILE_CANDIDATES + SPLIT_CANDIDATES:
        with override_constants(module, **values):
            try:
                ms = _bench_ms(fn, warmup=10, rep=40)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report the row and go on
                print(f"  {label} len={length:6d} {_settings(module)} failed: {type(exc).__name__}: {exc}"[:200],
                      flush=True)
                continue
            rows.append((ms, f"{_settings(module)} splits={splits_fn():3d}", not values))
    best = min(ms for ms, _, _ in rows)
    for ms, text, default in rows:
        mark = ("default " if default else "") + ("<- best" if ms == best else "")
        print(f"  {label} len={length:6d} {text} {ms * 1e3:8.1f} us {nbytes / ms / 1e6:6.0f} GB/s  {mark}",
              flush=True)


def bench_decode(sks=(256, 1024, 4096, 16384), tune_sks=(1024, 4096, 16384), h: int = 32, kvh: int = 8,
                 d: int = 128, dtype: torch.dtype = torch.bfloat16) -> dict[int, tuple[float, float]]:
    """Sq = 1 over contiguous K/V: the flash-decoding kernel vs the prefill kernel path it replaced
    (_flash_attn_triton with the small-Sq dispatch switched off). {Sk: (decode_ms, prefill_ms)}."""
    scale = 1.0 / math.sqrt(d)
    res = {}
    for sk in sks:
        q = torch.randn(1, h, d, device="cuda", dtype=dtype)  # [1, H, D]
        k = torch.randn(sk, kvh, d, device="cuda", dtype=dtype)  # [Sk, KVH, D]
        v = torch.randn(sk, kvh, d, device="cuda", dtype=dtype)
        nbytes = 2 * sk * kvh * d * k.element_size()

        def new():
            return DA.decode_attention_triton(q, k, v, scale, False)

        def old():
            with override_constants(A, DECODE_MAX_SQ=0):
                return A._flash_attn_triton(q, k, v, scale, False, False)

        (o_new, lse_new), (o_old, lse_old) = new(), old()
        diff = max((o_new.float() - o_old.float()).abs().max().item(), (lse_new - lse_old).abs().max().item())
        new_ms = _bench_ms(new)
        old_ms = _bench_ms(old)
        splits = DA.launch_plan(1, h, kvh, sk, d, k.element_size(), q.device)[3]
        res[sk] = (new_ms, old_ms)
        print(f"decode Sq=1 Sk={sk:6d} H={h} KVH={kvh} D={d}  flash-decoding {new_ms * 1e3:7.1f} us "
              f"{nbytes / new_ms / 1e6:6.0f} GB/s (splits={splits:3d})  prefill kernel {old_ms * 1e3:7.1f} us "
              f"{nbytes / old_ms / 1e6:6.0f} GB/s  speed-up {old_ms / new_ms:5.1f}x  max|diff| {diff:.1e}  "
              f"back-to-back wall/call: {_call_us(new):5.1f} vs {_call_us(old):5.1f} us", flush=True)
        if sk in tune_sks:
            _tuning_table("decode-tune", DA, sk, nbytes, new,
                          lambda: DA.launch_plan(1, h, kvh, sk, d, k.element_size(), q.device)[3])
    return res


def bench_paged_decode(contexts=(4096, 32768), block_size: int = 256, h: int = 32, kvh: int = 8, d: int = 128,
                       dtype: torch.dtype = torch.bfloat16) -> dict[int, float]:
    """paged_decode_attention, batch 1, over candidate tuning constants. {context: default ms}."""
    res = {}
    for ctx in contexts:
        q, k_cache, v_cache, tables, lens_t = _paged_inputs([ctx], h, kvh, d, block_size, dtype)
        nbytes = 2 * ctx * kvh * d * k_cache.element_size()

        def fn():
            return P.paged_decode_attention(q, k_cache, v_cache, tables, lens_t, max_context_len=ctx)

        def splits() -> int:
            block_n = max(16, min(P.BLOCK_N, P.KV_TILE_BYTES // (d * k_cache.element_size())))
            asked = P.choose_num_splits(1, kvh, ctx, q.device)
            return cdiv(ctx, cdiv(cdiv(ctx, asked), block_n) * block_n)

        res[ctx] = _bench_ms(fn)
        print(f"paged decode B=1 ctx={ctx:6d} block_size={block_size} splits={splits():3d} {res[ctx] * 1e3:7.1f} us "
              f"{nbytes / res[ctx] / 1e6:6.0f} GB/s", flush=True)
        _tuning_table("paged-tune", P, ctx, nbytes, fn, splits)
    return res


def _rotary_inputs(tokens: int, h: int, kvh: int, d: int, dtype: torch.dtype, device: str):
    """apply_rotary's inputs at `tokens` rows: q [T, H, D], k views of one qkv projection, a KVWrite of its v into
    [blocks, 256, KVH, D] zeroed caches at slots 0..T-1, inv_freq (theta 1e6) and q/k norm weights."""
    from sparsekv.kernels.rotary import KVWrite
    from sparsekv.layers.rotary import rope_inv_freq

    qkv = torch.randn(tokens, (h + 2 * kvh) * d, device=device, dtype=dtype)
    q, k = qkv[:, :h * d].view(tokens, h, d), qkv[:, h * d:(h + kvh) * d].view(tokens, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(tokens, kvh, d)
    caches = (torch.zeros(cdiv(tokens, 256), 256, kvh, d, device=device, dtype=dtype) for _ in range(2))
    kv = KVWrite(v, *caches, torch.arange(tokens, device=device))
    inv_freq = rope_inv_freq(d, 1e6, None)[0].to(device)
    qw, kw = torch.randn(d, device=device, dtype=dtype), torch.randn(d, device=device, dtype=dtype)
    return q, k, kv, inv_freq, qw, kw


def bench_elementwise(tokens: int, hidden: int = 2560, h: int = 32, kvh: int = 8, d: int = 128, inter: int = 9728,
                      dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> dict[str, tuple[float, float]]:
    """The fused elementwise kernels against their torch references (the model's unfused ops) at Qwen3-4B shapes
    for `tokens` rows: {op: (fused_ms, reference_ms)}. The rotary reference includes building the cos/sin tables,
    which the torch path of the model does once per forward rather than per layer."""
    from sparsekv.kernels.activation import silu_and_mul, silu_and_mul_reference
    from sparsekv.kernels.rmsnorm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
    from sparsekv.kernels.rotary import apply_rotary, apply_rotary_reference

    eps = 1e-6
    x, r = (torch.randn(tokens, hidden, device=device, dtype=dtype) for _ in range(2))
    w = torch.randn(hidden, device=device, dtype=dtype)
    q, k, kv, inv_freq, qw, kw = _rotary_inputs(tokens, h, kvh, d, dtype, device)
    positions = torch.arange(tokens, device=device) + 1000
    gate_up = torch.randn(tokens, 2 * inter, device=device, dtype=dtype)
    size = x.element_size()

    def rotary_kv_write_reference():
        out = apply_rotary_reference(q, k, positions, inv_freq, 1.0, qw, kw, eps)
        kv.k_cache.view(-1, kvh, d)[kv.slot_mapping] = out[1]
        kv.v_cache.view(-1, kvh, d)[kv.slot_mapping] = kv.v
        return out

    cases = {  # op: (fused, reference, bytes the fused kernel moves)
        "rms_norm": (lambda: rms_norm(x, w, eps), lambda: rms_norm_reference(x, w, eps), 2 * x.nbytes),
        "add_rms_norm": (lambda: add_rms_norm(x, r, w, eps), lambda: add_rms_norm_reference(x, r, w, eps),
                         4 * x.nbytes),
        "qk_norm_rotary": (lambda: apply_rotary(q, k, positions, inv_freq, 1.0, qw, kw, eps),
                           lambda: apply_rotary_reference(q, k, positions, inv_freq, 1.0, qw, kw, eps),
                           2 * tokens * (h + kvh) * d * size),
        "qk_norm_rotary_kv_write": (lambda: apply_rotary(q, k, positions, inv_freq, 1.0, qw, kw, eps, kv),
                                    rotary_kv_write_reference,
                                    tokens * (2 * h + 5 * kvh) * d * size),  # q, k, v in; q, k out; k, v cached
        "silu_and_mul": (lambda: silu_and_mul(gate_up), lambda: silu_and_mul_reference(gate_up),
                         3 * tokens * inter * size),
    }
    res = {}
    for name, (fused, reference, nbytes) in cases.items():
        fused_ms, ref_ms = _bench_ms(fused), _bench_ms(reference)
        res[name] = (fused_ms, ref_ms)
        print(f"elem  T={tokens:6d} {name:23s} fused {fused_ms * 1e3:9.1f} us ({nbytes / fused_ms / 1e6:6.0f} GB/s)  "
              f"torch {ref_ms * 1e3:9.1f} us  {ref_ms / fused_ms:5.1f}x", flush=True)
    return res


# Candidate rotary.PREFILL_TILE values (BLOCK_T tokens, q heads per program, num_warps) for --rotary-sweep; at the
# sweep's shapes each is within rotary.PREFILL_MAX_PER_THREAD, so that the tile named is the one that runs
ROTARY_PREFILL_CANDIDATES = ((2, 8, 2), (4, 8, 4), (8, 8, 4), (8, 8, 8), (16, 8, 8), (1, 32, 2), (2, 32, 4),
                            (4, 32, 8), (8, 32, 16))


def sweep_rotary_prefill(tokens: int, h: int = 32, kvh: int = 8, d: int = 128,
                         dtype: torch.dtype = torch.bfloat16) -> dict[tuple | None, float]:
    """apply_rotary (q/k norm, kv write into a [blocks, 256, KVH, D] cache) at `tokens` rows of Qwen3-4B shapes:
    the decode tiling forced (the baseline, key None), then each candidate PREFILL_TILE; every candidate's q, k
    and caches must equal the baseline's. {tile: ms}."""
    from sparsekv.kernels import rotary as R

    q, k, kv, inv_freq, qw, kw = _rotary_inputs(tokens, h, kvh, d, dtype, "cuda")
    k_cache, v_cache = kv.k_cache, kv.v_cache
    positions = torch.randint(0, 1 << 20, (tokens,), device="cuda")
    nbytes = tokens * (2 * h + 5 * kvh) * d * q.element_size()

    def fn():
        return R.apply_rotary(q, k, positions, inv_freq, 1.0, qw, kw, 1e-6, kv)

    def outputs():
        k_cache.zero_()
        v_cache.zero_()
        return (*fn(), k_cache.clone(), v_cache.clone())

    res, baseline = {}, None
    for tile in (None, *ROTARY_PREFILL_CANDIDATES):
        values = dict(PREFILL_MIN_TOKENS=tokens + 1) if tile is None else dict(PREFILL_MIN_TOKENS=1, PREFILL_TILE=tile)
        with override_constants(R, **values):
            outs = outputs()
            res[tile] = _bench_ms(fn)
        baseline = outs if baseline is None else baseline
        same = all(torch.equal(a, b) for a, b in zip(outs, baseline))
        label = ("decode tiling (baseline)" if tile is None else
                 "BLOCK_T={:<3d} q_heads={:<3d} warps={:<3d}".format(*tile))
        print(f"rotary-sweep T={tokens:7d} {label:34s} {res[tile] * 1e3:8.1f} us {nbytes / res[tile] / 1e6:6.0f} GB/s"
              f"  {'equal' if same else 'DIFFERS from the baseline'}", flush=True)
    return res


# ---------------------------------------------------------------------------------------------- skinny linear (--gemv)
# (model, projection, N, K) of the decode linears: weight [N, K], bf16
GEMV_SHAPES = (
    ("qwen3-4b", "qkv", 6144, 2560), ("qwen3-4b", "o_proj", 2560, 4096), ("qwen3-4b", "gate_up", 19456, 2560),
    ("qwen3-4b", "down", 2560, 9728), ("qwen3-4b", "lm_head", 151936, 2560),
    ("llama3-8b", "qkv", 6144, 4096), ("llama3-8b", "o_proj", 4096, 4096), ("llama3-8b", "gate_up", 28672, 4096),
    ("llama3-8b", "down", 4096, 14336), ("llama3-8b", "lm_head", 128256, 4096),
)
GEMV_MS = (1, 4, 8, 16)
# Alternative CONFIGS rows (tensor cores, BLOCK_N, BLOCK_K, num_warps, num_stages) swept per (shape, M) at the
# split heuristic, plus the default row at forced split counts. FMA rows apply to M = 1 (and, 3-d, to M <= 4).
GEMV_FMA_CANDIDATES = ((False, 16, 256, 4, 1), (False, 16, 512, 4, 1), (False, 8, 512, 4, 1), (False, 32, 256, 8, 1),
                       (False, 16, 1024, 8, 1), (False, 32, 128, 4, 1))
GEMV_FMA3_CANDIDATES = ((False, 16, 128, 4, 1), (False, 32, 64, 4, 1))
GEMV_DOT_CANDIDATES = ((True, 32, 256, 4, 3), (True, 32, 128, 4, 4), (True, 64, 128, 4, 4), (True, 64, 256, 4, 3),
                       (True, 16, 256, 4, 4), (True, 32, 512, 4, 2), (True, 64, 128, 8, 3))
GEMV_SPLITS = (1, 2, 4, 8)


def _time_us(fn, device: torch.device, warmup: int = 5, rep: int = 25) -> float:
    """Microseconds per call: triton's do_bench on CUDA (L2 flushed before every call, so a weight that would fit
    in L2 is still read from HBM, as in a decode step); a wall-clock mean off-GPU (interpreter smoke runs)."""
    if device.type == "cuda":
        return _bench_ms(fn, warmup=warmup, rep=rep) * 1e3
    fn()
    start = time.perf_counter()
    calls = 2
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _gemv_candidates(m: int) -> list[tuple[str, tuple | None, int | None]]:
    """(label, CONFIGS row or None for the default, split_k or None for the heuristic) to sweep at M rows."""
    from sparsekv.kernels import gemv_configs as GC

    default = GC.table_row(m)
    rows = [("default", None, None)] + [("split", None, s) for s in GEMV_SPLITS]
    pool = GEMV_FMA_CANDIDATES if m == 1 else GEMV_DOT_CANDIDATES + (GEMV_FMA3_CANDIDATES if m <= 4 else ())
    rows += [("tile", row, None) for row in pool if tuple(row) != tuple(default)]
    return rows


def bench_gemv(shapes=GEMV_SHAPES, ms=GEMV_MS, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
               sweep: bool = True, sweep_ms=None, warmup: int = 5, rep: int = 25) -> list[dict]:
    """F.linear (cuBLAS) vs gemv.skinny_linear on the decode linears: one table row per (shape, M) with
    microseconds and GB/s (weight + x + out bytes / time), then, per (shape, M in sweep_ms), the best of the
    candidate configs. Returns the rows as dicts."""
    import torch.nn.functional as F

    from sparsekv.kernels import gemv as G

    device = torch.device(device)
    sweep_ms = ms if sweep_ms is None else sweep_ms
    gen = torch.Generator(device=device).manual_seed(0)
    print(f"{'gemv':5s} {'model':10s} {'proj':8s} {'N':>6s} {'K':>6s} {'M':>3s} {'cublas us':>9s} {'GB/s':>6s} "
          f"{'triton us':>9s} {'GB/s':>6s} {'ratio':>5s} {'rel err':>8s}  config   (ratio = cublas us / triton us)",
          flush=True)
    rows, sweeps = [], []
    for model, proj, n, k in shapes:
        weight = torch.randn(n, k, device=device, dtype=dtype, generator=gen) * k ** -0.5  # [N, K]
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)  # [M, K]
            nbytes = (n * k + m * k + m * n) * weight.element_size()
            ref = F.linear(x, weight)
            out = G.skinny_linear(x, weight)
            err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
            cublas_us = _time_us(lambda: F.linear(x, weight), device, warmup, rep)
            triton_us = _time_us(lambda: G.skinny_linear(x, weight), device, warmup, rep)
            config = G.choose_config(m, n, k, weight.element_size(), device)
            row = dict(model=model, proj=proj, n=n, k=k, m=m, cublas_us=cublas_us, triton_us=triton_us,
                       cublas_gbps=nbytes / cublas_us / 1e3, triton_gbps=nbytes / triton_us / 1e3, rel_err=err,
                       config=config.describe())
            rows.append(row)
            print(f"gemv  {model:10s} {proj:8s} {n:6d} {k:6d} {m:3d} {cublas_us:9.1f} {row['cublas_gbps']:6.0f} "
                  f"{triton_us:9.1f} {row['triton_gbps']:6.0f} {cublas_us / triton_us:5.2f} {err:8.1e}  "
                  f"{row['config']}", flush=True)
            if sweep and m in sweep_ms:
                sweeps.append(_gemv_sweep(model, proj, x, weight, nbytes, triton_us, device, warmup, rep))
        del weight
    if rows and device.type == "cuda":
        ratio = math.exp(sum(math.log(r["cublas_us"] / r["triton_us"]) for r in rows) / len(rows))
        print(f"gemv  geometric-mean speed-up of skinny_linear over F.linear: {ratio:.2f}x over {len(rows)} cases",
              flush=True)
    for m in sorted({s["m"] for s in sweeps}):
        wins: dict[str, int] = {}
        for s in sweeps:
            if s["m"] == m:
                wins[s["best"]] = wins.get(s["best"], 0) + 1
        text = ", ".join(f"{label} ({count}x)" for label, count in sorted(wins.items(), key=lambda kv: -kv[1])[:3])
        print(f"gemv-best M={m:2d}: {text}", flush=True)
    return rows


def _gemv_sweep(model: str, proj: str, x: torch.Tensor, weight: torch.Tensor, nbytes: int, default_us: float,
                device: torch.device, warmup: int, rep: int) -> dict:
    """Time skinny_linear under each candidate config; print one line: the best against the default."""
    from sparsekv.kernels import gemv as G
    from sparsekv.kernels import gemv_configs as GC

    m, k = x.shape
    n = weight.shape[0]
    results, seen = [], set()
    for label, row, split in _gemv_candidates(m):
        configs = GC.CONFIGS if row is None else ((GC.MAX_M, *row),)
        with override_constants(GC, CONFIGS=configs, SHAPE_CONFIGS=GC.SHAPE_CONFIGS if row is None else ()):
            config = GC.choose_config(m, n, k, weight.element_size(), device, split_k=split)
        if config in seen:
            continue
        seen.add(config)
        try:
            us = default_us if label == "default" else _time_us(lambda: G.skinny_linear(x, weight, config=config),
                                                                device, warmup, rep)
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report and go on
            print(f"  gemv-sweep {model} {proj} M={m} {config.describe()} failed: {type(exc).__name__}: {exc}"[:200],
                  flush=True)
            continue
        results.append((us, config.describe()))
    best_us, best = min(results)
    print(f"gemv-sweep {model:10s} {proj:8s} {n:6d} {k:6d} {m:3d} best {best_us:8.1f} us {nbytes / best_us / 1e3:6.0f} "
          f"GB/s ({default_us / best_us:4.2f}x the default, {len(results)} configs)  {best}", flush=True)
    return dict(model=model, proj=proj, m=m, best=best.rsplit(" split=", 1)[0], best_us=best_us)


def run_gemv(quick: bool = False) -> None:
    """``--gemv``: the HBM copy rate for reference, then bench_gemv (sweeps at M in {1, 16} only with quick)."""
    from sparsekv.tasks.bench import floors

    start = time.perf_counter()
    print(f"gemv  HBM device-to-device copy: {floors.hbm_gbps():.0f} GB/s (read + write bytes / time)", flush=True)
    bench_gemv(sweep_ms=(1, 16) if quick else GEMV_MS)
    print(f"gemv benchmarks took {time.perf_counter() - start:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--elementwise", action="store_true",
                        help="only the fused elementwise kernels (RMSNorm, q/k norm + rotary, SiLU-and-mul)")
    parser.add_argument("--decode", action="store_true",
                        help="only decode attention (Sq = 1): flash-decoding vs the prefill kernel, paged decode, "
                             "and tables over candidate tuning constants of both")
    parser.add_argument("--gemv", action="store_true",
                        help="only the skinny linear of decode (M <= 16): F.linear (cuBLAS) vs gemv.skinny_linear on "
                             "Qwen3-4B / Llama-3.1-8B shapes, GB/s against the HBM copy rate, and a config sweep")
    parser.add_argument("--rotary-sweep", action="store_true",
                        help="only apply_rotary's prefill tiling: candidate PREFILL_TILE values against the decode "
                             "tiling at 32K and 128K tokens")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.exit(2, "tools/bench_kernels.py times GPU kernels and needs CUDA; torch sees no CUDA device here.\n")
    torch.manual_seed(0)
    if args.gemv:
        run_gemv(quick=args.quick)
        return
    if args.rotary_sweep:
        for tokens in (32768, 131072):
            sweep_rotary_prefill(tokens)
        return
    if args.decode:
        start = time.perf_counter()
        bench_decode()
        bench_paged_decode()
        print(f"decode benchmarks took {time.perf_counter() - start:.0f} s", flush=True)
        return
    for tokens in (1, 8, 32768) if args.quick else (1, 8, 64, 1024, 32768):
        bench_elementwise(tokens)
    if args.elementwise:
        return
    for d in (128,) if args.quick else (64, 128, 256):
        bench_attention(4096, 4096, False, d=d)
        bench_attention(4096, 4096, True, d=d)
    bench_attention(16384, 16384, True)
    bench_attention(1024, 8192, True)
    bench_attention(2048, 32768, True)
    for lens in ([8192], [32768], [131072], [4096] * 32, [1024] * 64, [128000] * 4):
        bench_paged(lens)
    if not args.quick:
        for splits in (8, 16, 33, 64, 128):
            bench_paged([131072], num_splits=splits)
        for splits in (4, 8, 16, 33, 64):
            bench_paged([32768], num_splits=splits)


if __name__ == "__main__":
    main()
