"""Markdown tables from `klevict bench` results (the JSON that `--out` writes), for docs/benchmarks.md and the
README's headline table (`benchmarks/make_tables.py` writes them there).

Everything is computed from the file: means and 95 % intervals as the bench stored them, paired comparisons from its
per-window lists. Nothing here imports torch, so the tables regenerate in a second.
"""

from __future__ import annotations

import json
import math
import random
import shlex
from pathlib import Path

from klevict_cli.packaged import DEFAULT_MODEL

SUBJECT = "kl"
# kl as `summarize` reads (look-ahead probes) and as `compress` reads (and re-reading probes): each is compared with
# the best of the other methods.
SUBJECTS = (SUBJECT, "kl-reconstruct")
RESAMPLES = 10_000  # bootstrap resamples of the windows for a paired ratio's interval
Z95 = 1.96


def load_result(path: Path) -> dict | None:
    """A bench result, or None if the file holds something else (another script's JSON)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or "settings" not in data or not any(t in data for t in TASKS):
        return None
    return data


TASKS = ("fidelity", "needle", "recall")


def summary(values: list[float | None]) -> dict:
    """Mean over windows with a 95 % interval half-width (1.96·sd/√n; 0 for one window)."""
    xs = [float(v) for v in values if v is not None]
    n = len(xs)
    if not n:
        return {"mean": None, "ci95": None, "n": 0}
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "ci95": Z95 * sd / math.sqrt(n), "n": n}


def resummarise(row: dict) -> None:
    """Recompute a result row's means and intervals from its per-window numbers (after windows were cut or added)."""
    for key in row:
        if key != "per_window" and key in row["per_window"]:
            row[key] = summary(row["per_window"][key])


def windows_count(n: int) -> str:
    return f"{n} window" if n == 1 else f"{n} windows"


def windows_text(result: dict) -> str:
    """How many windows were measured: all of them, or (a run stopped early) how many of how many."""
    planned = result["settings"]["windows"]
    done = min((result[t].get("windows_done", planned) for t in TASKS if t in result), default=planned)
    return windows_count(planned) if done >= planned else f"{done} of {planned} planned windows (stopped early)"


def budgets(result: dict) -> list[str]:
    """The budgets measured, in entries per head (not `--max-kl` tolerances, whose size each window decides)."""
    return [label for label, tokens in result["settings"]["budget_tokens"].items() if tokens is not None]


TOLERANCE_PREFIX = "max-kl "


def tolerances(result: dict) -> dict[str, float]:
    """The `--max-kl` tolerances measured: their column labels and nats per token."""
    return {label: float(label.removeprefix(TOLERANCE_PREFIX))
            for label in result["settings"]["budget_tokens"] if label.startswith(TOLERANCE_PREFIX)}


def within_factor(ratios, factor: float = 1.5) -> int:
    """How many of `ratios` (estimated or measured over asked) are within `factor` of 1, either way."""
    return sum(1 / factor <= r <= factor for r in ratios)


def peers(methods) -> list[str]:
    """The methods kl is compared with: all but kl and its own variants (kl-fisher, kl-layer)."""
    return [m for m in methods if m != SUBJECT and not m.startswith(SUBJECT + "-")]


def best_peer(block: dict, budget: str, metric: str = "kl") -> str | None:
    """The peer with the lowest mean `metric` at `budget`."""
    rows = {m: per[budget][metric]["mean"] for m, per in block["results"].items() if m in peers(block["results"])}
    rows = {m: v for m, v in rows.items() if v is not None}
    return min(rows, key=rows.get) if rows else None


def paired_ratio(mine: list[float], theirs: list[float], seed: int = 0) -> dict:
    """Per-window ratios mine / theirs: geometric mean with a percentile-bootstrap 95 % interval over windows, and in
    how many windows `mine` is lower. Windows where either value is 0 have no ratio (both 0 counts as a tie)."""
    better = sum(a < b for a, b in zip(mine, theirs))
    logs = [math.log(a / b) for a, b in zip(mine, theirs) if a > 0 and b > 0]
    out = {"better": better, "windows": len(mine), "ratio": None, "low": None, "high": None, "paired": len(logs)}
    if not logs:
        return out
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(logs, k=len(logs))) / len(logs) for _ in range(RESAMPLES))
    out.update(ratio=math.exp(sum(logs) / len(logs)), low=math.exp(means[int(0.025 * (RESAMPLES - 1))]),
               high=math.exp(means[int(0.975 * (RESAMPLES - 1))]))
    return out


