"""Choose the dense prefill attention kernel's tile config (GPU_CONFIGS_SM90 in sparsekv/kernels/attention.py):
time _flash_fwd_kernel at every (BLOCK_M, BLOCK_N, num_warps, num_stages) of TILE_CONFIGS beside torch SDPA.

    python3 tools/tune_prefill_attention.py --out prefill_tune.json   # H100/H200: about 1 minute (4.5 at most)
    python3 tools/tune_prefill_attention.py --quick                   # QUICK_CONFIGS, no 128K shape
    TRITON_INTERPRET=1 python3 tools/tune_prefill_attention.py --dry-run   # CPU, tiny sizes: checks the script

Shapes (H = 32 query heads, KVH = 8, D = 128, bf16): Sq = Sk = 32768 causal, Sq = Sk = 131072 causal, and a
4096-row chunk against 32768 keys, non-causal (the chunked prefill's partials). FLOPs = 4 * visible (query, key)
pairs * H * D (causal: S (S + 1) / 2 pairs).

On sm_90 the warp-specialized Gluon kernel that flash_attn_with_lse runs there (attention_sm90.py) is timed beside
them as "sm90 gluon"; it has no tile table and cannot be the pasted entry, which serves the calls it does not take.
--sm90-variants 64,3 128,3 ... also times it at other key-block widths and K/V ring slots (attention_sm90's
BLOCK_N and STAGES), on every shape, each checked like the rest.
Every tile config runs at 32K causal first. The 128K causal and chunk shapes then time the fastest --finalists of
them, the Gluon kernel, the current default (attention.dense_tile_config) and the references: SDPA's flash kernel
(torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION), K/V repeated to H heads outside the timing) and cuDNN's
where torch has it. Each candidate's o and lse are compared with SDPA's (max abs error, --max-err), and on causal
shapes a small bottom-right call (1008 queries, 2048 keys) with the fp32 reference (max abs error over max |o|,
SMALL_MAX_REL_ERR); a candidate over either is marked FAIL and cannot win. Times are triton.testing.do_bench medians
(it clears L2 between calls); the 128K shape gets a short --rep-ms-long since one call takes ~0.25 s. Before the
sweep, --power-warmup-s seconds of GEMMs bring the GPU to its power limit, where it then stays (a GPU fresh from idle
times 4-5% faster for its first seconds, docs/benchmarks.md, which would favour whatever runs first); then the bf16
GEMM rate, the floor the figures stand beside, is timed and recorded (gemm_tflops).

Output: a table per shape, the winner per shape, and a GPU_CONFIGS_SM90 entry for --head-dim with its comment to
paste into sparsekv/kernels/attention.py (the config with the best geometric mean over the causal shapes; the
comment names each shape's TFLOP/s, the next config's and the references'). --out writes every number, the GPU,
versions and date as JSON, rewritten after each candidate: a watchdog ends the run (exit 3) if one candidate takes
longer than --candidate-timeout s, and candidates left when --budget-s is spent are skipped, so that the file
always holds what was measured.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import threading
import time

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from sparsekv.kernels import attention as A  # noqa: E402
from sparsekv.kernels import attention_sm90  # noqa: E402
from sparsekv.kernels.external_attention import torch_fused_attention  # noqa: E402
from sparsekv.tasks.bench.floors import matmul_tflops  # noqa: E402

Config = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
TILE_CONFIGS: list[Config] = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3),
                              (64, 64, 4, 2), (64, 128, 4, 2), (256, 64, 16, 2)]
QUICK_CONFIGS: list[Config] = [(128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)]
DRY_RUN_CONFIGS: list[Config] = [(32, 16, 4, 1), (16, 32, 4, 1)]  # interpreter: small, not the default's
DEFAULT = None  # the Triton kernel at attention.dense_tile_config
SM90 = "sm90"  # the Gluon kernel of attention_sm90.py; ("sm90", BLOCK_N, STAGES): it at other constants
SMALL_MAX_REL_ERR = 5e-2  # bf16 rounding stays near 1e-2; a wrong mask or offset gives O(1) on some rows


def candidates(args) -> list[Config]:
    if args.dry_run:
        return list(DRY_RUN_CONFIGS)
    return list(QUICK_CONFIGS if args.quick else TILE_CONFIGS)


def sm90_constants(config) -> tuple[int, int] | None:
    """(BLOCK_N, STAGES) the Gluon kernel runs this candidate at; None for the Triton kernel's tile configs."""
    if config == SM90:
        return attention_sm90.BLOCK_N, attention_sm90.STAGES
    if config is not DEFAULT and config[0] == SM90:
        return config[1], config[2]
    return None


