"""How Triton pipelines block_sparse_attention's loops on sm_90, without a GPU: compile for an H100 (Triton's bundled
ptxas) and print, per loop variant and for the dense kernel, the K/V shared-memory buffers of each pipelined loop
(3 = K/V two tiles ahead at 3 stages), whether ptxas serialized the wgmma instructions (its C7515 note), and the
SASS size of each loop body.

    python scripts/inspect_bsa_pipeline.py [--head-dim 128 --block 128 128 --warps 8 --stages 3]

Needs Triton's NVIDIA backend (ptxas, nvdisasm); touches no device. Results depend on the Triton version: compare
with the GPU machine's (docs/benchmarks.md names it).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret (set before triton is imported)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sparsekv.kernels import attention as dense_module  # noqa: E402
from sparsekv.policies.xattn import block_sparse_attention as bsa  # noqa: E402

STRIDES = ["stride_qm", "stride_qh", "stride_qd", "stride_kn", "stride_kh", "stride_kd", "stride_vn", "stride_vh",
           "stride_vd", "stride_om", "stride_oh", "stride_od", "stride_lh", "stride_lm"]


def _compile(fn, signature: dict[str, str], constexprs: dict[str, object], warps: int, stages: int):
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def _loop_sizes(sass: str) -> list[int]:
    """Instruction counts of the SASS loops (a branch back to an earlier label), innermost first."""
    labels: dict[str, int] = {}
    sizes, count = [], 0
    for line in sass.splitlines():
        label = re.match(r"\s*(\.?L\w+|LBB\w+):", line)
        if label:
            labels[label.group(1)] = count
            continue
        if line.rstrip().endswith(";"):
            target = re.search(r"BRA\s+`?\(?(\.?L\w+|LBB\w+)", line)
            if target and target.group(1) in labels:
                sizes.append(count - labels[target.group(1)] + 1)
            count += 1
    return [s for s in sizes if s > 100]  # drop the tiny spin loops of barrier waits


def report(name: str, kernel) -> None:
    ptxas = get_ptxas(90).path  # the ptxas Triton itself compiles sm_90 with
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=False).stderr
    if "Used" not in info:
        raise RuntimeError(f"ptxas failed on {name}: {info[-500:]}")
    buffers = re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", kernel.asm["ttgir"])
    regs = re.search(r"Used (\d+) registers", info)
    print(f"{name:34s} K/V buffers per loop {','.join(buffers[::2]) or '-':8s} "
          f"wgmma serialized {'YES' if 'C7515' in info else 'no ':3s}  registers {regs.group(1) if regs else '?':4s} "
          f"shared {kernel.metadata.shared:6d} B  loop bodies (SASS) {_loop_sizes(kernel.asm['sass'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, nargs=2, default=(128, 128), metavar=("BLOCK_M", "BLOCK_N"))
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=128, help="tokens per selection block")
    args = parser.parse_args()
    D, (bm, bn), warps, stages = args.head_dim, args.block, args.warps, args.stages
    desc_n, desc_m = f"tensordesc<bf16[{bn}, {D}]>", f"tensordesc<bf16[{bm}, {D}]>"
    print(f"Triton {triton.__version__}, sm_90, bf16, D={D}, {bm}x{bn} tiles, {warps} warps, {stages} stages")

    sig = {"Q": desc_m, "K": desc_n, "V": desc_n, "O": desc_m, "LSE": "*fp32",
           **{name: "i32" for name in STRIDES}, "Sq": "i32", "Sk": "i32", "qk_scale": "fp32"}
    flags = dict(dense_module.ATTN_VARIANTS, FUSED_SCALE=True, USE_TMA=True)
    constexprs = {"GROUP": 4, "HEAD_DIM": D, "BLOCK_M": bm, "BLOCK_N": bn, "IS_CAUSAL": True, **flags}
    report("dense kernel (causal)", _compile(dense_module._flash_fwd_kernel, sig, constexprs, warps, stages))

    sig = {"Q": "*bf16", "K": desc_n, "V": desc_n, "O": "*bf16", "LSE": "*fp32",
           **{name: "*i32" for name in ("IDX", "RUN_LO", "RUN_HI", "NFULL", "NRUNS", "DIAG")},
           **{name: "i32" for name in STRIDES + ["stride_ir", "n", "S", "q_start", "p_first"]}, "qk_scale": "fp32"}
    variants = {"old (lists, 3 stages)": bsa.LoopConfig(mode="lists", list_stages=stages),
                "lists": bsa.LoopConfig(mode="lists"), "runs": bsa.LoopConfig(mode="runs"), "auto": bsa.LOOP}
    for label, loop in variants.items():
        constexprs = {"GROUP": 4, "BLOCK_SIZE": args.block_size, "HEAD_DIM": D, "BLOCK_M": bm, "BLOCK_N": bn,
                      "TILES": args.block_size // bn, "FUSED_SCALE": True, "USE_TMA": True,
                      "LOOP_MODE": bsa.LOOP_MODES[loop.mode], "RUN_MIN_TILES": loop.run_min_tiles,
                      "LIST_STAGES": loop.list_stages or 2 * stages - 1}
        report(f"block-sparse {label}", _compile(bsa._bsa_fwd_kernel, sig, constexprs, warps, stages))


if __name__ == "__main__":
    main()
