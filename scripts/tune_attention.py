"""Tune the prefill attention kernel (sparsekv/kernels/attention.py) on one CUDA GPU: block configs x variant flags.

    python scripts/tune_attention.py --json OUT/tune_attention.json            # full sweep, 2-4 minutes
    python scripts/tune_attention.py --json OUT/tune_attention.json --quick    # smaller sweep, about 1 minute
    python scripts/tune_attention.py --plan                                    # list the candidates (no GPU needed)

Cases, H=32, KVH=8, D=128, bf16: causal Sq=Sk=8192, causal Sq=Sk=32768, non-causal Sq=8192 x Sk=32768.

Phase 1 times every (BLOCK_M, BLOCK_N) x num_warps x num_stages with the default variant flags; configs whose
K/V pipeline cannot fit in shared memory are pruned up front. Phase 2 times the combinations of the
attention.ATTN_VARIANTS flags on the configs that did best over all cases (plus the best for causal_32k).
Candidates are compiled ahead of time by --jobs worker processes, which fill Triton's on-disk cache (a compiler
crash fails only its candidate; compiler output goes to JSON.compile.log); two candidates that compile to the
same PTX (a flag that does nothing on this GPU) are timed once. Each candidate's output is
checked once against the shipped kernel (GPU_CONFIGS[128], ATTN_VARIANTS) on the same inputs (NaN-poisoned
outputs, |diff| <= 2e-2 + 2e-2 |ref|, lse within 2e-2); the shipped kernel itself is checked against the fp32
reference on one GQA group. A candidate that fails to compile, to launch (e.g. out of shared memory) or the check
is reported and never wins. torch SDPA (flash and cuDNN backends, k/v repeated to H heads) and flash-attn, where
installed, are timed on the same shapes for reference.

ATTN_VARIANTS applies to every head dim and dtype, so the three fastest flag sets are then run once with the
shipped config of every GPU_CONFIGS / GPU_CONFIGS_FP32 entry against the fp32 reference (a flag that fails to
compile for num_warps=4, say, shows up here), and the recommendation is the fastest one that passes everywhere.

Times are medians of triton.testing.do_bench (L2 flushed before each run). TFLOP/s count 4 * D * H FLOPs per
visible (query, key) pair. Prints a table per case sorted by time, the best candidate per case and the best over
all cases as the lines to put into attention.py, and writes everything to --json. No new timing starts after
--budget-s seconds, so the script ends in time with what it has (SIGTERM also writes the JSON).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

H, KVH, D = 32, 8, 128
CASES = [  # name, Sq, Sk, causal
    ("causal_8k", 8192, 8192, True),
    ("causal_32k", 32768, 32768, True),
    ("noncausal_8k_32k", 8192, 32768, False),
]
FOCUS_CASE = "causal_32k"  # ~60% of a Qwen3-4B 32K prefill
BLOCKS = [(128, 64), (128, 128), (64, 64), (128, 32)]
WARPS = [4, 8]
STAGES = [2, 3, 4]
QUICK_BLOCKS = [(128, 64), (128, 128), (64, 64)]
QUICK_STAGES = [2, 3]
PORTABILITY_S = 30  # the portability check may run this long past --budget-s
SMEM_LIMIT = 227 * 1024  # dynamic shared memory per block on sm_90
ATOL = RTOL = 2e-2
LSE_TOL = 2e-2


def smem_bytes(block_m: int, block_n: int, stages: int, elem: int = 2) -> int:
    """Shared memory of the kernel's pipeline: the Q tile plus `stages` K and V tiles (matches what Triton
    reports for this kernel on sm_90: 128 KiB for (128, 64, *, 3))."""
    return block_m * D * elem + stages * 2 * block_n * D * elem


def visible_pairs(sq: int, sk: int, causal: bool) -> int:
    """(query, key) pairs that attend: bottom-right causal, query i sees key j iff j <= i + sk - sq."""
    if not causal:
        return sq * sk
    return sum(min(sk, max(0, i + sk - sq + 1)) for i in range(sq))


def flags_label(flags) -> str:
    on = sorted(name for name, val in dict(flags).items() if val)
    return "+".join(on) if on else "-"


def phase1_configs(quick: bool) -> tuple[list[tuple[int, int, int, int]], list[tuple[tuple[int, int, int, int], str]]]:
    keep, pruned = [], []
    for (bm, bn), warps, stages in itertools.product(QUICK_BLOCKS if quick else BLOCKS, WARPS,
                                                    QUICK_STAGES if quick else STAGES):
        cfg = (bm, bn, warps, stages)
        need = smem_bytes(bm, bn, stages)
        if need > SMEM_LIMIT:
            pruned.append((cfg, f"needs {need // 1024} KiB shared memory > {SMEM_LIMIT // 1024} KiB"))
        else:
            keep.append(cfg)
    return keep, pruned


def variant_combos(names: list[str], quick: bool) -> list[dict[str, bool]]:
    """Non-empty subsets of the flags, fewest flags first (quick: single flags, the two grid flags, all)."""
    if quick:
        subsets = [(n,) for n in names]
        if {"REVERSE_M", "HEADS_OUTER"} <= set(names):
            subsets.append(("REVERSE_M", "HEADS_OUTER"))
        if len(names) > 1:
            subsets.append(tuple(names))
    else:
        subsets = [c for r in range(1, len(names) + 1) for c in itertools.combinations(names, r)]
    return [{n: (n in sub) for n in names} for sub in subsets]


# ---------------------------------------------------------------------------------------------- compile workers
_W = {}


def _import_attention():
    try:
        from sparsekv.kernels import attention
    except ImportError:  # sparsekv/__init__ imports the engine (pluggy, ...); the kernels need torch and triton only
        import importlib
        import types
        for name, path in (("sparsekv", REPO / "sparsekv"), ("sparsekv.kernels", REPO / "sparsekv" / "kernels")):
            if name not in sys.modules:
                mod = types.ModuleType(name)
                mod.__path__ = [str(path)]
                sys.modules[name] = mod
        attention = importlib.import_module("sparsekv.kernels.attention")
    return attention


class _WarmupOnly:
    """Stands in for _flash_fwd_kernel in a worker: `kernel[grid](...)` compiles (Triton's warmup) but launches
    nothing, through the very launcher code the main process times, so both hit the same cache entry."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiled = self.fn.warmup(*args, grid=grid, **kwargs)
        return launch


def _worker_init() -> None:
    import torch

    try:
        os.nice(10)  # the main process times kernels meanwhile: let it have the CPU first
    except OSError:
        pass

    attention = _import_attention()
    torch.cuda.set_device(0)
    proxy = _WarmupOnly(attention._flash_fwd_kernel)
    attention._flash_fwd_kernel = proxy  # this process only compiles
    _W.update(attention=attention, proxy=proxy, torch=torch, tensors={})


def _worker_inputs(causal: bool, d: int, dtype: str):
    """Small inputs with the same specialization as the timed ones (sizes and strides divisible by 16)."""
    torch = _W["torch"]
    key = (causal, d, dtype)
    if key not in _W["tensors"]:
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=getattr(torch, dtype))  # noqa: E731
        sk = 256 if causal else 512
        _W["tensors"][key] = (mk(256, H, d), mk(sk, KVH, d), mk(sk, KVH, d))
    return _W["tensors"][key]


