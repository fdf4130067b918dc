"""Which kernels a decode step's time is spent in when they overlap (PDL): read a Chrome trace of
tools/profile_decode.py and attribute every instant of the GPU timeline to the kernels running then.

    python tools/kernel_timeline.py TRACE.json.gz [--steps N]

Per kernel name: launches, mean duration, and "exposed" microseconds per step: instants when it is the only kernel
running count in full, instants shared by k kernels count 1/k to each. Idle instants (no kernel) are summed apart.
With PDL a kernel may be resident long before its wait returns, so a long duration with little exposed time means it
mostly waited under its predecessor; exposed time is what removing or shortening it could save at most.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json


GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def timeline(trace_path: str, categories: tuple[str, ...] = GPU_EVENTS, exclude: tuple[str, ...] = ()
             ) -> tuple[list[dict], collections.Counter, float, float]:
    """A Chrome trace's GPU events of `categories`, less those whose name contains a string of `exclude` -> (the
    events, exposed us per kernel name, idle us, timeline span in us)."""
    with gzip.open(trace_path, "rt") if trace_path.endswith(".gz") else open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in categories
               and not any(part in e.get("name", "") for part in exclude)]
    edges = []
    for i, e in enumerate(kernels):
        edges.append((float(e["ts"]), 1, i))
        edges.append((float(e["ts"]) + float(e["dur"]), -1, i))
    edges.sort()
    running: set[int] = set()
    exposed = collections.Counter()
    idle = 0.0
    last = edges[0][0] if edges else 0.0
    for t, kind, i in edges:
        span = t - last
        if span > 0:
            if running:
                for j in running:
                    exposed[kernels[j]["name"]] += span / len(running)
            else:
                idle += span
        last = t
        if kind == 1:
            running.add(i)
        else:
            running.discard(i)
    total = (edges[-1][0] - edges[0][0]) if edges else 0.0
    return kernels, exposed, idle, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    kernels, exposed, idle, total = timeline(args.trace)
    count = collections.Counter(e["name"] for e in kernels)
    dur = collections.Counter()
    for e in kernels:
        dur[e["name"]] += float(e["dur"])
    s = args.steps
    print(f"timeline {total / s:.1f} us/step: kernels exposed {sum(exposed.values()) / s:.1f}, idle {idle / s:.1f}")
    print(f"{'exposed us/step':>15} {'busy us/step':>12} {'launches/step':>13} {'mean us':>8}  kernel")
    for name, us in exposed.most_common(args.top):
        print(f"{us / s:15.1f} {dur[name] / s:12.1f} {count[name] / s:13.1f} "
              f"{dur[name] / count[name]:8.2f}  {name[:90]}")


if __name__ == "__main__":
    main()
