"""What a short note's drift estimate costs with 4 lanes x 16 tokens (as klevict samples below 2,048 tokens read)
against 8 lanes x 8: `compress`'s reading (kl-reconstruct) with its estimate, each timed right after a full read of
the same tokens, the variants in turn. Run from the repository root:

    OMP_NUM_THREADS=2 python benchmarks/results/tuning/drift/lanes8/cost_lanes.py ../shared/data/moby-dick.txt

Prints the paired ratios (compressing read / full read) per variant, and without an estimate for reference.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[5] / "examples"))
from cost import timed_feed  # noqa: E402

from klevict_cli import engine  # noqa: E402
from klevict_cli.documents import load_document  # noqa: E402
from klevict_cli.models import load_model  # noqa: E402
from klevict_cli.prompts import encode_text  # noqa: E402
from klevict_cli.session import Session  # noqa: E402

VARIANTS = {"no estimate": None, "4x16": (4, 32), "8x8": (8, 16)}  # lanes, DRIFT_DRAFTS (a short read samples half)


def main() -> None:
    session = Session(load_model(None, "cpu", "float32"))
    ids = encode_text(session.lm.tokenizer, load_document(sys.argv[1]).text)
    prefix = session.frame.prefix_ids(session.lm.tokenizer)
    step = (len(ids) - 300) // 3
    windows = [prefix + ids[i * step : i * step + 300] for i in range(3)]
    device = torch.device("cpu")
    timed_feed(session, windows[0], "none", None, device)  # first-call costs off the timings
    timed_feed(session, windows[0], "kl-reconstruct", 96, device, estimate=True)
    ratios: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(2):
        for window in windows:
            for name, shape in VARIANTS.items():
                if shape is not None:
                    engine.DRIFT_LANES, engine.DRIFT_DRAFTS = shape
                full = timed_feed(session, window, "none", None, device)
                read = timed_feed(session, window, "kl-reconstruct", 96, device, estimate=shape is not None)
                ratios[name].append(read / full)
    print(f"{len(windows[0])} tokens, torch threads {torch.get_num_threads()}, 96 entries per head")
    for name, r in ratios.items():
        print(f"{name}: median {statistics.median(r):.2f}x (range {min(r):.2f}-{max(r):.2f}x, {len(r)} pairs)")


if __name__ == "__main__":
    main()