def _worker_compile(config, flags, causal, d: int = D, dtype: str = "bfloat16"):
    """Compile one candidate; returns dict(status, seconds, ptx hash, shared bytes, registers, spills, error)."""
    import hashlib
    import re

    attention, torch, proxy = _W["attention"], _W["torch"], _W["proxy"]
    q, k, v = _worker_inputs(causal, d, dtype)
    o = torch.empty_like(q)
    lse = torch.empty((H, q.shape[0]), dtype=torch.float32, device=q.device)
    start = time.time()
    res = {"status": "ok"}
    try:
        proxy.compiled = None
        attention._launch_flash_fwd(q, k, v, o, lse, 1 / math.sqrt(d), causal, config, flags)
        kern = proxy.compiled
        if kern is not None:
            ptx = kern.asm.get("ptx", "")
            body = [ln for ln in (re.sub(r"//.*", "", x).strip() for x in ptx.splitlines())
                    if ln and not ln.startswith((".loc", ".file", "$L__tmp", "$L__func"))]
            res["ptx_hash"] = hashlib.sha1("\n".join(body).encode()).hexdigest()[:16]
            res["shared"] = int(getattr(kern.metadata, "shared", 0) or 0)
            try:  # loads the module: raises here if it needs more shared memory than the GPU has
                kern._init_handles()
                res["n_regs"], res["n_spills"] = int(kern.n_regs), int(kern.n_spills)
            except Exception as exc:  # noqa: BLE001
                if "resource" in type(exc).__name__.lower() or "resource" in str(exc).lower():
                    res.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:300])
    except Exception as exc:  # noqa: BLE001
        import traceback

        lines = str(exc).strip().splitlines()
        res.update(status="failed", error=f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300])
        # Raised inside Triton (front end, passes, ptxas): the main process would fail the same way. Anything
        # else may be this worker's own trouble, and the main process tries the candidate itself.
        frames = traceback.extract_tb(exc.__traceback__)
        res["in_triton"] = any(f"{os.sep}triton{os.sep}" in f.filename for f in frames[1:])
    res["seconds"] = round(time.time() - start, 2)
    return res


def _worker_main(wid: int, tasks, messages, log_path: str | None) -> None:
    """Compile worker: takes candidate keys from `tasks`, says ("start", key) before compiling and ("done", key,
    report) after, so that the main process knows which candidate a crashed worker was compiling."""
    if log_path:  # compiler output (MLIR reproducers can be long) goes to a file, C++ writes included
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    try:
        _worker_init()
    except BaseException as exc:  # noqa: BLE001
        messages.put(("init_failed", wid, f"{type(exc).__name__}: {exc}"[:300]))
        return
    while True:
        key = tasks.get()
        if key is None:
            return
        messages.put(("start", wid, key))
        config, flags, causal, d, dtype = key
        messages.put(("done", wid, (key, _worker_compile(config, dict(flags), causal, d, dtype))))