def label(config: Config | None) -> str:
    if config is DEFAULT:
        return "default (dense_tile_config)"
    if config == SM90:
        return "sm90 gluon (warp-specialized, ping-pong)"
    if sm90_constants(config):
        return f"sm90 gluon {config[1]} keys x {config[2]} slots"
    return "x".join(map(str, config[:2])) + f" w{config[2]} s{config[3]}"


def launch(q, k, v, o, lse, scale: float, causal: bool, config: Config | None) -> None:
    """_flash_fwd_kernel into o [Sq, H, D] and lse [H, Sq] with config (None: the default dense_tile_config), or
    the Gluon kernel (SM90)."""
    constants = sm90_constants(config)
    if constants:
        kept = attention_sm90.BLOCK_N, attention_sm90.STAGES
        attention_sm90.BLOCK_N, attention_sm90.STAGES = constants
        try:
            attention_sm90.flash_attn_sm90(q, k, v, scale, causal, out=(o, lse))
        finally:
            attention_sm90.BLOCK_N, attention_sm90.STAGES = kept
    else:
        A._launch_flash_fwd(q, k, v, o, lse, scale, causal, config or A.dense_tile_config(q))


def visible_pairs(sq: int, sk: int, causal: bool) -> int:
    """(query, key) pairs that attention computes; causal is bottom-right aligned."""
    if not causal:
        return sq * sk
    off = sk - sq
    full = max(0, min(sq, sk - off))  # rows i with i + off + 1 in (0, Sk]: i + off + 1 keys each
    first = max(0, -off)  # rows before it see no key
    n = max(0, full - first)
    return sum((first + off + 1, first + off + n)) * n // 2 + (sq - first - n) * sk


class Run:
    """The shared state: arguments, the JSON record (rewritten after every candidate) and the watchdog."""

    def __init__(self, args):
        self.args, self.t0, self.beat = args, time.perf_counter(), time.perf_counter()
        cuda = torch.cuda.is_available() and not args.dry_run
        self.device = torch.device("cuda" if cuda else "cpu")
        self.record = {"gpu": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
                       "torch": torch.__version__, "triton": _triton_version(), "cuda": torch.version.cuda,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "args": vars(args), "shapes": [], "status": "running"}
        if cuda:
            threading.Thread(target=self._watchdog, daemon=True).start()

    def _watchdog(self) -> None:
        while True:
            time.sleep(5)
            if time.perf_counter() - self.beat > self.args.candidate_timeout:
                self.record["status"] = f"aborted: one candidate ran over {self.args.candidate_timeout} s"
                self.save()
                print(self.record["status"], flush=True)
                os._exit(3)

    def warm_up(self, seconds: float) -> None:
        """The floors module's sustained bf16 GEMM rate, measured after `seconds` of GEMMs: a GPU fresh from idle
        clocks higher for its first seconds (4-5% faster on an H100), which would favour the first candidates; the
        rate is the floor the figures stand beside."""
        if self.device.type != "cuda" or seconds <= 0:
            return
        self.record["gemm_tflops"] = matmul_tflops(device=self.device, warmup_seconds=seconds)
        print(f"bf16 GEMM floor after {seconds:.0f} s of warm-up: {self.record['gemm_tflops']:.1f} TFLOP/s")
        self.t0 = self.beat = time.perf_counter()  # --budget-s counts the sweep alone

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t0 > self.args.budget_s

    def save(self) -> None:
        if self.args.out:
            with open(self.args.out, "w") as f:
                json.dump(self.record, f, indent=1)


def _triton_version() -> str:
    import triton

    return triton.__version__