# ---- formatting ------------------------------------------------------------------------------------------------
def md(text: object) -> str:
    """Text from a result file inside a Markdown table cell: nothing in it may open markup or split the cell."""
    out = str(text)
    for c in "\\`*_[]<>|#":
        out = out.replace(c, "\\" + c)
    return " ".join(out.split())


def pm(stat: dict) -> str:
    """Mean ± half-width, both to the decimals that give the mean three significant figures."""
    mean = stat.get("mean")
    if mean is None:
        return "–"
    digits = min(8, max(0, 2 - math.floor(math.log10(abs(mean))))) if mean else 4
    if stat.get("n", 2) < 2:  # one window: no interval to give
        return f"{mean:.{digits}f} (n = 1)"
    return f"{mean:.{digits}f} ± {stat['ci95']:.{digits}f}"


def ratio_text(p: dict) -> str:
    if p["ratio"] is None:
        return "–"
    if p["paired"] < 2:  # one window: the ratio, no interval
        return f"{p['ratio']:.3f}"
    return f"{p['ratio']:.3f} [{p['low']:.3f}, {p['high']:.3f}]"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def budget_headers(result: dict) -> list[str]:
    tokens = result["settings"]["budget_tokens"]
    return [f"{md(b)} ({tokens[b]})" for b in budgets(result)]


def command(result: dict, path: Path) -> str:
    """The `klevict bench` command line that produces this file (its settings, spelt as options)."""
    s = result["settings"]
    parts = ["klevict", "bench", s["document"]["name"], "--model", s["model"], "--methods", ",".join(s["methods"]),
             "--budgets", ",".join(s["budgets"]), "--windows", s["windows"], "--context", s["context"],
             "--continuation", s["continuation"], "--seed", s["seed"], "--chunk-size", s["chunk_size"],
             "--probe-window", s["probe_window"], "--task", s["task"]]
    if s["task"] != "fidelity":
        parts += ["--needles", s["needles"], "--answer-tokens", s["answer_tokens"]]
    if s.get("working") is not None:
        parts += ["--working", s["working"]]
    if s.get("reconstruct"):
        parts.append("--reconstruct")
    if s.get("estimate"):
        parts.append("--estimate")
    if s.get("max_kl"):
        parts += ["--max-kl", ",".join(f"{t:g}" for t in s["max_kl"])]
    if s.get("cache_dtypes"):
        parts += ["--cache-dtype", ",".join(s["cache_dtypes"])]
    if s.get("max_bytes"):
        parts += ["--max-bytes", ",".join(s["max_bytes"])]
    parts += ["--device", s["device"], "--dtype", s["dtype"], "--probe-dtype", s.get("probe_precision", s["dtype"]),
              "--out", path.as_posix()]
    return shlex.join(str(p) for p in parts)


# ---- per file --------------------------------------------------------------------------------------------------
def fidelity_tables(result: dict) -> list[str]:
    fid, labels = result["fidelity"], budgets(result)
    rows = fid["results"]
    lines = ["KL(full ‖ compressed) in nats per token, mean ± 95 % interval over the windows (lower is better; the "
             "lowest per budget in bold):", ""]
    body = []
    for method, per in rows.items():
        cells = []
        for b in labels:
            lowest = min((r[b]["kl"]["mean"] for r in rows.values() if r[b]["kl"]["mean"] is not None), default=None)
            text = pm(per[b]["kl"])
            cells.append(f"**{text}**" if per[b]["kl"]["mean"] is not None and per[b]["kl"]["mean"] == lowest
                         else text)
        body.append([md(method), *cells])
    lines += table(["method", *budget_headers(result)], body) + [""]
    subjects = [m for m in SUBJECTS if m in rows]
    if subjects and peers(rows):
        lines += ["Paired by window: each kl reading's KL over the best other method's at each budget (geometric "
                  "mean of the per-window ratios, 95 % bootstrap interval over windows; below 1 means kl is better):",
                  ""]
        body = []
        for b in labels:
            other = best_peer(fid, b)
            if other is None:
                continue
            for subject in subjects:
                p = paired_ratio(rows[subject][b]["per_window"]["kl"], rows[other][b]["per_window"]["kl"])
                body.append([md(b), md(subject), md(other), ratio_text(p), f"{p['better']} of {p['windows']}"])
        lines += table(["budget", "kl reading", "best other method", "kl / it", "kl lower in"], body) + [""]
    lines += ["Top-1 agreement with the full cache, mean over windows:", ""]
    lines += table(["method", *budget_headers(result)],
                   [[md(m), *(f"{100 * per[b]['top1']['mean']:.1f} %" for b in labels)] for m, per in rows.items()])
    full = fid["full"]
    lines += ["", f"Cost: compression time over the full-cache read of the same window (mean over windows; the full "
                  f"read took {full['seconds']['mean']:.2f} s per window, full-cache perplexity "
                  f"{full['perplexity']['mean']:.2f}):", ""]
    lines += table(["method", *budget_headers(result)],
                   [[md(m), *(f"{per[b]['time_ratio']['mean']:.2f}×" for b in labels)] for m, per in rows.items()])
    return lines + [""]