class Compiler:
    """Ahead-of-time compiles in `jobs` worker processes that fill Triton's on-disk cache. A worker that dies
    (a compiler crash) fails only the candidate it was compiling and is replaced. Without workers (jobs=0, or none
    could start) result() returns None and the main process compiles at the first launch."""

    def __init__(self, jobs: int, log, log_path: str | None = None, worker_main=None):
        self.jobs, self.log, self.log_path = jobs, log, log_path
        self.worker_main = worker_main or _worker_main
        self.results, self.submitted, self.running, self.procs = {}, set(), {}, {}
        self.next_wid = self.respawns = self.init_failures = 0
        self.disabled = jobs <= 0
        if self.disabled:
            return
        import multiprocessing

        self.ctx = multiprocessing.get_context("spawn")
        self.tasks = self.ctx.Queue()
        self.messages = self.ctx.SimpleQueue()  # put() writes through: a "start" is seen even if the worker dies
        for _ in range(jobs):
            self._spawn()

    def _spawn(self) -> None:
        wid, self.next_wid = self.next_wid, self.next_wid + 1
        proc = self.ctx.Process(target=self.worker_main, args=(wid, self.tasks, self.messages, self.log_path),
                                daemon=True)
        proc.start()
        self.procs[wid] = proc

    @staticmethod
    def key(config, flags, causal, d=None, dtype="bfloat16"):
        return (tuple(config), tuple(sorted(dict(flags).items())), bool(causal), d or D, dtype)

    def submit(self, config, flags, causal, d=None, dtype="bfloat16") -> None:
        key = self.key(config, flags, causal, d, dtype)
        if self.disabled or key in self.submitted:
            return
        self.submitted.add(key)
        self.tasks.put(key)

    def _poll(self) -> None:
        while not self.messages.empty():
            kind, wid, payload = self.messages.get()
            if kind == "start":
                self.running[wid] = payload
            elif kind == "done":
                key, res = payload
                self.results[key] = res
                if self.running.get(wid) == key:
                    del self.running[wid]
            elif kind == "init_failed":
                self.init_failures += 1
                self.log(f"compile worker {wid} could not start: {payload}")
        for wid, proc in list(self.procs.items()):
            if proc.is_alive():
                continue
            del self.procs[wid]
            key = self.running.pop(wid, None)
            if key is not None and key not in self.results:
                self.results[key] = {"status": "failed", "in_triton": True,
                                     "error": f"the compiler crashed (worker exit code {proc.exitcode})"}
                self.log(f"compile worker crashed on {key[0]} {flags_label(key[1])} causal={key[2]}: "
                         f"exit code {proc.exitcode}")
            if self.init_failures < 3 and self.respawns < 4 * self.jobs:
                self.respawns += 1
                self._spawn()
        if not self.procs and not self.disabled:
            self.disabled = True
            self.log("no compile workers left: compiling in this process from now on")

    def result(self, config, flags, causal, timeout: float = 180.0, d=None, dtype="bfloat16") -> dict | None:
        """The worker's report (status, ptx_hash, shared, n_regs, n_spills, error), or None: compile here."""
        key = self.key(config, flags, causal, d, dtype)
        if key not in self.submitted:
            return None
        deadline = time.time() + timeout
        while key not in self.results:
            self._poll()
            if key in self.results:
                break
            if self.disabled:
                return None
            if time.time() > deadline:
                for wid, running in list(self.running.items()):
                    if running == key:  # a hung compile: stop that worker (it is replaced)
                        self.procs[wid].terminate()
                self.results[key] = {"status": "failed", "in_triton": True,
                                     "error": f"no compile result within {timeout:.0f} s"}
                break
            time.sleep(0.01)
        return self.results[key]

    def close(self) -> None:
        if self.jobs <= 0 or not hasattr(self, "tasks"):
            return
        self.tasks.cancel_join_thread()  # exit even with candidates still queued
        for proc in self.procs.values():  # only the workers this script started
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            proc.join(timeout=5)
        self.procs = {}
        self.disabled = True
        try:  # keep the compiler output that comes back with the JSON small
            if self.log_path and os.path.getsize(self.log_path) > 2 << 20:
                os.truncate(self.log_path, 2 << 20)
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--quick", action="store_true",
                        help="fewer configs (3 block shapes, 2-3 stages) and variant combos on the top config only")
    parser.add_argument("--jobs", type=int, default=None,
                        help="compile worker processes (default: CPU cores - 2, at most 14; 0 = compile inline)")
    parser.add_argument("--top", type=int, default=None,
                        help=f"configs given the variant sweep: the N best over all cases (geometric mean), plus "
                             f"the best for {FOCUS_CASE} (default 3, --quick 1)")
    parser.add_argument("--budget-s", type=float, default=210.0,
                        help="start no new timing after this many seconds (default 210; the portability check of "
                             f"the winners may take {PORTABILITY_S} s more)")
    parser.add_argument("--rep-ms", type=int, default=None, help="do_bench rep time per timing (default 100, quick 40)")
    parser.add_argument("--cases", nargs="+", choices=[c[0] for c in CASES], help="subset of the cases")
    parser.add_argument("--no-variants", action="store_true", help="phase 1 (configs) only")
    parser.add_argument("--no-reference", action="store_true", help="skip the torch SDPA / flash-attn timings")
    parser.add_argument("--plan", action="store_true", help="print the candidates and exit (no GPU needed)")
    parser.add_argument("--cpu-selftest", action="store_true", help=argparse.SUPPRESS)  # tiny shapes, interpreter
    args = parser.parse_args(argv)
    if args.top is None:
        args.top = 1 if args.quick else 3
    if args.rep_ms is None:
        args.rep_ms = 40 if args.quick else 100
    if args.jobs is None:
        args.jobs = max(0, min(14, (os.cpu_count() or 2) - 2))
    if args.cpu_selftest:
        _selftest_setup()
        args.jobs = 0
    return args


def _selftest_setup() -> None:
    """--cpu-selftest exercises the whole flow on CPU: Triton interpreter, fp32, tiny shapes, no compile workers."""
    global H, KVH, D, CASES, BLOCKS, QUICK_BLOCKS, WARPS, STAGES, QUICK_STAGES
    H, KVH, D = 4, 2, 32
    CASES = [("causal_8k", 40, 40, True), ("causal_32k", 72, 72, True), ("noncausal_8k_32k", 24, 56, False)]
    BLOCKS = QUICK_BLOCKS = [(16, 16), (32, 16)]
    WARPS, STAGES, QUICK_STAGES = [4], [1, 2], [1]
    os.environ["TRITON_INTERPRET"] = "1"


