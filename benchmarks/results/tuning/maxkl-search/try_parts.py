"""Time the parts of a read, --max-kl's tries among them, inside one klevict command (perf_counter wrappers around
Engine methods, no profiler, so the times are the command's own): each call's seconds, on standard error.

    OMP_NUM_THREADS=2 python benchmarks/results/tuning/maxkl-search/try_parts.py compress NOTE -o OUT.kvc \
        --max-kl 0.1 --estimate --threads 2 --quiet
"""
import sys, time, collections
import klevict_cli.engine as E
T = collections.defaultdict(list)
def wrap(cls, name):
    f = getattr(cls, name)
    def g(self, *a, **k):
        t = time.perf_counter(); r = f(self, *a, **k); T[name].append(time.perf_counter() - t); return r
    setattr(cls, name, g)
for n in ("_keep_best", "measure_drift", "as_stored", "drafts_for_drift", "_at_budget", "forward", "_budget_within", "feed"):
    wrap(E.Engine, n)
orig_clone = E.Stream.clone
def clone(self, *a, **k):
    t = time.perf_counter(); r = orig_clone(self, *a, **k); T["clone"].append(time.perf_counter() - t); return r
E.Stream.clone = clone
from klevict_cli.cli import main
sys.argv = ["klevict"] + sys.argv[1:]
try:
    main()
except SystemExit:
    pass
for k, v in T.items():
    print(f"{k:18s} n={len(v):3d} total {sum(v):6.2f}s  each {[round(x,2) for x in v]}", file=sys.stderr)