def wilson(correct: int, n: int) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion (sound at 0 and n, unlike the normal approximation)."""
    if n == 0:
        return 0.0, 1.0
    p, z2 = correct / n, Z95 ** 2
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def accuracy_text(correct_lists: list[list[bool]], full: list[list[bool]] | None = None) -> str:
    """Correct / asked, the share with its 95 % Wilson interval and, given the full cache's answers, the share of
    the full cache's accuracy."""
    flat = [c for window in correct_lists for c in window]
    right, n = sum(flat), len(flat)
    low, high = wilson(right, n)
    text = f"{right}/{n} = {100 * right / max(n, 1):.0f} % [{100 * low:.0f}, {100 * high:.0f}]"
    if full is not None:
        base = sum(c for window in full[: len(correct_lists)] for c in window)
        text += f" ({right / base:.2f}× full)" if base else ""
    return text


def retrieval_table(result: dict, task: str) -> list[str]:
    block, labels = result[task], budgets(result)
    full = block["full"]["per_window"]["correct"]
    what = "planted facts (needle)" if task == "needle" else "details the text states once (recall)"
    lines = [f"Retrieval of {what} in {len(full)} windows: answers with the detail / questions asked, with a 95 % "
             f"Wilson interval and the share of the full cache's score; the full cache answers "
             f"{accuracy_text(full)}:", ""]
    lines += table(["method", *budget_headers(result)],
                   [[md(m), *(accuracy_text(per[b]["per_window"]["correct"], full) for b in labels)]
                    for m, per in block["results"].items()])
    return lines + [""]


def file_section(path: Path, result: dict, plot: Path | None = None) -> list[str]:
    s = result["settings"]
    doc = s["document"]
    versions = s.get("versions", {})
    run = [f"model `{md(s['model'])}`", f"document `{md(doc['name'])}` ({doc['tokens']:,} tokens, sha256 "
           f"{md(doc['sha256'])[:12]}…)", f"{windows_text(result)} of {s['context']:,} tokens",
           f"continuation {s['continuation']}", f"seed {s['seed']}", f"{md(s['device'])}, {md(s['dtype'])}",
           f"klevict {md(versions.get('klevict', '?'))}, torch {md(versions.get('torch', '?'))}, "
           f"transformers {md(versions.get('transformers', '?'))}"]
    if s.get("created"):
        run.insert(0, f"run {md(s['created'])}")
    if s.get("machine"):
        run.append(md(s["machine"]))
    lines = [f"### {md(path.name)}", "", "; ".join(run) + ".", "", "```bash", command(result, path), "```", ""]
    if s.get("merged_from"):  # benchmarks/merge_results.py: the command above is what the parts add up to
        parts = "; ".join(f"`{md(name)}` ({', '.join(md(m) for m in methods)})"
                          for name, methods in s["merged_from"].items())
        lines += [f"Merged by `benchmarks/merge_results.py` from runs on the same windows (under "
                  f"`benchmarks/results/parts/`): {parts}. Each method's cost is against the full read of its own "
                  f"run.", ""]
    if plot is not None:
        lines += [f"![KL against budget, and cost against KL, for {md(path.name)}]({plot.as_posix()})", ""]
    if "fidelity" in result:
        lines += fidelity_tables(result)
    for task in ("needle", "recall"):
        if task in result:
            lines += retrieval_table(result, task)
    return lines


