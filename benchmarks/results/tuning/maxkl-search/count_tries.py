"""How many measurements `--max-kl`'s search takes on real reads: `klevict bench` with the search counted.

Runs the bench command given after `--` with klevict_cli.tolerance.smallest_within wrapped, and writes one JSON
line per search (the tolerance it searched, in sampled KL, and each budget measured with its sampled drift) to OUT.
`--variant` runs the variant the replays favoured instead (replay_variants.py: exponent 0.7 through one measurement
and the opening rule), so both can be counted on the same windows; the count does not depend on the machine's load,
which the read times do.

    python benchmarks/results/tuning/maxkl-search/count_tries.py OUT.jsonl [--variant] -- bench TEXT --methods kl \
        --budgets 10% --max-kl 0.01,0.03,0.1 --estimate --windows 4 --context 512 --seed 1 --threads 1 --quiet
    python benchmarks/results/tuning/maxkl-search/count_tries.py --summary OUT.jsonl...
"""
import json
import statistics
import sys
from pathlib import Path


def counted(out: Path, variant: bool, bench_args: list[str]) -> None:
    import klevict_cli.engine as engine
    from klevict_cli.cli import main

    if variant:
        sys.path.insert(0, str(Path(__file__).parent))
        from replay_variants import use

        use(beta_one=0.7, opening_rule=True)
    search = engine.smallest_within

    def wrapped(drift, predicted, least, most, within, known=None):
        measured = []

        def measure(budget):
            measured.append((budget, drift(budget)))
            return measured[-1][1]

        found = search(measure, predicted, least, most, within, known)
        with out.open("a", encoding="utf-8") as sink:
            sink.write(json.dumps({"tolerance": within, "budget": found[0], "measured": measured}) + "\n")
        return found

    engine.smallest_within = wrapped
    sys.argv = ["klevict", *bench_args]
    main()


def summary(paths: list[str]) -> None:
    """Each file's mean count, then pooled over the files whose names share the part before the first `-`."""
    pooled: dict[str, list[int]] = {}
    for path in paths:
        counts = [len(json.loads(line)["measured"]) for line in Path(path).read_text().splitlines()]
        pooled.setdefault(Path(path).name.split("-")[0], []).extend(counts)
        print(f"{path}: {len(counts)} searches, {statistics.fmean(counts):.2f} measurements on average "
              f"(at most {max(counts)})")
    for name, counts in pooled.items():
        print(f"{name}: {len(counts)} searches, {statistics.fmean(counts):.2f} on average (at most {max(counts)})")


if __name__ == "__main__":
    if sys.argv[1] == "--summary":
        summary(sys.argv[2:])
    else:
        split = sys.argv.index("--")
        counted(Path(sys.argv[1]), "--variant" in sys.argv[2:split], sys.argv[split + 1:])