def print_plan(args) -> None:
    cases = [c for c in CASES if not args.cases or c[0] in args.cases]
    configs, pruned = phase1_configs(args.quick)
    names = ["REVERSE_M", "HEADS_OUTER", "FUSED_SCALE", "USE_TMA", "WARP_SPECIALIZE"]
    try:
        names = list(_import_attention().ATTN_VARIANTS)
    except Exception:  # noqa: BLE001
        pass
    combos = [] if args.no_variants else variant_combos(names, args.quick)
    kinds = len({c[3] for c in cases})
    print(f"cases: {', '.join(f'{n} (Sq={sq}, Sk={sk}, causal={c})' for n, sq, sk, c in cases)}")
    print(f"phase 1: {len(configs)} configs x {len(cases)} cases = {len(configs) * len(cases)} timings, "
          f"{len(configs) * kinds} compiles")
    for cfg, why in pruned:
        print(f"  pruned {cfg}: {why}")
    top = args.top + 1
    print(f"phase 2: {len(combos)} variant combos x {args.top}..{top} configs x {len(cases)} cases = up to "
          f"{len(combos) * top * len(cases)} timings, {len(combos) * top * kinds} compiles "
          "(fewer where a flag compiles to the same PTX)")
    print(f"variant flags: {', '.join(names)}")
    for combo in combos:
        print(f"  {flags_label(combo)}")
    print(f"compile workers: {args.jobs}; budget {args.budget_s:.0f} s; do_bench rep {args.rep_ms} ms")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plan:
        print_plan(args)
        return 0

    import torch

    selftest = args.cpu_selftest
    if not torch.cuda.is_available() and not selftest:
        print("tune_attention.py needs a CUDA GPU (use --plan to list the candidates)", file=sys.stderr)
        return 2
    t0 = time.time()
    if not selftest:
        os.environ.pop("TRITON_INTERPRET", None)
    import triton
    import triton.testing

    attention = _import_attention()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    def over_budget() -> bool:
        return time.time() - t0 > args.budget_s

    if selftest:
        dev, dtype, cap = torch.device("cpu"), torch.float32, (9, 0)

        class props:  # noqa: N801
            name, multi_processor_count = "cpu (Triton interpreter self-test)", 0
        default_cfg = tuple(attention.INTERPRET_CONFIG)
    else:
        dev, dtype = torch.device("cuda"), torch.bfloat16
        props = torch.cuda.get_device_properties(dev)
        cap = torch.cuda.get_device_capability(dev)
        default_cfg = tuple(attention.GPU_CONFIGS[D])
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def bench(fn) -> float:
        if selftest:  # no CUDA events here
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        try:
            return float(triton.testing.do_bench(fn, warmup=25, rep=args.rep_ms, return_mode="median"))
        except TypeError:  # older triton: no return_mode
            return float(triton.testing.do_bench(fn, warmup=25, rep=args.rep_ms))

    default_flags = dict(attention.ATTN_VARIANTS)
    names = list(attention.ATTN_VARIANTS)
    unavailable = {}
    if not attention.HAS_WARP_SPECIALIZE:
        unavailable["WARP_SPECIALIZE"] = f"triton {triton.__version__} has no tl.range(warp_specialize)"
    if attention.TensorDescriptor is None or cap[0] < 9:
        unavailable["USE_TMA"] = "needs sm_90+ and triton.tools.tensor_descriptor"
    flag_names = [n for n in names if n not in unavailable]
    scale = 1.0 / math.sqrt(D)
    cases = [c for c in CASES if not args.cases or c[0] in args.cases]
    report = {
        "mode": "cpu-selftest" if selftest else "cuda", "device": props.name, "capability": list(cap),
        "sms": props.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "default": {"config": list(default_cfg), "variants": default_flags},
        "unavailable_variants": unavailable, "cases": {}, "best_overall": None,
    }
    log(f"{props.name} sm_{cap[0]}{cap[1]}, torch {torch.__version__}, triton {triton.__version__}; "
        f"default config {default_cfg} variants {flags_label(default_flags)}")
    for name, why in unavailable.items():
        log(f"variant {name} not tried: {why}")

    last_write = [0.0]

    def write_json(every_s: float = 0.0) -> None:
        """Every result so far (also while sweeping: a crash of this process keeps what was measured)."""
        if args.json and time.time() - last_write[0] >= every_s:
            last_write[0] = time.time()
            report["elapsed_s"] = round(time.time() - t0, 1)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.json.with_name(args.json.name + ".tmp")
            tmp.write_text(json.dumps(report, indent=1, default=str))
            os.replace(tmp, args.json)

    def on_term(signum, frame):  # timeout(1) and the like: keep what was measured
        raise SystemExit(f"signal {signum}")

    old_term = signal.signal(signal.SIGTERM, on_term)

    compiler = None
    try:
        # --- inputs and the shipped kernel's output per case
        state = {}
        for name, sq, sk, causal in cases:
            g = torch.Generator(device=dev).manual_seed(sq * 7 + sk)
            mk = lambda *s, g=g: torch.randn(*s, generator=g, device=dev, dtype=dtype)  # noqa: E731
            q, k, v = mk(sq, H, D), mk(sk, KVH, D), mk(sk, KVH, D)
            pairs = visible_pairs(sq, sk, causal)
            st = dict(name=name, sq=sq, sk=sk, causal=causal, q=q, k=k, v=v, flops=4.0 * pairs * H * D,
                      o=torch.empty_like(q), lse=torch.empty((H, sq), dtype=torch.float32, device=dev),
                      results=[], by_key={}, by_binary={})
            state[name] = st
            report["cases"][name] = {"Sq": sq, "Sk": sk, "causal": causal, "H": H, "KVH": KVH, "D": D,
                                     "dtype": str(dtype).replace("torch.", ""), "visible_pairs": pairs,
                                     "tflop": st["flops"] / 1e12, "results": st["results"], "reference": {}}
        configs, pruned = phase1_configs(args.quick)
        report["pruned"] = [{"config": list(c), "why": why} for c, why in pruned]
        kinds = sorted({st["causal"] for st in state.values()})
        off = {n: False for n in names}
        base_flags = {n: False for n in names}
        compile_log = (str(args.json.with_suffix(".compile.log")) if args.json
                       else os.path.join(tempfile.gettempdir(), "tune_attention.compile.log"))
        if args.jobs > 0:
            open(compile_log, "w").close()
        compiler = Compiler(args.jobs, log, compile_log)
        for causal in kinds:
            compiler.submit(default_cfg, default_flags, causal)
        for cfg in configs:
            for causal in kinds:
                compiler.submit(cfg, base_flags, causal)
        if not compiler.disabled:
            log(f"{args.jobs} compile workers started on {len(compiler.submitted)} phase-1 kernels "
                f"(their compiler output: {compile_log})")

        compiled_kinds = set()
        for st in state.values():
            t = time.time()
            attention._launch_flash_fwd(st["q"], st["k"], st["v"], st["o"], st["lse"], scale, st["causal"],
                                        default_cfg, default_flags)
            sync()
            st["ref_o"], st["ref_lse"] = st["o"].clone(), st["lse"].clone()
            if st["causal"] not in compiled_kinds:
                compiled_kinds.add(st["causal"])
                log(f"default kernel compiled (causal={st['causal']}) in {time.time() - t:.1f} s")

        # --- the shipped kernel against the fp32 reference on one GQA group (and 2048 query rows)
        group = H // KVH
        for st in state.values():
            # The last rows (the longest causal ones) against all keys: bottom-right alignment keeps their mask.
            rows = slice(st["sq"] - min(2048, st["sq"]), st["sq"])
            qs = st["q"][rows, :group]
            ks, vs = st["k"][:, :1], st["v"][:, :1]
            ro, rlse = attention.flash_attn_with_lse_reference(qs, ks, vs, scale, st["causal"])
            o, lse = st["ref_o"][rows, :group].float(), st["ref_lse"][:group, rows]
            rel = ((o - ro.float()).norm() / ro.float().norm()).item()
            dl = (lse - rlse).abs().max().item()
            ok = rel < 1e-2 and dl < LSE_TOL
            report["cases"][st["name"]]["default_vs_fp32_reference"] = {"rel_err": rel, "lse_max_diff": dl,
                                                                        "ok": ok}
            log(f"{st['name']}: shipped kernel vs fp32 reference (heads 0-{group - 1}, last {qs.shape[0]} rows): "
                f"rel err {rel:.2e}, lse diff {dl:.2e} {'ok' if ok else 'MISMATCH'}")
            del ro, rlse
        if dev.type == "cuda":
            torch.cuda.empty_cache()

        # --- reference implementations (while the workers compile)
        if not args.no_reference:
            time_references(state, report, log, torch, bench, scale)

        def run_candidate(st, cfg, flags) -> dict:
            label = flags_label(flags)
            key = (tuple(cfg), tuple(sorted(flags.items())))
            if key in st["by_key"]:
                return st["by_key"][key]
            row = {"config": list(cfg), "variants": sorted(n for n, on in flags.items() if on), "status": "ok"}
            st["by_key"][key] = row
            st["results"].append(row)
            eff = attention.effective_attn_variants(st["q"], st["k"], st["v"], st["o"], scale, flags)
            if {n: eff[n] for n in flags} != flags:
                row.update(status="skipped", error=f"variant unavailable here (effective {flags_label(eff)})")
                return row
            wait_s = max(10.0, args.budget_s + 30 - (time.time() - t0))
            info = compiler.result(cfg, flags, st["causal"], timeout=wait_s)
            if info:
                for field in ("ptx_hash", "shared", "n_regs", "n_spills"):
                    if field in info:
                        row[field] = info[field]
                row["compile_s"] = info.get("seconds")
                if info["status"] != "ok" and info.get("in_triton", True):
                    row.update(status="failed", error=info.get("error", "compile failed"))
                    log(f"{st['name']}: {cfg} {label}: FAILED {row['error'][:160]}")
                    return row
                same = st["by_binary"].get((info.get("ptx_hash"), bool(flags.get("HEADS_OUTER"))))
                if info.get("ptx_hash") and same is not None and same["status"] == "ok":
                    row.update({f: same[f] for f in ("ms", "tflops", "speedup_vs_default", "max_abs_diff",
                                                      "lse_max_diff") if f in same})
                    row["same_binary_as"] = f"{tuple(same['config'])} {'+'.join(same['variants']) or '-'}"
                    return row
            q, k, v, o, lse = st["q"], st["k"], st["v"], st["o"], st["lse"]
            try:
                o.fill_(float("nan"))
                lse.fill_(float("nan"))
                attention._launch_flash_fwd(q, k, v, o, lse, scale, st["causal"], cfg, flags)
                sync()
            except Exception as exc:  # noqa: BLE001
                msg = str(exc).strip().splitlines()
                row.update(status="failed", error=f"{type(exc).__name__}: {msg[-1] if msg else ''}"[:300])
                log(f"{st['name']}: {cfg} {label}: FAILED {row['error'][:160]}")
                if "illegal" in str(exc).lower() or "CUDA error" in str(exc):
                    raise  # the CUDA context is gone: nothing after this can run
                return row
            ref_o, ref_lse = st["ref_o"], st["ref_lse"]
            diff = (o.float() - ref_o.float()).abs()
            excess = (diff - (ATOL + RTOL * ref_o.float().abs())).max().item()
            row["max_abs_diff"] = diff.max().item()
            del diff
            same_inf = torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
            fin = torch.isfinite(ref_lse)
            row["lse_max_diff"] = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
            bad_o = bool(o.isnan().any()) or not excess <= 0
            if bad_o or lse.isnan().any() or not same_inf or not row["lse_max_diff"] <= LSE_TOL:
                row.update(status="wrong", error=f"output differs from the shipped kernel: max|diff| "
                                                 f"{row['max_abs_diff']:.3g}, lse diff {row['lse_max_diff']:.3g}")
                log(f"{st['name']}: {cfg} {label}: WRONG {row['error']}")
                return row
            try:
                ms = bench(lambda: attention._launch_flash_fwd(q, k, v, o, lse, scale, st["causal"], cfg, flags))
            except Exception as exc:  # noqa: BLE001
                row.update(status="failed", error=f"timing: {type(exc).__name__}: {exc}"[:300])
                return row
            row["ms"] = ms
            row["tflops"] = st["flops"] / ms / 1e9
            if "ptx_hash" in row:
                st["by_binary"].setdefault((row["ptx_hash"], bool(flags.get("HEADS_OUTER"))), row)
            return row

        def sweep(candidates, phase: str) -> None:
            for cfg, flags in candidates:
                if over_budget():
                    log(f"budget of {args.budget_s:.0f} s spent: {phase} stops here")
                    report.setdefault("stopped_early", []).append(phase)
                    return
                rows = [run_candidate(state[name], cfg, flags) for name in state]
                write_json(every_s=5.0)
                log(f"{phase} {cfg} {flags_label(flags):<40} " + "  ".join(
                    f"{st_name} {r['ms']:.3f} ms {r['tflops']:.0f} TF/s" if r.get("ms") else f"{st_name} {r['status']}"
                    for st_name, r in zip(state, rows)))

        # --- phase 1: every config, variants at the shipped default
        default_key = (tuple(default_cfg), tuple(sorted(default_flags.items())))
        phase1 = [(default_cfg, dict(default_flags))]
        phase1 += [(cfg, dict(base_flags)) for cfg in configs if (tuple(cfg), tuple(sorted(base_flags.items())))
                   != default_key]
        sweep(phase1, "phase 1")
        for st in state.values():
            st["default_ms"] = st["by_key"].get(default_key, {}).get("ms")

        # --- phase 2: variant combos on the best configs
        if not args.no_variants and flag_names:
            scores = rank_candidates(state, lambda row: tuple(sorted(row["variants"])) == tuple(
                sorted(n for n, on in base_flags.items() if on)))
            top = [cfg for cfg, _ in scores[:args.top]]
            focus = state.get(FOCUS_CASE)  # the case that matters most also gets its own best config
            ok = [r for r in focus["results"] if r.get("ms") and not r["variants"]] if focus else []
            if ok:
                best = tuple(min(ok, key=lambda r: r["ms"])["config"])
                if best not in top:
                    top.append(best)
            combos = [{**off, **c} for c in variant_combos(flag_names, args.quick)]
            phase2 = [(cfg, flags) for flags in combos for cfg in top]
            report["phase2_configs"] = [list(c) for c in top]
            for cfg, flags in phase2:
                for causal in kinds:
                    compiler.submit(cfg, flags, causal)
            log(f"phase 2: {len(combos)} variant combos on configs {top} ({len(phase2)} candidates)")
            sweep(phase2, "phase 2")

        # --- the best flag sets with every head dim's and dtype's shipped config
        if not args.no_variants:
            sets = []
            for (_, variants), _ in overall_ranking(state):
                if variants and variants not in sets:
                    sets.append(variants)
            if sets[:3]:
                log(f"portability of the {len(sets[:3])} fastest flag sets to every head dim and dtype")
                check_portability(sets[:3], attention, compiler, torch, log, report,
                                  lambda: args.budget_s + PORTABILITY_S - (time.time() - t0), dev,
                                  *((40, 88) if selftest else (320, 704)), selftest=selftest)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if compiler is not None:
            compiler.close()
        try:
            summarize(report, state if "state" in locals() else {}, log)
        finally:
            write_json()
            if args.json:
                print(f"wrote {args.json}", flush=True)
    return 0


