"""Pictures of a `klevict bench` result: KL against budget per method with the 95 % intervals, cost against KL, the
KL measured against the `--max-kl` tolerance asked for, and retrieval accuracy against budget. matplotlib is an
optional extra (`pip install 'klevict[plot]'`); it is drawn with the Agg canvas directly, so no GUI backend or global
pyplot state is involved.
"""

from __future__ import annotations

import io
from pathlib import Path

from klevict_cli.errors import UsageError
from klevict_cli.results import SUBJECT, budgets, tolerances, windows_count

INSTALL = "pip install 'klevict[plot]'"
FORMATS = (".png", ".svg", ".pdf")


def check_plot_target(path: Path) -> None:
    """Refuse, before any long run, a plot that could not be drawn: no matplotlib, or a format it is not given."""
    if path.suffix.lower() not in FORMATS:
        raise UsageError(f"--plot {path}: give a file ending in {', '.join(FORMATS)}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"--plot needs matplotlib, which is not installed: {INSTALL}") from None


def panels(result: dict) -> list[str]:
    """What there is to draw in `result`, in order."""
    fidelity = ["kl", "cost"] + (["tolerance"] if tolerances(result) else []) if "fidelity" in result else []
    return fidelity + [t for t in ("needle", "recall") if t in result]


def figure(result: dict):
    """A matplotlib Figure with one panel per entry of `panels(result)` and one legend for the methods."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    kinds = panels(result)
    labels = budgets(result)
    tokens = [result["settings"]["budget_tokens"][b] for b in labels]
    methods = list(next(result[k]["results"] for k in ("fidelity", "needle", "recall") if k in result))
    fig = Figure(figsize=(5.2 * len(kinds) + 2.2, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(kinds), squeeze=False)[0]
    colours = fig_colours(len(methods))
    for ax, kind in zip(axes, kinds):
        for n, method in enumerate(methods):
            style = {"color": "black" if method == SUBJECT else colours[n], "marker": "o", "markersize": 3.5,
                     "linewidth": 2.4 if method == SUBJECT else 1.1, "label": method, "zorder": 3 if method == SUBJECT
                     else 2}
            if kind == "tolerance":
                draw_tolerance_points(ax, result, method, style)
            elif kind in ("kl", "cost"):
                rows = [result["fidelity"]["results"][method][b] for b in labels]
                kl = [r["kl"]["mean"] for r in rows]
                if kind == "kl":
                    ax.errorbar(tokens, kl, yerr=[r["kl"]["ci95"] for r in rows], capsize=2, **style)
                else:
                    ax.plot(kl, [r["time_ratio"]["mean"] for r in rows], **style)
            else:
                rows = [result[kind]["results"][method][b] for b in labels]
                ax.errorbar(tokens, [100 * r["accuracy"]["mean"] for r in rows],
                            yerr=[100 * r["accuracy"]["ci95"] for r in rows], capsize=2, **style)
        if kind in ("needle", "recall"):  # what the compressed caches are measured against
            ax.axhline(100 * result[kind]["full"]["accuracy"]["mean"], color="grey", linestyle="--", linewidth=1,
                       zorder=1, label="full cache")
        describe_axes(ax, kind, result)
    legend = {}  # every panel's entries, once each (the full cache's line is only on the accuracy panels)
    for ax in axes:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(name, handle)
    fig.legend(list(legend.values()), list(legend), loc="outside right center", fontsize="small", frameon=False)
    return fig


def fig_colours(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    return [cmap(i % 20) for i in range(n)]


def describe_axes(ax, kind: str, result: dict) -> None:
    from matplotlib.ticker import NullFormatter

    s = result["settings"]
    ax.grid(True, alpha=0.3)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    if kind == "tolerance":
        describe_tolerance_axes(ax, list(tolerances(result).values()), windows_count(s['windows']))
        return
    if kind == "cost":
        ax.set_xlabel("KL(full ‖ compressed), nats/token")
        ax.set_ylabel("read time / full-cache read")
        ax.set_title("cost against quality")
        return
    ax.set_xticks([s["budget_tokens"][b] for b in budgets(result)], labels=[f"{b}\n({s['budget_tokens'][b]})"
                                                                            for b in budgets(result)])
    ax.set_xlabel(f"entries kept per KV head (of {s['context']})")
    if kind == "kl":
        ax.set_yscale("log")
        ax.set_ylabel("KL(full ‖ compressed), nats/token")
        ax.set_title(f"KL against budget, mean ± 95 % over {windows_count(s['windows'])}")
    else:
        ax.set_ylim(-3, 103)
        ax.set_ylabel("exact-match accuracy, %")
        ax.set_title(f"{kind}: retrieval accuracy, mean ± 95 % over {windows_count(s['windows'])}")


def draw_tolerance_points(ax, result: dict, method: str, style: dict) -> None:
    """One point per window and tolerance: the KL measured on the real continuation against the tolerance asked
    for (spread a little along x so that windows at one tolerance do not hide each other)."""
    rows = result["fidelity"]["results"][method]
    asked = tolerances(result)
    xs, ys = [], []
    for label, tolerance in asked.items():
        measured = rows[label]["per_window"]["kl"]
        for n, kl in enumerate(measured):
            xs.append(tolerance * 1.06 ** (n - (len(measured) - 1) / 2))
            ys.append(kl)
    ax.scatter(xs, ys, s=14, color=style["color"], label=style["label"], zorder=style["zorder"])


def describe_tolerance_axes(ax, asked: list[float], what: str) -> None:
    """The promise drawn under the points: measured = asked, and the band within 1.5× of it."""
    lo, hi = min(asked) / 2, max(asked) * 2
    line = [lo, hi]
    ax.plot(line, line, color="black", linewidth=0.8, zorder=1)
    ax.fill_between(line, [x / 1.5 for x in line], [x * 1.5 for x in line], color="0.85", zorder=0,
                    label="within 1.5×")
    ax.set_xlim(lo, hi)
    ax.set_yscale("log")
    ax.set_xticks(sorted(set(asked)), labels=[f"{t:g}" for t in sorted(set(asked))])
    ax.set_xlabel("--max-kl asked, nats/token")
    ax.set_ylabel("KL measured on the real continuation")
    ax.set_title(f"measured against asked, {what}", fontsize="medium")


def tolerance_figure(results: dict[str, dict]):
    """Measured against asked for several `bench --max-kl` results at once (one colour per named result, each of
    its methods' windows), on one panel: whether the promise holds across documents, lengths and models."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.4, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    colours = fig_colours(len(results))
    asked, windows = [], 0
    for n, (name, result) in enumerate(results.items()):
        for method in result["fidelity"]["results"]:
            draw_tolerance_points(ax, result, method, {"color": colours[n], "label": name, "zorder": 2})
        windows += result["fidelity"]["windows_done"]
        asked += tolerances(result).values()
    ax.grid(True, alpha=0.3)
    ax.set_xscale("log")
    describe_tolerance_axes(ax, asked, f"{windows} windows")
    ax.legend(fontsize="x-small", frameon=False, loc="upper left")
    return fig


def frontier_figure(result: dict):
    """KL against the bytes a cache is stored in: one line per dtype of a `bench --cache-dtype` result (rows
    "<method> <dtype>"), through its kept shares."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    rows = result["fidelity"]["results"]
    colours = fig_colours(len(rows))
    for n, (name, per) in enumerate(rows.items()):
        points = sorted((100 * row["cache_fraction"]["mean"], row["kl"]["mean"], row["kl"]["ci95"], label)
                        for label, row in per.items())
        ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points], capsize=2,
                    marker="o", markersize=3.5, color=colours[n], label=name.split()[-1])
        for x, y, _, label in points:
            ax.annotate(label, (x, y), fontsize="x-small", xytext=(3, 3), textcoords="offset points",
                        color=colours[n])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("keys and values, % of the float32 cache's bytes")
    ax.set_ylabel("KL(full ‖ stored), nats/token")
    s = result["settings"]
    ax.set_title(f"KL against bytes, mean ± 95 % over {windows_count(s['windows'])} of {s['context']:,} tokens",
                 fontsize="medium")
    ax.legend(fontsize="small", frameon=False)
    return fig


def plot_bytes(result: dict, path: Path, frontier: bool = False) -> bytes:
    """`result` drawn as the bytes of a file of `path`'s format (.png, .svg or .pdf); `frontier`: KL against
    bytes (`frontier_figure`)."""
    return figure_bytes((frontier_figure if frontier else figure)(result), path)


def figure_bytes(fig, path: Path) -> bytes:
    """A matplotlib Figure as the bytes of a file of `path`'s format (.png, .svg or .pdf)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix.lower().lstrip("."), dpi=110)
    return buffer.getvalue()