class SmallCase:
    """A small bottom-right causal call (Sq != Sk, Sq off the block grid) against the fp32 reference: catches mask
    and offset errors that the long shapes average away. Sizes keep Triton's divisibility specialisation (by 16)
    of the long shapes, so no candidate compiles again for it."""

    def __init__(self, run: Run):
        a, dev = run.args, run.device
        sq, sk = (24, 40) if a.dry_run else (1008, 2048)
        dtype = torch.float32 if a.dry_run else torch.bfloat16
        gen = torch.Generator(device=dev).manual_seed(7)
        self.q = torch.randn(sq, a.heads, a.head_dim, device=dev, dtype=dtype, generator=gen)  # [Sq, H, D]
        self.k = torch.randn(sk, a.kv_heads, a.head_dim, device=dev, dtype=dtype, generator=gen)  # [Sk, KVH, D]
        self.v = torch.randn(sk, a.kv_heads, a.head_dim, device=dev, dtype=dtype, generator=gen)
        self.scale = 1.0 / math.sqrt(a.head_dim)
        self.ref = A.flash_attn_with_lse_reference(self.q, self.k, self.v, self.scale, True)

    def rel_err(self, config: Config | None) -> float:
        """max |o - o_ref| / max |o_ref| with this tile config, inf where lse's -inf rows differ."""
        q = self.q
        o = torch.empty_like(q)  # [Sq, H, D]
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)  # [H, Sq]
        launch(q, self.k, self.v, o, lse, self.scale, True, config)
        ro, rlse = self.ref
        if not torch.equal(torch.isneginf(lse), torch.isneginf(rlse)):
            return float("inf")
        return ((o.float() - ro.float()).abs().max() / ro.float().abs().max()).item()


class Shape:
    """q [Sq, H, D], k/v [Sk, KVH, D] and the SDPA reference (o, lse) of one timed shape."""

    def __init__(self, name: str, sq: int, sk: int, causal: bool, run: Run):
        a, dev = run.args, run.device
        run.beat = time.perf_counter()
        dtype = torch.float32 if a.dry_run else torch.bfloat16
        self.name, self.sq, self.sk, self.causal, self.h, self.head_dim = name, sq, sk, causal, a.heads, a.head_dim
        gen = torch.Generator(device=dev).manual_seed(sq + sk)
        self.q = torch.randn(sq, a.heads, a.head_dim, device=dev, dtype=dtype, generator=gen)  # [Sq, H, D]
        self.k = torch.randn(sk, a.kv_heads, a.head_dim, device=dev, dtype=dtype, generator=gen)  # [Sk, KVH, D]
        self.v = torch.randn(sk, a.kv_heads, a.head_dim, device=dev, dtype=dtype, generator=gen)
        self.scale = 1.0 / math.sqrt(a.head_dim)
        self.flops = 4.0 * visible_pairs(sq, sk, causal) * a.heads * a.head_dim
        self.long = sq * sk > 2**32
        self.rows: list[dict] = []
        run.record["shapes"].append({"name": name, "sq": sq, "sk": sk, "causal": causal, "flops": self.flops,
                                     "rows": self.rows})  # the same list: saves show the rows so far
        if a.dry_run:
            self.ref = A.flash_attn_with_lse_reference(self.q, self.k, self.v, self.scale, causal)
        else:
            self.ref = torch_fused_attention(self.q, self.k, self.v, self.scale, causal, "sdpa")  # o, lse

    def time_ms(self, fn, run: Run) -> float:
        if run.args.dry_run:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        from triton.testing import do_bench

        a = run.args
        return do_bench(fn, warmup=a.warmup_ms, rep=a.rep_ms_long if self.long else a.rep_ms, return_mode="median")

    def add(self, name: str, ms: float | None, extra: dict) -> dict:
        row = {"name": name, "ms": ms, "tflops": None if ms is None else self.flops / ms / 1e9, **extra}
        self.rows.append(row)
        return row


