"""examples/cost.py with the drift estimate sampled on LANES lanes (engine.DRIFT_LANES), to time 16 lanes against
the 4 a read samples now (research log, "the drift estimate against the model's own text"):

    OMP_NUM_THREADS=2 LANES=16 python benchmarks/results/tuning/drift/sampled-truth/cost/lanes_cost.py \\
        ../shared/data/moby-dick.txt --tokens 512 --budgets 10% --methods kl --places 2 --reps 2 --estimate
"""

import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[6]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "benchmarks")]

from klevict_cli import engine  # noqa: E402

engine.DRIFT_LANES = int(os.environ.get("LANES", engine.DRIFT_LANES))
sys.argv = [str(ROOT / "examples" / "cost.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
