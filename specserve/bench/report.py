"""Output of the user-facing benchmark commands (``bench-speculative``, ``bench-serving``, ``bench-compare``):
one JSON object per line (JSONL, one per measured configuration), a readable table, and a PNG plot.

Everything here is a pure function of the rows, so the commands stay small and the formats stay alike. The plots
and ``bench-serving``'s client come from the optional ``bench`` extra (matplotlib, openai), imported when used.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import sys
from collections.abc import Sequence

BENCH_EXTRA = "pip install 'specserve[bench]'"


def missing_extra(*modules: str) -> str | None:
    """None when every module of the ``bench`` extra named is installed, else one line naming the missing ones
    and the install command."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return f"{' and '.join(missing)} not installed (needed by the benchmark commands): {BENCH_EXTRA}"


def report_missing_extra(prog: str, *modules: str) -> bool:
    """True (after printing an argparse-style error naming the install command) when a module of the ``bench``
    extra is missing: the benchmark commands then exit 2 before running anything."""
    problem = missing_extra(*modules)
    if problem:
        print(f"{prog}: error: {problem}", file=sys.stderr)
    return problem is not None


def import_extra(module: str):
    """Import a module of the ``bench`` extra; when it is missing, an ImportError naming the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(missing_extra(module) or str(e)) from e


def _pyplot():
    import_extra("matplotlib").use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    return plt


def write_jsonl(rows: Sequence[dict], path: str) -> str:
    """Write one JSON object per line (creating the folder); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=False) + "\n")
    return path


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _cell(value, fmt: str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return format(value, fmt or ".2f")
    return str(value)


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str | None]]) -> str:
    """A markdown table: columns are (key in the row, header, float format or None)."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---:" if f else "---" for _, _, f in columns) + "|"
    body = ["| " + " | ".join(_cell(r.get(k), f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    """{'mean', 'p50', 'p90', 'p99'} by linear interpolation between order statistics (NaN when empty)."""
    if not values:
        return {"mean": math.nan, **{f"p{q}": math.nan for q in qs}}
    xs = sorted(values)
    out = {"mean": sum(xs) / len(xs)}
    for q in qs:
        pos = (len(xs) - 1) * q / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        out[f"p{q}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


def plot_lines(series: dict[str, tuple[Sequence[float], Sequence[float]]], path: str, *, title: str,
               xlabel: str, ylabel: str, logx: bool = False) -> str:
    """One line per series name: (xs, ys). Writes a PNG (matplotlib, no display needed); returns the path."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bars(labels: Sequence[str], values: Sequence[float], path: str, *, title: str, ylabel: str,
              reference: float | None = None) -> str:
    """A bar chart (e.g. speed-up ratios), with an optional horizontal reference line (e.g. 1.0x)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(labels) + 2), 4.5))
    ax.bar(range(len(labels)), list(values))
    ax.set_xticks(range(len(labels)), list(labels), rotation=30, ha="right", fontsize=8)
    if reference is not None:
        ax.axhline(reference, color="k", linestyle="--", linewidth=1)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