# ---- the README's headline -------------------------------------------------------------------------------------
def protocol(result: dict) -> tuple:
    """What makes two fidelity results comparable window for window: the methods, budgets, model and reading."""
    s = result["settings"]
    return (tuple(sorted(result["fidelity"]["results"])), tuple(budgets(result)), s["model"], s["context"],
            s["continuation"], s["chunk_size"], s["probe_window"], s["seed"])


def headline_choice(results: dict[Path, dict]) -> list[Path]:
    """The fidelity results with kl and the most methods, measured the same way (`protocol`), all of them: on
    different texts they are pooled (`pool`). Ties go to the most windows, then to the latest run (a rerun on fresh
    windows supersedes the one it repeats), then the latest names. The length sweep's files have a table of their
    own (`length_table`)."""
    sweep = {p for paths in length_groups(results).values() for p in paths}
    usable = [p for p, r in results.items() if "fidelity" in r and SUBJECT in r["fidelity"]["results"]
              and peers(r["fidelity"]["results"]) and p not in sweep]
    groups: dict[tuple, list[Path]] = {}
    for p in sorted(usable):
        groups.setdefault(protocol(results[p]), []).append(p)
    if not groups:
        return []
    return max(groups.values(), key=lambda ps: (len(protocol(results[ps[0]])[0]),
                                                sum(len(results[p]["fidelity"]["full"]["per_window"]["seconds"])
                                                    for p in ps),
                                                max(results[p]["settings"].get("created", "") for p in ps),
                                                [p.name for p in ps]))


def pool(parts: list[dict]) -> dict:
    """Fidelity results measured the same way on different texts as one result: their windows side by side (the
    per-window numbers concatenated, the means and intervals recomputed), the texts named together; the methods
    every part measured."""
    out = json.loads(json.dumps({k: v for k, v in parts[0].items() if k not in TASKS or k == "fidelity"}))
    if len(parts) == 1:
        return out
    fid = out["fidelity"]
    fid["results"] = {m: per for m, per in fid["results"].items() if all(m in p["fidelity"]["results"] for p in parts)}
    rows = [("full", None)] + [(m, b) for m, per in fid["results"].items() for b in per]
    for other in parts[1:]:
        theirs = other["fidelity"]
        for method, budget in rows:
            mine = fid["full"] if budget is None else fid["results"][method][budget]
            source = theirs["full"] if budget is None else theirs["results"][method][budget]
            for key, values in source["per_window"].items():
                mine["per_window"][key] = mine["per_window"].get(key, []) + values
        fid["windows_done"] = fid.get("windows_done", out["settings"]["windows"]) + theirs.get(
            "windows_done", other["settings"]["windows"])
        out["settings"]["windows"] += other["settings"]["windows"]
    for method, budget in rows:
        resummarise(fid["full"] if budget is None else fid["results"][method][budget])
    names = [Path(p["settings"]["document"]["name"]).name for p in parts]
    out["settings"]["document"] = {"name": " and ".join(names)}
    return out


def headline(paths: list[Path], parts: list[dict], link: str) -> list[str]:
    """One table: kl against the best other method per budget, paired by window (the windows of every part, pooled);
    and one cost sentence."""
    result = pool(parts)
    fid, s = result["fidelity"], result["settings"]
    rows = fid["results"]
    body = []
    subjects = [m for m in SUBJECTS if m in rows]
    for b in budgets(result):
        other = best_peer(fid, b)
        for subject in subjects:
            p = paired_ratio(rows[subject][b]["per_window"]["kl"], rows[other][b]["per_window"]["kl"])
            body.append([md(b), md(subject), pm(rows[subject][b]["kl"]), f"{md(other)} {pm(rows[other][b]['kl'])}",
                         ratio_text(p), f"{p['better']} of {p['windows']}"])
    lines = table(["kept", "kl reading", "KL (nats/token)", "best of the other methods", "ratio, paired",
                   "kl better in"], body)
    peer_costs = [per[b]["time_ratio"]["mean"] for m, per in rows.items() if m in peers(rows) for b in budgets(result)]
    return lines + [
        "",
        f"kl against {len(peers(rows))} other methods; {windows_text(result)} of {s['context']:,} tokens of "
        + " and ".join(f"`{md(Path(p['settings']['document']['name']).name)}`" for p in parts)
        + f" then {s['continuation']} teacher-forced tokens, model `{md(s['model'])}` on {md(s['device'])}; mean ± "
        f"95 % over windows; ratio: geometric mean of kl / that method per window, 95 % bootstrap interval. Raw "
        f"numbers: {', '.join(f'`{p.as_posix()}`' for p in paths)}; details and the command: [{link}]({link}).",
        "",
        "Cost, against a full-cache read of the same window: " + "; ".join(
            f"{subject} {min(c):.2f}–{max(c):.2f}×" for subject in subjects
            if (c := [rows[subject][b]["time_ratio"]["mean"] for b in budgets(result)]))
        + f"; the other methods {min(peer_costs):.2f}–{max(peer_costs):.2f}×.",
    ]


