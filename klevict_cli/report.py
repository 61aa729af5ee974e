"""`klevict inspect`: what a `.kvc` file kept, where, and how big it is.

Works without loading the model (the file is validated on its own); `--text` loads only the tokenizer's model to
decode the stored token ids and highlight the kept spans: in colour on a terminal, with ⟦…⟧ marks elsewhere.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from klevict_cli.display import chosen_layers, drift_against, drift_words, sliding_summary, visible
from klevict_cli.errors import UsageError
from klevict_cli.kvc import KvcFile, check_tokenizer, check_vocabulary, float_itemsize, kv_bytes, load_kvc, quantized, width
from klevict_cli.options import parse_size


def sliding_layers(kvc: KvcFile) -> dict[int, int]:
    """The layers that keep a sliding window whatever the budget, with their window (`layer_windows`: Gemma 3's 15
    of 18), where the file says so soundly and some layer does not slide; {} otherwise. On a short text such a layer
    keeps every token, so counted with the others it shades the whole document as kept."""
    try:
        windows = json.loads(kvc.metadata.get("layer_windows", "null"))
    except ValueError:
        return {}
    if not (isinstance(windows, list) and len(windows) == len(kvc.layers)
            and all(w is None or (type(w) is int and w > 0) for w in windows)):
        return {}
    sliding = {i: w for i, w in enumerate(windows) if w is not None}
    return sliding if len(sliding) < len(kvc.layers) else {}


def kept_share(kvc: KvcFile) -> torch.Tensor:
    """(T,) share of the (layer, KV head) slots that kept each token, in [0, 1]: the slots of the layers a budget
    chose for (`sliding_layers` left out)."""
    total = torch.zeros(len(kvc.tokens), dtype=torch.float64)
    slots = 0
    sliding = sliding_layers(kvc)
    for i, layer in enumerate(kvc.layers):
        if i in sliding:
            continue
        total.index_add_(0, layer.positions.long(), torch.ones(len(layer.positions), dtype=torch.float64))
        slots += len(layer.lengths)
    return total / max(slots, 1)


def spans(share: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs [start, end) of tokens kept by at least one slot."""
    kept = (share > 0).tolist()
    runs, start = [], None
    for i, k in enumerate(kept + [False]):
        if k and start is None:
            start = i
        elif not k and start is not None:
            runs.append((start, i))
            start = None
    return runs


def describe(path: Path, kvc: KvcFile) -> dict:
    meta = kvc.metadata
    per_layer = [layer.lengths.tolist() for layer in kvc.layers]
    n_tokens = len(kvc.tokens)
    itemsize = full_itemsize(kvc)
    full = sum(n_tokens * len(layer.lengths) * (width(layer.keys) + width(layer.values)) * itemsize
               for layer in kvc.layers)
    kept = kv_bytes(kvc)
    share = kept_share(kvc)
    runs = spans(share)
    return {
        "file": str(path),
        "file_bytes": path.stat().st_size,
        "metadata": meta,
        "tokens": n_tokens,
        "kept_per_layer": per_layer,
        "kv_bytes_kept": kept,
        "kv_bytes_full": full,
        # under compress --json's names and types too: one script reads both (null budget: nothing evicted)
        "cache_bytes": kept,
        "kept_entries": sum(map(sum, per_layer)),
        "document": {"name": meta.get("source_name"), "sha256": meta.get("source_sha256"),
                     "tokens": _count(meta.get("document_tokens"))},
        "prefix_tokens": _count(meta.get("prefix_tokens")),
        "budget_tokens": _count(meta.get("budget_tokens")),
        # the size a --max-kl or --max-bytes cache has (its budget_tokens is only the cap, null where none was given)
        "kept_budget": _count(meta.get("kept_budget", meta.get("budget_tokens"))),
        "ratio": kept / full if full else 0.0,
        # the layers whose window, not the budget, decides what they keep: left out of the three below
        "sliding_layers": {str(i): w for i, w in sliding_layers(kvc).items()},
        "tokens_kept_anywhere": int((share > 0).sum()),
        "spans": len(runs),
        "longest_spans": sorted(runs, key=lambda r: r[0] - r[1])[:5],
        "estimated_kl": estimated_kl(meta),
    }


