"""`klevict bench` with every window drawn as if it spanned SPAN tokens (environment), so that runs at two contexts
read windows that start at the same offsets: the shorter one's continuation is the text inside the longer one.
Usage: SPAN=1256 python same_windows.py bench TEXT ... (any bench arguments)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))  # runs from a checkout, installed or not

import klevict_cli.bench as bench  # noqa: E402
from klevict_cli.cli import main  # noqa: E402

drawn = bench.draw_offsets
bench.draw_offsets = lambda n_tokens, span, count, rng: drawn(n_tokens, int(os.environ["SPAN"]), count, rng)
sys.argv = ["klevict", *sys.argv[1:]]
main()
