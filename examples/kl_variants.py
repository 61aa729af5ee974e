"""Compare variants of the `kl` policy with the look-ahead drafts' randomness held fixed.

    python examples/kl_variants.py ../shared/data/moby-dick.txt samples=4 rounds=1 --budgets 20%,10% --seed 2

Each variant is `KL(...)` keyword arguments (`samples=4,rank=8`), plus `rounds=N` for the draft's Jacobi rounds,
`from_read=0/1` for whether their first round is the read's own predictions, `calibration=document` / `=FILE` for
calibrating on each document or adopting FILE's ratios instead of the model's shipped calibration, `working=F` for
the working limit (× the budget), `reconstruct=1` for reconstruction probes and `sees=span` / `span=N` for how they
re-read; variants that differ in the last two are read in separate bench runs (the same windows).
The read's last eviction is probed by 64 sampled tokens, and one draft decides a window's result: two runs of the
same default with different random streams differ by up to 10 % in mean KL. A variant that changes anything before
the draft (e.g. the calibration's samples) also shifts the random stream the draft is sampled from, so a plain
bench comparison mostly measures that noise. Here every draft is re-seeded from (draft seed, stream length), the
same for every variant, and each window's KL is averaged over `--draft-seeds`. Prints, per budget and variant, the
mean KL and the paired geometric-mean ratio to the default with a bootstrap 95 % interval over windows.
`--task needle` reads needle haystacks instead (`--windows` of them, `--needles` facts each, `--context` tokens) and
prints each variant's answers right, next to the full cache's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import random
from pathlib import Path

from klevict_cli import calibrations
from klevict_cli import probes as probes_module
from klevict_cli.attention import ATTENTION_NAME
from klevict_cli.bench import BenchSettings, run_bench
from klevict_cli.documents import load_document
from klevict_cli.models import load_model
from klevict_cli.policies import POLICIES
from klevict_cli.policies.kl import KL
from klevict_cli.session import Session




def parse_variant(spec: str) -> tuple[dict, int, float | None, bool]:
    """KL kwargs, draft rounds, working limit (× budget) and reconstruction of one variant spec (`sees` and `span`
    go into the kwargs as the policy's reconstruction_sees / reconstruction_span)."""
    kwargs, rounds, working, reconstruct = {}, None, None, False
    for item in filter(None, spec.split(",")):
        key, _, text = item.partition("=")
        value = {"true": True, "false": False}.get(text, text)
        if isinstance(value, str):
            try:
                value = float(text) if "." in text else int(text)
            except ValueError:
                pass
        if key == "rounds":
            rounds = int(value)
        elif key == "from_read":
            kwargs["drafts_from_read"] = bool(value)
        elif key == "working":
            working = float(value)
        elif key == "reconstruct":
            reconstruct = bool(value)
        else:
            kwargs[key] = value
    return kwargs, rounds, working, reconstruct


def register(label: str, kwargs: dict, rounds: int | None) -> None:
    """A policy class named `label` that is KL(**kwargs) — class attributes among them (`copy_distance=...`) set on
    the class — and drafts with `rounds` Jacobi rounds (None: KL's own rule); `calibration=
    document` calibrates on each document even where the model's calibration is shipped, `calibration=FILE` adopts
    the ratios of FILE (examples/calibrate.py's output) instead of the shipped ones."""
    how = {f"reconstruction_{key}": kwargs.pop(key) for key in ("sees", "span") if key in kwargs}
    arguments = inspect.signature(KL.__init__).parameters
    how.update({key: kwargs.pop(key) for key in list(kwargs) if key not in arguments and hasattr(KL, key)})
    if "drafts_from_read" in kwargs:
        how["drafts_from_read"] = kwargs.pop("drafts_from_read")
    calibration = kwargs.pop("calibration", None)
    if calibration == "document":
        how["adopt"] = lambda self, state, kv_heads: None
    elif calibration is not None:
        state = calibrations.state_of(json.loads(Path(calibration).read_text()))
        how["adopt"] = lambda self, _, kv_heads: KL.adopt(self, state, kv_heads)
    if "copy_share" in kwargs:  # the variant's share, not the one the model ships (calibrations.py)
        share, adopt = kwargs["copy_share"], how.get("adopt", KL.adopt)

        def adopt_keeping_share(self, state, kv_heads):
            adopt(self, state, kv_heads)
            self.copy_share, self.observes = share, share > 0

        how["adopt"] = adopt_keeping_share
    if rounds is not None:
        how["draft_rounds"] = lambda self, reread, read, count: rounds
    POLICIES[label] = type(label, (KL,), {"name": label, "variant": True, **how,
                                          "__init__": lambda self: KL.__init__(self, **kwargs)})


def reseeded_draft(draft_seed: int):
    original = probes_module.Drafts.requests

    def requests(self, tokens, read_logits, room, generator):
        generator.manual_seed(7919 * draft_seed + len(tokens))
        return original(self, tokens, read_logits, room, generator)

    return requests


def paired(values: list[float], base: list[float], rng: random.Random) -> tuple[float, float, float]:
    logs = [math.log(v / b) for v, b in zip(values, base)]
    boots = sorted(math.exp(sum(rng.choice(logs) for _ in logs) / len(logs)) for _ in range(4000))
    return math.exp(sum(logs) / len(logs)), boots[100], boots[3899]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("variants", nargs="+", help="KL keyword arguments, e.g. samples=4,rank=8 or rounds=1")
    parser.add_argument("--budgets", default="20%,10%")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seed", type=int, default=2, help="which windows (the bench seed)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--draft-seeds", default="1,2,3")
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--task", choices=("fidelity", "needle"), default="fidelity")
    parser.add_argument("--needles", type=int, default=4)
    args = parser.parse_args()

    labels = ["default"] + args.variants
    groups: dict[tuple, list[str]] = {}
    for label in labels:
        kwargs, rounds, working, reconstruct = parse_variant("" if label == "default" else label)
        register(label, kwargs, rounds)
        groups.setdefault((working, reconstruct), []).append(label)
    session = Session(load_model(args.model, attn_implementation=ATTENTION_NAME, quiet=True))
    document = load_document(args.file)
    original = probes_module.Drafts.requests
    runs = []
    for draft_seed in (int(s) for s in args.draft_seeds.split(",")):
        probes_module.Drafts.requests = reseeded_draft(draft_seed)
        merged = {}
        try:
            for (working, reconstruct), methods in groups.items():
                settings = BenchSettings(methods=methods, budgets=args.budgets.split(","), windows=args.windows,
                                         context=args.context, continuation=256, seed=args.seed, task=args.task,
                                         needles=args.needles, working=working, reconstruct=reconstruct)
                block = run_bench(session, document, settings)[args.task]
                merged.update(block["results"])
                merged["full"] = block["full"]
        finally:
            probes_module.Drafts.requests = original
        runs.append(merged)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "runs": runs}, indent=1, default=str))
    if args.task == "needle":
        print_needles(runs, labels, args.budgets.split(","))
        return
    rng = random.Random(0)
    print(f"\nKL per window averaged over draft seeds {args.draft_seeds}; windows of seed {args.seed}")
    print("\n| budget | variant | mean KL | per draft seed | vs default (paired, 95 %) | windows better |")
    print("|---|---|---|---|---|---|")
    for budget in args.budgets.split(","):
        def per_window(label: str) -> list[float]:
            return [sum(x) / len(x) for x in zip(*(run[label][budget]["per_window"]["kl"] for run in runs))]

        base = per_window("default")
        for label in labels:
            values = per_window(label)
            seeds = " / ".join(f"{run[label][budget]['kl']['mean']:.4f}" for run in runs)
            ratio, low, high = paired(values, base, rng)
            better = sum(v < b for v, b in zip(values, base))
            print(f"| {budget} | {label} | {sum(values) / len(values):.4f} | {seeds} | {ratio:.3f} [{low:.3f}, "
                  f"{high:.3f}] | {better}/{len(values)} |")


def print_needles(runs: list[dict], labels: list[str], budgets: list[str]) -> None:
    """Questions answered right, per budget and variant, summed over the draft seeds' runs."""
    def right(block: dict) -> str:
        correct = [ok for run in block for window in run for ok in window]
        return f"{sum(correct)}/{len(correct)}"

    print(f"\nneedles answered right; full cache {right([run['full']['per_window']['correct'] for run in runs])}")
    print("\n| budget | " + " | ".join(labels) + " |\n|---|" + "---|" * len(labels))
    for budget in budgets:
        cells = [right([run[label][budget]["per_window"]["correct"] for run in runs]) for label in labels]
        print(f"| {budget} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