def _count(value: str | None) -> int | None:
    """A count the metadata holds as text, as a number; None where it holds none ('all', or missing)."""
    return int(value) if value is not None and value.isdigit() else None


def full_itemsize(kvc: KvcFile) -> int:
    """Bytes per number of the full cache the file is measured against: the model's dtype, as `--max-bytes` counts
    it; in files that do not name it, the file's float dtype, and float16 for a quantized file (what its codes
    replace)."""
    model = float_itemsize(kvc.metadata.get("model_dtype"))
    if model is not None:
        return model
    return kvc.layers[0].keys.element_size() if kvc.layers and not quantized(kvc) else 2


def estimated_kl(meta: dict[str, str]) -> dict | None:
    """The drift the read measured for its last eviction (`Engine.measure_drift`), where the file has a sound one."""
    try:
        drift = json.loads(meta["estimated_kl"])
    except (KeyError, ValueError):
        return None
    if not (isinstance(drift, dict) and all(sound(drift.get(k)) for k in ("kl", "ci95", "drafts"))):
        return None
    likely = drift.get("range80")
    if likely is not None and not (isinstance(likely, list) and len(likely) == 2 and all(map(sound, likely))
                                   and likely[0] <= likely[1]):
        drift = {k: v for k, v in drift.items() if k != "range80"}  # the estimate stands without its range
    return drift


def in_megabytes(size: str) -> str:
    """' (1.05 MB)' for a size such as '1.00 MiB' (how `--max-bytes` is stored): the table's other sizes are decimal
    megabytes, and a limit in MiB beside them would look exceeded. '' for anything else (a share: '5%')."""
    try:
        return f" ({parse_size('max_bytes', size) / 1e6:.2f} MB)" if size and not size.endswith("%") else ""
    except UsageError:
        return ""


