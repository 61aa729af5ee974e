"""`klevict inspect --html`: one self-contained page of what a `.kvc` file kept.

The document token by token, each shaded by the share of (layer, KV head) slots that kept it; the kept entries per
layer as a bar chart; the file's metadata. No script, no external resource (a Content-Security-Policy forbids
both), and everything that comes from the file — text, names, metadata — is escaped.
"""

from __future__ import annotations

import html
import math

from klevict_cli.display import chosen_layers, drift_against, drift_words, sliding_summary, visible

SHADES = 10  # shading classes s1..s10 for tokens kept by some slot; s0: evicted by every slot
LONG_VALUE = 240  # metadata values are cut to this many characters on the page (the file has them whole)

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
h1 { font-size: 1.3em; word-break: break-all; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table { border-collapse: collapse; } td, th { padding: 2px 8px; text-align: left; vertical-align: top; }
table.meta td:first-child { color: #666; white-space: nowrap; } table.meta td { word-break: break-all; }
table.layers td.n { text-align: right; font-variant-numeric: tabular-nums; }
.bar { background: #e8a33d; height: 0.9em; }
.doc { white-space: pre-wrap; font: 13px/1.6 ui-monospace, monospace; border: 1px solid #ddd; padding: 1em; }
.s0 { color: #aaa; }
.legend span { padding: 0 0.4em; margin-right: 0.2em; white-space: nowrap; }  /* '40–50 %' not split at a line end */
""" + "\n".join(f".s{k} {{ background: rgba(232, 140, 20, {k / SHADES:.1f}); }}" for k in range(1, SHADES + 1))


def shade(share: float) -> str:
    """The class of a token kept by `share` (0 to 1) of the slots: s0 if none, else s1 (a few) to s10 (all)."""
    return "s0" if share <= 0 else f"s{min(SHADES, max(1, math.ceil(share * SHADES)))}"


def esc(text: object) -> str:
    """Text from the file as HTML text: markup escaped, control and bidi characters shown as escapes (`visible`)."""
    return html.escape(visible(str(text), keep="\n\t"), quote=True)


def page(info: dict, pieces: list[tuple[str, float]]) -> str:
    """The HTML page for `report.describe`'s `info` and the decoded tokens with their kept shares."""
    meta = info["metadata"]
    title = f"klevict: {info['file']}"
    rows = []
    for key in sorted(meta):
        value = meta[key]
        shown = value if len(value) <= LONG_VALUE else value[:LONG_VALUE] + f"… ({len(value):,} characters)"
        rows.append(f"<tr><td>{esc(key)}</td><td>{esc(shown)}</td></tr>")
    layers = info["kept_per_layer"]
    most = max((sum(c) for c in layers), default=0) or 1
    bars = [f'<tr><td class="n">{i}</td><td class="n">{sum(c):,}</td><td style="width: 20em">'
            f'<div class="bar" style="width: {100 * sum(c) / most:.1f}%"></div></td>'
            f'<td>{esc(" ".join(str(n) for n in c))}</td></tr>' for i, c in enumerate(layers)]
    tokens = "".join(f'<span class="{shade(s)}">{esc(text)}</span>' for text, s in pieces)
    legend = "".join(f'<span class="s{k}">{100 * (k - 1) // SHADES}–{100 * k // SHADES} %</span>'
                     for k in range(1, SHADES + 1))
    prefix = meta.get("prefix_tokens", "0")
    chosen = esc(chosen_layers(info))  # which layers the kept tokens count, where some slide
    sliding = f" {esc(sliding_summary(info['sliding_layers'], len(layers)))}." if info["sliding_layers"] else ""
    drift = info["estimated_kl"]
    moved = "" if drift is None else (f"\nEstimated drift (mean next-token KL against {drift_against(drift)}): "
                                      f"{esc(drift_words(drift))}.")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<title>{esc(title)}</title>
<style>{STYLE}</style>
</head>
<body>
<h1>{esc(title)}</h1>
<p>{info['kv_bytes_kept'] / 1e6:.2f} MB of keys and values kept of {info['kv_bytes_full'] / 1e6:.2f} MB for the
full cache ({100 * info['ratio']:.1f} %); file {info['file_bytes'] / 1e6:.2f} MB.
{info['tokens_kept_anywhere']:,} of {info['tokens']:,} tokens are kept by at least one KV head{chosen}, in
{info['spans']:,} span{'' if info['spans'] == 1 else 's'}.{moved}</p>
<h2>The document</h2>
<p class="legend">Each token is shaded by the share of (layer, KV head) slots that kept it:
<span class="s0">evicted by all</span>{legend}. The first {esc(prefix)} tokens are the chat frame that opens the
document.{sliding}</p>
<div class="doc" id="document">{tokens}</div>
<h2>Kept entries per layer</h2>
<table class="layers"><tr><th>layer</th><th>total</th><th></th><th>per KV head</th></tr>
{chr(10).join(bars)}
</table>
<h2>Metadata</h2>
<table class="meta">
{chr(10).join(rows)}
</table>
</body>
</html>
"""