def length_groups(results: dict[Path, dict]) -> dict[tuple[int, str], list[Path]]:
    """The length sweep's results (`benchmarks/lengths.sh`: files named lengths-TEXT-LENGTH[-MODEL].json, fidelity
    with kl, peers and, where it was measured, kl-reconstruct), grouped by context length and model (the default
    model's first)."""
    groups: dict[tuple[int, str], list[Path]] = {}
    for path, result in sorted(results.items()):
        rows = result.get("fidelity", {}).get("results", {})
        if path.name.startswith("lengths-") and SUBJECT in rows and peers(rows):
            groups.setdefault((result["settings"]["context"], result["settings"]["model"]), []).append(path)
    return dict(sorted(groups.items(), key=lambda item: (item[0][1] != DEFAULT_MODEL, item[0][1], item[0][0])))


def length_table(results: dict[Path, dict]) -> list[str]:
    """Quality against context length: per length and budget, each kl reading's mean KL and its paired ratio to the
    best other method (the texts of a length pooled, window by window)."""
    groups = length_groups(results)
    if not groups:
        return ["No length-sweep results are committed yet (`benchmarks/lengths.sh`)."]
    body = []
    for (length, model), paths in groups.items():
        result = pool([results[p] for p in paths])
        fid = result["fidelity"]
        rows = fid["results"]
        for b in budgets(result):
            other = best_peer(fid, b)
            cells = [f"{length:,}" + ("" if model == DEFAULT_MODEL else f" ({md(model)})"), md(b)]
            for subject in SUBJECTS:
                if subject not in rows:
                    cells += ["not measured", "—"]
                    continue
                p = paired_ratio(rows[subject][b]["per_window"]["kl"], rows[other][b]["per_window"]["kl"])
                cells += [pm(rows[subject][b]["kl"]), f"{ratio_text(p)}, {p['better']} of {p['windows']}"]
            body.append(cells + [f"{md(other)} {pm(rows[other][b]['kl'])}"])
    texts = sorted({Path(results[p]["settings"]["document"]["name"]).name for ps in groups.values() for p in ps})
    return table(["context", "kept", "kl", "kl / best other", "kl-reconstruct", "kl-reconstruct / best other",
                  "best other"], body) + [
        "", "KL in nats per token (mean ± 95 % over windows); ratios paired per window (geometric mean, 95 % "
        "bootstrap interval, windows where the kl reading is lower). Texts: " + ", ".join(f"`{md(t)}`" for t in texts)
        + f"; model {md(DEFAULT_MODEL)} unless named; files: "
        + ", ".join(f"`{p.as_posix()}`" for ps in groups.values() for p in ps) + "."]


# ---- bytes: fewer entries or fewer bits (benchmarks/quantized.sh) ------------------------------------------------
def quantized_groups(results: dict[Path, dict]) -> tuple[list[Path], list[Path]]:
    """The size-quality frontier's files (quantized-TEXT-LENGTH.json: rows "kl <dtype>") and the byte limits' files
    on the same windows (quantized-bytes-TEXT-LENGTH.json)."""
    frontier = [p for p in sorted(results) if p.name.startswith("quantized-") and not p.name.startswith(
        "quantized-bytes-") and "fidelity" in results[p]]
    limits = [p for p in sorted(results) if p.name.startswith("quantized-bytes-") and "fidelity" in results[p]]
    return frontier, limits