def _reference_runs(st, scale):
    """[(label, fn, fn's output -> o [Sq, H, D])] for torch SDPA (flash, cuDNN) and flash-attn where installed."""
    import torch.nn.functional as F

    q, k, v, causal = st["q"], st["k"], st["v"], st["causal"]
    runs = []
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        sdpa_kernel = None
    if sdpa_kernel is not None and (not causal or st["sq"] == st["sk"]):  # SDPA's causal mask is top-left aligned
        group = H // KVH
        q4 = q.transpose(0, 1)[None].contiguous()  # [1, H, Sq, D]
        k4 = k.repeat_interleave(group, dim=1).transpose(0, 1)[None].contiguous()  # [1, H, Sk, D]
        v4 = v.repeat_interleave(group, dim=1).transpose(0, 1)[None].contiguous()
        for label, backend in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION")):
            if hasattr(SDPBackend, backend):
                def sdpa(be=getattr(SDPBackend, backend)):
                    with sdpa_kernel([be]):
                        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, scale=scale)
                runs.append((label, sdpa, lambda out: out[0].transpose(0, 1)))
    try:  # flash-attn 2: GQA and a bottom-right causal mask, like ours
        from flash_attn import flash_attn_func as fa2

        runs.append(("flash_attn", lambda: fa2(q[None], k[None], v[None], softmax_scale=scale, causal=causal),
                     lambda out: out[0]))
    except Exception:  # noqa: BLE001
        pass
    try:  # flash-attn 3 (Hopper)
        from flash_attn_interface import flash_attn_func as fa3

        def fa3_run():
            out = fa3(q[None], k[None], v[None], softmax_scale=scale, causal=causal)
            return out[0] if isinstance(out, tuple) else out
        runs.append(("flash_attn3", fa3_run, lambda out: out[0]))
    except Exception:  # noqa: BLE001
        pass
    return runs