def time_candidate(shape: Shape, config: Config | None, run: Run) -> dict:
    run.beat = time.perf_counter()
    q, k, v, H = shape.q, shape.k, shape.v, shape.h
    o = torch.empty_like(q)  # [Sq, H, D]
    lse = torch.empty(H, shape.sq, dtype=torch.float32, device=q.device)  # [H, Sq]
    extra = {"kernel": "sm90" if sm90_constants(config) else "dense", "config": config or A.dense_tile_config(q)}
    try:
        launch(q, k, v, o, lse, shape.scale, shape.causal, config)  # compiles
        ro, rlse = shape.ref
        finite = torch.isfinite(rlse)
        err_o = (o.float() - ro.float()).abs().max().item()
        err_lse = (lse[finite] - rlse[finite]).abs().max().item() if finite.any() else 0.0
        same_inf = torch.equal(torch.isneginf(lse), torch.isneginf(rlse))
        small = run.small.rel_err(config) if shape.causal else 0.0
        ok = (err_o <= run.args.max_err and err_lse <= 10 * run.args.max_err and same_inf
              and small <= SMALL_MAX_REL_ERR)
        extra.update(max_abs_err_o=err_o, max_abs_err_lse=err_lse, small_rel_err=small, ok=ok)
        ms = shape.time_ms(lambda: launch(q, k, v, o, lse, shape.scale, shape.causal, config), run)
    except Exception as exc:  # noqa: BLE001 - out of shared memory, a compiler failure: record it, go on
        extra.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        ms = None
    row = shape.add(label(config), ms, extra)
    tf = "-" if row["tflops"] is None else f"{row['tflops']:.1f}"
    print(f"  [{time.perf_counter() - run.t0:5.0f} s] {shape.name}: {label(config)}: {tf} TFLOP/s"
          f"{'' if row['ok'] else '  FAIL ' + row.get('error', '')}", flush=True)
    return row


def time_references(shape: Shape, run: Run) -> None:
    """SDPA flash and cuDNN through torch.nn.attention.sdpa_kernel, K/V repeated to H heads beforehand."""
    if run.args.dry_run:
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = shape.h // shape.k.shape[1]
    q4 = shape.q.transpose(0, 1)[None]  # [1, H, Sq, D]
    k4, v4 = (t.repeat_interleave(group, dim=1).transpose(0, 1)[None].contiguous() for t in (shape.k, shape.v))
    for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        run.beat = time.perf_counter()
        try:
            with sdpa_kernel(backend):
                fn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                    q4, k4, v4, is_causal=shape.causal, scale=shape.scale)
                fn()
                shape.add(name, shape.time_ms(fn, run), {"kernel": "reference", "ok": None})
        except Exception as exc:  # noqa: BLE001 - e.g. cuDNN attention missing from this build
            shape.add(name, None, {"kernel": "reference", "ok": None, "error": f"{type(exc).__name__}: {exc}"[:300]})
    del k4, v4


def report(shape: Shape) -> dict | None:
    print(f"\n{shape.name}: Sq={shape.sq} Sk={shape.sk} causal={shape.causal} ({shape.flops / 1e12:.1f} TFLOP)")
    for r in sorted(shape.rows, key=lambda r: -(r["tflops"] or 0)):
        tf = "   -  " if r["tflops"] is None else f"{r['tflops']:6.1f}"
        ms = "    -   " if r["ms"] is None else f"{r['ms']:8.3f}"
        err = f"  err o {r['max_abs_err_o']:.2e} lse {r['max_abs_err_lse']:.2e}" if "max_abs_err_o" in r else ""
        flag = "" if r.get("ok") in (None, True) else "  FAIL"
        print(f"  {tf} TFLOP/s {ms} ms  {r['name']:<42}{err}{flag}  {r.get('error', '')}", flush=True)
    good = [r for r in shape.rows if r.get("ok") and r["tflops"]]
    win = max(good, key=lambda r: r["tflops"]) if good else None
    if win:
        print(f"  winner: {win['name']} {win['tflops']:.1f} TFLOP/s")
    return win


def paste_line(shapes: list[Shape], record: dict) -> str:
    """The GPU_CONFIGS_SM90 entry (best geometric mean over the causal shapes) with the comment to keep above it."""
    causal = [s for s in shapes if s.causal]
    by_name: dict[str, list[dict]] = {}
    for s in causal:
        for r in s.rows:
            if r.get("ok") and r["tflops"] and r["kernel"] == "dense":
                by_name.setdefault(r["name"], []).append(r)
    both = {n: rs for n, rs in by_name.items() if len(rs) == len(causal)}
    if not both:
        return "# no tile config ran correctly on every causal shape"
    name = max(both, key=lambda n: sum(math.log(r["tflops"]) for r in both[n]))
    cfg = tuple(both[name][0]["config"])
    refs = []
    for s in shapes:
        tf = {x["name"]: x["tflops"] for x in s.rows if x["tflops"]}
        others = [x for x in s.rows if x.get("ok") and x["tflops"] and x["kernel"] == "dense"
                  and tuple(x["config"]) != cfg]
        nxt = max(others, key=lambda x: x["tflops"]) if others else None
        parts = [f"next {nxt['tflops']:.0f} ({nxt['name']})"] if nxt else []
        parts += [f"{n.split(' (')[0]} {tf[n]:.0f}" for n in ("sdpa flash", "cudnn", label(DEFAULT), label(SM90))
                  if n in tf]
        refs.append(f"{s.name} {tf.get(name, 0):.0f} ({', '.join(parts)})")
    comment = (f"# tools/tune_prefill_attention.py, {record['gpu']}, triton {record['triton']}, "
               f"{record['date'][:10]}, {name}, TFLOP/s:\n#   " + "\n#   ".join(refs))
    entry = f"GPU_CONFIGS_SM90: dict[int, tuple[int, int, int, int]] = {{{shapes[0].head_dim}: {cfg}}}"
    return comment + "\n" + entry


