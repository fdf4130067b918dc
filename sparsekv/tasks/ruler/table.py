"""task=ruler's printed table: accuracy per task (rows) and length (columns), then the per-length figures."""
from __future__ import annotations

from typing import Any, Callable


def _fmt(value: Any, render: Callable[[float], str]) -> str:
    return "-" if value is None else render(value)


def table_lines(f: dict[str, Any]) -> list[list[str]]:
    lengths = f["lengths"]
    cell = {(c["task"], c["length"]): c for c in f["cells"]}
    summary = {s["length"]: s for s in f["by_length"]}
    percent = (lambda v: f"{100 * v:.1f}%")
    lines = [["task \\ length", *[str(n) for n in lengths], "all"]]
    for name in f["tasks"]:
        lines.append([name, *[_fmt(cell[(name, n)]["accuracy"], percent) for n in lengths],
                      _fmt(f["accuracy_by_task"][name], percent)])
    lines.append(["all", *[_fmt(summary[n]["accuracy"], percent) for n in lengths], _fmt(f["accuracy"], percent)])
    for label, key, render in [("density", "density", lambda v: f"{v:.3f}"),
                               ("prefill s/sample", "prefill_seconds", lambda v: f"{v:.3f}"),
                               ("decode ms/token", "decode_ms_per_token", lambda v: f"{v:.2f}")]:
        lines.append([label, *[_fmt(summary[n][key], render) for n in lengths], ""])
    return lines


def print_table(f: dict[str, Any]) -> None:
    density = {s["density_source"] for s in f["by_length"]} - {None}
    print(f"ruler {f['name']}: model={f['model']} offload={f['offload']} policy={f['policy']} on {f['device']}, "
          f"{f['dtype']}, batch {f['batch_size']}, {f['samples']} samples per cell"
          + ("" if f["with_needles"] else ", without needles (chance level expected)")
          + (f", density: {', '.join(sorted(density))}" if density else ""))
    lines = table_lines(f)
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    for line in lines:
        print("  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))))