def time_references(state, report, log, torch, bench, scale) -> None:
    for st in state.values():
        refs = report["cases"][st["name"]]["reference"]
        try:
            runs = _reference_runs(st, scale)
        except Exception as exc:  # noqa: BLE001  (e.g. out of memory for the repeated k/v)
            refs["error"] = f"{type(exc).__name__}: {exc}"[:300]
            runs = []
        for label, fn, to_o in runs:
            try:
                out = to_o(fn())
                diff = (out.float() - st["ref_o"].float()).abs().max().item()
                del out
                ms = bench(fn)
                refs[label] = {"ms": ms, "tflops": st["flops"] / ms / 1e9, "max_abs_diff_vs_default": diff}
                log(f"{st['name']}: {label} {ms:.3f} ms {st['flops'] / ms / 1e9:.0f} TFLOP/s "
                    f"(max|diff| vs ours {diff:.2g})")
            except Exception as exc:  # noqa: BLE001
                refs[label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                log(f"{st['name']}: {label} failed: {refs[label]['error'][:160]}")
        del runs
        if st["q"].is_cuda:
            torch.cuda.empty_cache()


def rank_candidates(state, pick=lambda row: True):
    """[(config, geomean time / default time over the cases), ...] best first, for candidates measured and checked
    in every case (pick filters the rows)."""
    by_cfg = {}
    for st in state.values():
        base = st.get("default_ms")
        for row in st["results"]:
            if row.get("ms") and base and pick(row):
                by_cfg.setdefault(tuple(row["config"]), []).append(row["ms"] / base)
    full = [(cfg, math.exp(sum(map(math.log, r)) / len(r))) for cfg, r in by_cfg.items() if len(r) == len(state)]
    return sorted(full, key=lambda x: x[1])


def overall_ranking(state):
    """[((config, variants), geometric mean over the cases of time / default time)], best first; candidates
    measured and checked in every case."""
    rows = {}
    for st in state.values():
        base = st.get("default_ms")
        for r in st["results"]:
            if r.get("ms") and base:
                rows.setdefault((tuple(r["config"]), tuple(r["variants"])), []).append(r["ms"] / base)
    full = [(key, math.exp(sum(map(math.log, v)) / len(v))) for key, v in rows.items() if len(v) == len(state)]
    return sorted(full, key=lambda x: x[1])


def check_portability(variant_sets, attention, compiler, torch, log, report, time_left, dev="cuda",
                      sq=320, sk=704, selftest=False) -> None:
    """ATTN_VARIANTS applies to every head dim and dtype: run each flag set once with the shipped config of
    every GPU_CONFIGS / GPU_CONFIGS_FP32 entry (H=32, KVH=8, Sq=320, Sk=704, causal) against the fp32 reference."""
    names = list(attention.ATTN_VARIANTS)
    plans = []
    for variants in variant_sets:
        flags = {n: (n in variants) for n in names}
        for d in attention.SUPPORTED_HEAD_DIMS:
            for dtype, table in (("bfloat16", attention.GPU_CONFIGS), ("float32", attention.GPU_CONFIGS_FP32)):
                if selftest and dtype != "float32":
                    continue  # the interpreter mishandles bf16 tl.dot
                cfg = tuple(attention.INTERPRET_CONFIG if selftest else table[d])
                plans.append((variants, flags, d, dtype, cfg))
                compiler.submit(cfg, flags, True, d, dtype)
    out = report.setdefault("portability", {})
    for variants, flags, d, dtype, cfg in plans:
        label = "+".join(variants)
        if time_left() <= 0:
            log(f"portability: budget spent before {label} D={d} {dtype}")
            return
        entry = out.setdefault(label, {})
        info = compiler.result(cfg, flags, True, timeout=max(10.0, time_left()), d=d, dtype=dtype)
        if info and info["status"] != "ok" and info.get("in_triton", True):
            entry[f"D{d}_{dtype}"] = {"config": list(cfg), "status": "failed", "error": info.get("error")}
            log(f"portability {label}: D={d} {dtype} {cfg}: FAILED {info.get('error', '')[:120]}")
            continue
        g = torch.Generator(device=dev).manual_seed(d)
        q, k, v = (torch.randn(n, h, d, generator=g, device=dev, dtype=getattr(torch, dtype))
                   for n, h in ((sq, H), (sk, KVH), (sk, KVH)))
        o = torch.full_like(q, float("nan"))
        lse = torch.full((H, sq), float("nan"), device=dev)
        scale = 1 / math.sqrt(d)
        try:
            attention._launch_flash_fwd(q, k, v, o, lse, scale, True, cfg, flags)
            if q.is_cuda:
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"[:300]
            entry[f"D{d}_{dtype}"] = {"config": list(cfg), "status": "failed", "error": error}
            log(f"portability {label}: D={d} {dtype} {cfg}: FAILED {error[:120]}")
            if "illegal" in str(exc).lower() or "CUDA error" in str(exc):
                raise
            continue
        ro, rlse = attention.flash_attn_with_lse_reference(q, k, v, scale, True)
        rel = ((o.float() - ro.float()).norm() / ro.float().norm()).item()
        dl = (lse - rlse).abs().max().item()
        tol = 1e-2 if dtype != "float32" else (3e-3 if q.is_cuda else 1e-4)
        ok = not o.isnan().any() and rel < tol and dl < 20 * tol
        entry[f"D{d}_{dtype}"] = {"config": list(cfg), "status": "ok" if ok else "wrong", "rel_err": rel,
                                  "lse_max_diff": dl}
        if not ok:
            log(f"portability {label}: D={d} {dtype} {cfg}: WRONG rel err {rel:.3g}, lse diff {dl:.3g}")
    for label, entry in out.items():
        bad = [k for k, e in entry.items() if e["status"] != "ok"]
        log(f"portability {label}: " + ("ok for every head dim and dtype" if not bad else f"fails for {bad}"))


def summarize(report, state, log, show: int = 30) -> None:
    if not state:
        return
    dcfg = report["default"]["config"]
    dvar = sorted(n for n, on in report["default"]["variants"].items() if on)
    for st in state.values():
        if not st.get("default_ms"):  # stopped inside phase 1
            st["default_ms"] = next((r.get("ms") for r in st["results"]
                                     if r["config"] == dcfg and r["variants"] == dvar), None)
        base = st.get("default_ms")
        for row in st["results"]:
            if row.get("ms") and base:
                row["speedup_vs_default"] = base / row["ms"]
        case = report["cases"][st["name"]]
        ok = sorted((r for r in st["results"] if r.get("ms")), key=lambda r: r["ms"])
        bad = [r for r in st["results"] if r["status"] != "ok"]
        print(f"\n== {st['name']}: Sq={st['sq']} Sk={st['sk']} causal={st['causal']} H={H} KVH={KVH} D={D} "
              f"{report['cases'][st['name']]['dtype']}, "
              f"{st['flops'] / 1e12:.2f} TFLOP of visible pairs; default "
              f"{f'{base:.3f} ms' if base else 'not measured'}")
        print(f"{'rank':>4} {'BM':>4} {'BN':>4} {'W':>2} {'S':>2}  {'variants':<44} {'ms':>8} {'TFLOP/s':>8} "
              f"{'x dflt':>7} {'max|d|':>8} {'regs':>5} {'spill':>5}")
        for i, r in enumerate(ok[:show], 1):
            bm, bn, w, s = r["config"]
            note = "  (same PTX as " + r["same_binary_as"] + ")" if r.get("same_binary_as") else ""
            print(f"{i:>4} {bm:>4} {bn:>4} {w:>2} {s:>2}  {'+'.join(r['variants']) or '-':<44} {r['ms']:>8.3f} "
                  f"{r['tflops']:>8.1f} {r.get('speedup_vs_default', float('nan')):>7.3f} "
                  f"{r.get('max_abs_diff', float('nan')):>8.1e} {r.get('n_regs', ''):>5} {r.get('n_spills', ''):>5}"
                  f"{note}")
        if len(ok) > show:
            print(f"     ... {len(ok) - show} slower candidates in the JSON")
        for name, ref in case["reference"].items():
            if "ms" in ref:
                print(f"     reference {name:<38} {ref['ms']:>8.3f} ms {ref['tflops']:>8.1f} TFLOP/s")
        groups = {}
        for r in bad:
            groups.setdefault((r["status"], r.get("error", "")[:140]), []).append(r)
        for (status, error), rows in groups.items():
            examples = ", ".join(f"{tuple(r['config'])} {'+'.join(r['variants']) or '-'}" for r in rows[:3])
            print(f"     {status} x{len(rows)}: {error}\n         e.g. {examples}")
        if ok:
            case["best"] = ok[0]
    print("\n== best per case")
    for st in state.values():
        best = report["cases"][st["name"]].get("best")
        refs = report["cases"][st["name"]]["reference"]
        ref_txt = ", ".join(f"{n} {r['ms']:.3f} ms" for n, r in refs.items() if "ms" in r)
        if best:
            print(f"{st['name']:<18} {tuple(best['config'])} {'+'.join(best['variants']) or '-'}: "
                  f"{best['ms']:.3f} ms, {best['tflops']:.1f} TFLOP/s, "
                  f"x{best.get('speedup_vs_default', float('nan')):.3f} "
                  f"vs default{'; ' + ref_txt if ref_txt else ''}")
        else:
            print(f"{st['name']:<18} nothing measured")
    # one setting for every case: geometric mean of time / default time over the cases
    ranking = overall_ranking(state)
    if not ranking:
        return
    port = report.get("portability", {})

    def portable(variants) -> bool | None:
        if not variants:
            return True  # the default code, as shipped
        entry = port.get("+".join(variants))
        return None if not entry else all(e["status"] == "ok" for e in entry.values())

    (cfg, variants), ratio = ranking[0]
    flags = {n: (n in variants) for n in report["default"]["variants"]}
    report["best_overall"] = {"config": list(cfg), "variants": flags, "geomean_time_vs_default": ratio,
                              "portable": portable(variants)}
    pick = next(((c, v, r) for (c, v), r in ranking if portable(v) is not False), None)
    if pick and (pick[0], pick[1]) != (cfg, variants):
        print(f"\n== fastest over all cases: {cfg} {'+'.join(variants)} (geometric mean time {ratio:.3f} x default), "
              "but it FAILS on another head dim or dtype (see portability in the JSON)")
        cfg, variants, ratio = pick
        flags = {n: (n in variants) for n in report["default"]["variants"]}
    checked = portable(variants)
    report["recommended"] = {"config": list(cfg), "variants": flags, "geomean_time_vs_default": ratio,
                             "portable": checked}
    note = "" if checked else " -- flags NOT checked on the other head dims / dtypes: run the GPU tests"
    print(f"\n== recommended: best over all cases (geometric mean time {ratio:.3f} x default){note}; "
          "in sparsekv/kernels/attention.py:")
    print(f"    GPU_CONFIGS[{D}] = {cfg}")
    print("    ATTN_VARIANTS: dict[str, bool] = {" + ", ".join(f'"{n}": {on}' for n, on in flags.items()) + "}")


if __name__ == "__main__":
    sys.exit(main())