def _bytes_share(row: dict) -> float:
    return 100 * row["cache_fraction"]["mean"]


def quantized_tables(results: dict[Path, dict]) -> list[str]:
    """KL against the bytes a cache is stored in (the texts pooled, window by window): every dtype at every kept
    share; the dtypes at equal bytes against float16; and what `--max-bytes` chose, against the best fixed choice
    that fits."""
    frontier, limits = quantized_groups(results)
    if not frontier:
        return ["No quantized-cache results are committed yet (`benchmarks/quantized.sh`)."]
    result = pool([results[p] for p in frontier])
    rows, labels = result["fidelity"]["results"], budgets(result)
    dtypes = [name.split()[-1] for name in rows]
    lines = table(["dtype", *(md(b) for b in labels)],
                  [[md(d), *(f"{pm(rows[f'kl {d}'][b]['kl'])} ({_bytes_share(rows[f'kl {d}'][b]):.1f} %)"
                             for b in labels)] for d in dtypes])
    lines += ["", "KL in nats per token, mean ± 95 % over windows, with the keys' and values' bytes in % of the "
              "float32 cache of every token (bracketed). Columns: entries kept per head.", ""]
    base = "kl float16"
    if base in rows:
        body = []
        for b in labels:
            size = _bytes_share(rows[base][b])
            cells = [f"{size:.1f} %", f"{md(b)}: {pm(rows[base][b]['kl'])}"]
            for d in ("int8", "int4"):
                fits = [c for c in labels if f"kl {d}" in rows and _bytes_share(rows[f"kl {d}"][c]) <= 1.02 * size]
                if not fits:
                    cells.append("–")
                    continue
                c = max(fits, key=lambda c: _bytes_share(rows[f"kl {d}"][c]))
                p = paired_ratio(rows[f"kl {d}"][c]["per_window"]["kl"], rows[base][b]["per_window"]["kl"])
                cells.append(f"{md(c)} ({_bytes_share(rows[f'kl {d}'][c]):.1f} %): {pm(rows[f'kl {d}'][c]['kl'])}, "
                             f"{ratio_text(p)}")
            body.append(cells)
        lines += ["At equal bytes: each float16 cache against the int8 and int4 caches that keep the most entries "
                  "within its bytes (+2 %); ratio: their KL over float16's, geometric mean per window with a 95 % "
                  "bootstrap interval:", ""]
        lines += table(["bytes", "float16", "int8", "int4"], body) + [""]
    if limits:
        chosen = pool([results[p] for p in limits])
        mine = chosen["fidelity"]["results"]["kl"]
        body = []
        for label in [b for b in mine if b.startswith("max-bytes ")]:
            limit = float(label.removeprefix("max-bytes ").rstrip("%"))
            row = mine[label]
            fits = [(name, b) for name in rows for b in labels if _bytes_share(rows[name][b]) <= limit]
            counts = {}
            for dtype in row["per_window"]["cache_dtype"]:
                counts[dtype] = counts.get(dtype, 0) + 1
            cells = [f"{limit:g} %", ", ".join(f"{md(d)} ×{n}" for d, n in counts.items()),
                     f"{_bytes_share(row):.1f} %", pm(row["kl"])]
            if fits:
                name, b = min(fits, key=lambda nb: rows[nb[0]][nb[1]]["kl"]["mean"])
                p = paired_ratio(row["per_window"]["kl"], rows[name][b]["per_window"]["kl"])
                cells += [f"{md(name.split()[-1])} at {md(b)}: {pm(rows[name][b]['kl'])}", ratio_text(p)]
            else:
                cells += ["–", "–"]
            body.append(cells)
        lines += ["`--max-bytes` on the same windows: the dtype it chose (windows), the bytes and KL of the cache as "
                  "stored, and the best fixed (dtype, kept) pair of the table above within the limit (ratio: chosen / "
                  "best, per window):", ""]
        lines += table(["limit", "chosen", "bytes", "KL", "best fixed pair within it", "chosen / best"], body) + [""]
    files = frontier + limits
    return lines + ["Texts: " + md(result["settings"]["document"]["name"]) + "; files: "
                    + ", ".join(f"`{p.as_posix()}`" for p in files) + "."]