def sound(value: object) -> bool:
    """A number a drift can hold: finite and not negative."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def inspect_file(path: Path, text: bool, as_json: bool, console: Console, model: str | None = None,
                 html_out: Callable[[bytes], None] | None = None) -> None:
    """Print what `path` kept (a table, or JSON); `html_out`, if given, receives the HTML page of it
    (html_report.page) before anything is printed."""
    kvc = load_kvc(path)
    # rendered first: a file the tokenizer cannot decode is refused before anything is printed
    rendered = render_text(path, kvc, model) if (text and not as_json) or html_out else None
    info = describe(path, kvc)
    if html_out is not None:
        from klevict_cli.html_report import page

        html_out(page(info, rendered).encode("utf-8"))
        rendered = rendered if text and not as_json else None
    if as_json:
        console.file.write(json.dumps(info) + "\n")
        return
    meta = info["metadata"]
    console.print(Text(visible(str(path))), soft_wrap=True)  # whole, as a line: a table's title crops a long path
    table = Table(show_header=False)
    for _ in ("key", "value"):  # a narrow or piped output folds a long name or path; an ellipsis would lose it
        table.add_column(overflow="fold")
    limited = "max_bytes" in meta or "max_kl" in meta
    for key in ("model_id", "method", "budget", "budget_tokens", "max_kl", "max_bytes", "kept_budget",
                "position_mode", "prefix_tokens", "document_tokens", "next_position", "chunk_size", "cache_dtype",
                "model_dtype", "source_name", "created", "klevict_version", "format_version"):
        if key == "kept_budget" and meta.get(key) == meta.get("budget_tokens"):
            continue  # a budget kept as asked: said once
        if key in ("budget", "budget_tokens") and meta.get(key) == "all" and limited:
            continue  # no budget asked: the limit below chose the size ("all" would read as nothing evicted)
        if key in meta:  # values come from the file: Text, so that "[link=…]" stays text
            table.add_row(key, Text(visible(meta[key]) + in_megabytes(meta[key] if key == "max_bytes" else "")))
    table.add_row("cache size", f"{info['kv_bytes_kept'] / 1e6:.2f} MB of {info['kv_bytes_full'] / 1e6:.2f} MB "
                                f"full ({100 * info['ratio']:.1f} %), file {info['file_bytes'] / 1e6:.2f} MB")
    if info["estimated_kl"] is not None:
        drift = info["estimated_kl"]
        # files written before the estimate covered the whole read say nothing of it: theirs is the last eviction's
        table.add_row("estimated drift", f"{drift_words(drift)}, KL against {drift_against(drift)}, on "
                                         f"{drift['drafts']} drafted tokens")
    elif meta.get("method", "none") != "none" and meta.get("budget_tokens", "all") != "all":
        table.add_row("estimated drift", "not measured (by default only from 1,024 tokens read; compress --estimate "
                                         "measures it)")
    prefix = meta.get("prefix_tokens", "0")  # the budget counts every streamed token, the chat frame's too
    sliding = info["sliding_layers"]
    table.add_row("document kept", f"{info['tokens_kept_anywhere']} of {info['tokens']} streamed tokens ({prefix} "
                                   f"of the chat frame, then the document's) kept by some head"
                                   f"{chosen_layers(info)}, in {info['spans']} "
                                   f"span{'' if info['spans'] == 1 else 's'}")
    if sliding:
        table.add_row("sliding layers", sliding_summary(sliding, len(info["kept_per_layer"])))
    console.print(table)
    layers = Table(title="kept entries per layer (per KV head)")
    layers.add_column("layer", justify="right")
    layers.add_column("kept per head")
    layers.add_column("total", justify="right")
    for i, counts in enumerate(info["kept_per_layer"]):
        layers.add_row(str(i), " ".join(str(c) for c in counts), str(sum(counts)))
    console.print(layers)
    if rendered is not None and console.is_terminal and console.color_system is not None:
        # a terminal that shows no styles (TERM=dumb) would show the text unmarked: it gets a pipe's marks
        console.print(LEGEND)
        console.print(styled(rendered))
    elif rendered is not None:
        console.print(f"legend: {KEPT_MARKS[0]}kept by half the KV heads or more{KEPT_MARKS[1]}, the rest by fewer or"
                      " none", markup=False)
        console.print(marked(rendered), markup=False, emoji=False)


KEPT_MARKS = ("⟦", "⟧")  # rarely in a document, unlike [ ]: piped output marks kept spans with them
MOSTLY_KEPT = 0.5  # a share of the heads: most budgets keep nearly every token in some head, so "kept by any" says
# little; kept by half or more is what a pipe marks and a terminal shows in bold
LEGEND = Text.assemble("legend: ", ("kept by half the KV heads or more", "bold yellow"), " · ",
                       ("kept by fewer", "yellow"), " · ", ("evicted by all", "dim"))


def render_text(path: Path, kvc: KvcFile, model: str | None) -> list[tuple[str, float]]:
    """The streamed text token by token (a character split across tokens: those tokens together), each piece with the
    share of (layer, KV head) slots that kept it (the most that kept any of its tokens)."""
    from klevict_cli.display import decode_spans
    from klevict_cli.models import load_model

    lm = load_model(model, quiet=True)
    tokenizer = lm.tokenizer
    check_tokenizer(path, kvc.metadata, lm.tokenizer_sha256)
    check_vocabulary(path, kvc.tokens, len(tokenizer))
    share = kept_share(kvc).tolist()
    return [(visible(text, keep="\n\t"), max(share[i] for i in span))
            for text, span in decode_spans(tokenizer, kvc.tokens.tolist())]


def styled(pieces: list[tuple[str, float]]) -> Text:
    """For a terminal: kept tokens highlighted by how many heads kept them (see LEGEND)."""
    out = Text()
    for piece, s in pieces:
        out.append(piece, style="dim" if s == 0 else ("bold yellow" if s >= MOSTLY_KEPT else "yellow"))
    return out


def marked(pieces: list[tuple[str, float]]) -> str:
    """For a pipe or file, where colour is lost: ⟦…⟧ around each run of tokens half the heads or more kept."""
    opened, parts = False, []
    for piece, s in pieces:
        if (s >= MOSTLY_KEPT) != opened:
            parts.append(KEPT_MARKS[opened])
            opened = not opened
        parts.append(piece)
    return "".join(parts) + (KEPT_MARKS[1] if opened else "")