def sweep(shape: Shape, configs: list, run: Run) -> None:
    """Time every config on the shape (skipping what the time budget no longer allows), then the references."""
    for config in configs:
        if run.over_budget():
            shape.add(label(config), None, {"ok": False, "error": "skipped: --budget-s spent"})
            continue
        time_candidate(shape, config, run)
        run.save()
    time_references(shape, run)
    report(shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON file with every number")
    ap.add_argument("--quick", action="store_true", help="QUICK_CONFIGS only, 32K causal and the chunk")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny sizes: checks the script")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--finalists", type=int, default=6, help="32K winners also timed on the other shapes")
    ap.add_argument("--warmup-ms", type=float, default=25.0)
    ap.add_argument("--power-warmup-s", type=float, default=6.0,
                    help="GEMMs before the sweep (then the GEMM floor is timed) so that every candidate is timed at "
                         "the power limit (0: neither)")
    ap.add_argument("--rep-ms", type=float, default=150.0)
    ap.add_argument("--rep-ms-long", type=float, default=600.0, help="do_bench rep for the 128K shape")
    ap.add_argument("--max-err", type=float, default=2e-2, help="max |o - o_sdpa| of a correct candidate")
    ap.add_argument("--budget-s", type=float, default=270.0, help="skip what is left after this many seconds")
    ap.add_argument("--candidate-timeout", type=float, default=60.0, help="watchdog: exit 3 past it")
    ap.add_argument("--sm90-variants", nargs="*", default=[], metavar="BLOCK_N,STAGES",
                    help="the Gluon kernel also at these key-block widths and ring slots")
    args = ap.parse_args()
    if args.dry_run:
        args.heads, args.kv_heads, args.head_dim = 4, 2, 32
        shapes_spec = [("32K causal", 40, 40, True), ("128K causal", 72, 72, True), ("chunk", 24, 56, False)]
    else:
        if not torch.cuda.is_available():
            sys.exit("needs CUDA (or --dry-run under TRITON_INTERPRET=1 for a CPU check of the script)")
        shapes_spec = [("32K causal", 32768, 32768, True), ("128K causal", 131072, 131072, True),
                       ("4Kx32K chunk", 4096, 32768, False)]
        if args.quick:
            del shapes_spec[1]
    run = Run(args)
    run.warm_up(args.power_warmup_s)
    run.small = SmallCase(run)
    first_spec, *rest_spec = shapes_spec
    first = Shape(*first_spec, run)
    variants = [(SM90, *(int(x) for x in v.split(","))) for v in args.sm90_variants]
    gluon = [SM90, *variants] if attention_sm90.sm90_attention_ok(first.q, first.k, first.v) else []
    sweep(first, gluon + [DEFAULT] + candidates(args), run)
    ranked = sorted((r for r in first.rows if r.get("ok") and r["tflops"]), key=lambda r: -r["tflops"])
    best = {r["name"] for r in ranked[:args.finalists]}
    finalists = gluon + [DEFAULT] + [c for c in candidates(args) if label(c) in best]
    shapes = [first]
    del first.q, first.k, first.v, first.ref
    for spec in rest_spec:
        if run.device.type == "cuda":
            torch.cuda.empty_cache()
        shape = Shape(*spec, run)
        shapes.append(shape)
        sweep(shape, finalists, run)
        del shape.q, shape.k, shape.v, shape.ref
    paste = paste_line(shapes, run.record)
    run.record.update(paste=paste, status="done", seconds=time.perf_counter() - run.t0)
    run.save()
    print(f"\npaste into sparsekv/kernels/attention.py:\n{paste}\n\ntotal {time.perf_counter() - run.t0:.0f} s")


if __name__ == "__main__":
    main()
