"""How to group int4 / int8 codes: which axis the keys' groups run along, how large a group is, whether each head's
first entries (the attention sink) are kept exact, and whether keys are quantized before their rotary rotation.

    python examples/quant_schemes.py ../shared/data/moby-dick.txt --context 1024 --windows 3 --kept 1,0.5,0.2,0.05

For each window, the full cache and `kl`'s reading at each kept share are read once; every variant then quantizes
that reading's keys and values (kernels/quantize.py), and the KL to the full cache of the next 128 tokens is
measured. Prints the mean KL per kept share and variant; `--out` writes every number.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from klevict_cli.bench import continuation_logits, fidelity_windows, token_metrics
from klevict_cli.models import load_model
from klevict_cli.options import Budget
from klevict_cli.session import ReadSettings, Session
from klevict_kernels.quantize import dequantize, quantize

# name: (bits, group, key axis: -2 along the entries / -1 along the channels, exact first entries, before RoPE)
VARIANTS = {
    "float16": None,
    "int8 g32 entries sink1": (8, 32, -2, 1, False),
    "int8 g32 entries": (8, 32, -2, 0, False),
    "int4 g32 entries": (4, 32, -2, 0, False),
    "int4 g32 channels": (4, 32, -1, 0, False),
    "int4 g64 entries": (4, 64, -2, 0, False),
    "int4 g64 channels": (4, 64, -1, 0, False),
    "int4 g32 entries sink1": (4, 32, -2, 1, False),
    "int4 g32 entries sink4": (4, 32, -2, 4, False),
    "int4 g16 entries sink1": (4, 16, -2, 1, False),
    "int4 g32 entries sink1 pre-rope": (4, 32, -2, 1, True),
}


def stored(session: Session, layer, index: int, variant) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values as `variant` would store them and read them back."""
    if variant is None:
        return layer.keys.half().float(), layer.values.half().float()
    bits, group, axis, exact, pre_rope = variant
    rank = torch.cumsum(layer.valid.long(), dim=1) - 1  # each entry's place among its head's kept ones
    kept_exact = layer.valid & (rank < exact)
    coded = layer.valid & ~kept_exact
    keys = layer.keys
    if pre_rope:
        keys = session.adapter.rerotate(keys, -layer.rope_positions.float(), index)
    keys = dequantize(*quantize(keys, bits, group, axis, coded), bits, group, axis)
    if pre_rope:
        keys = session.adapter.rerotate(keys, layer.rope_positions.float(), index)
    values = dequantize(*quantize(layer.values, bits, 32, -1, coded), bits, 32, -1)
    exact_rows = kept_exact[..., None]
    return (torch.where(exact_rows, layer.keys.half().float(), keys),
            torch.where(exact_rows, layer.values.half().float(), values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text", type=Path)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--continuation", type=int, default=128)
    parser.add_argument("--kept", default="1,0.5,0.2,0.05", help="kept shares (1: the full cache itself)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    session = Session(load_model(None, "cpu", "float32"))
    ids = session.lm.tokenizer(args.text.read_text(encoding="utf-8"))["input_ids"]
    windows = fidelity_windows(session, ids, args.context, args.continuation, args.windows, args.seed)
    offsets = [offset for offset, _, _ in windows]
    kl: dict[str, dict[str, list[float]]] = {}
    for _, window, follow in windows:
        full = session.read_tokens(window, ReadSettings(budget=None, method="none"), reserve=len(follow))
        reference = continuation_logits(full.engine, full.stream.clone(), full.logits, follow)
        for share in args.kept.split(","):
            read = full if float(share) >= 1 else session.read_tokens(
                window, ReadSettings(budget=Budget(fraction=float(share)), method="kl"), reserve=len(follow))
            for name, variant in VARIANTS.items():
                stream = read.stream.clone()
                for index, layer in enumerate(stream.cache.layers):
                    layer.keys, layer.values = stored(session, layer, index, variant)
                logits = continuation_logits(read.engine, stream, read.logits, follow)
                value = token_metrics(reference, logits, torch.tensor(follow))["kl"]
                kl.setdefault(share, {}).setdefault(name, []).append(value)
    for share, per in kl.items():
        for name, values in per.items():
            print(f"kept {share:>5}  {name:34s} KL {sum(values) / len(values):.5f}  "
                  f"per window {[round(v, 5) for v in values]}")
    if args.out:
        args.out.write_text(json.dumps({"settings": vars(args) | {"text": str(args.text), "out": str(args.out)},
                                        "offsets": offsets, "kl": kl}, indent=1) + "\n")


if __name__ == "__main__":
    main()
