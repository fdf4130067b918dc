"""tools/kernel_timeline.py's timeline: a device-to-device copy on the compute stream is busy time, not idle; events
named in `exclude` (host copies on the copy engines) are left out."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from kernel_timeline import timeline  # noqa: E402


def test_device_copies_are_busy_and_host_copies_can_be_left_out(tmp_path):
    events = [{"ph": "X", "cat": "kernel", "name": "attention", "ts": 0, "dur": 100},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 100, "dur": 30},
              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 140, "dur": 60},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 190, "dur": 50},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    kept, exposed, idle, span = timeline(str(trace), exclude=("HtoD", "DtoH"))
    assert [e["name"] for e in kept] == ["attention", "Memcpy DtoD (Device -> Device)", "gemm"]
    assert (idle, span) == (10.0, 200.0)  # the gap 130..140 only
    assert exposed["attention"] == 100.0 and exposed["gemm"] == 60.0
    _, _, idle_kernels_only, _ = timeline(str(trace), categories=("kernel",))
    assert idle_kernels_only == 40.0  # the copy counted as idle: what the exclude keeps apart
    _, _, idle_all, span_all = timeline(str(trace))
    assert (idle_all, span_all) == (10.0, 240.0)  # the host copy overlaps the gemm and extends the span
