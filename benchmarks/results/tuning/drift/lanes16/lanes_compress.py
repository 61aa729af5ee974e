"""klevict's CLI with the drift sampled on LANES lanes (engine.DRIFT_LANES), to time a read's estimate on four lanes
against sixteen (docs/research-log.md, "sixteen lanes"):

    LANES=4 OMP_NUM_THREADS=1 python benchmarks/results/tuning/drift/lanes16/lanes_compress.py compress NOTE.txt \\
        -o /tmp/n.kvc --threads 1 --estimate --json      # read_seconds; again with --no-estimate, and LANES=16
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

from klevict_cli import engine  # noqa: E402

engine.DRIFT_LANES = int(os.environ.get("LANES", engine.DRIFT_LANES))
from klevict_cli.cli import app  # noqa: E402

sys.argv = ["klevict", *sys.argv[1:]]
app()
