"""How a read's time depends on how torch's OpenMP threads wait, on a machine that other work shares.

Times `klevict compress DOC` (its own read_seconds) three ways — klevict's default (threads wait passively),
libgomp's default (they spin 300,000 times first: GOMP_SPINCOUNT=300000, which klevict leaves as given) and one thread
— on an idle machine, beside one busy process (a Python loop), and as two reads at once. Run it with nothing else on
the machine.

    python examples/contention.py DOC [--reps 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = {"klevict (passive)": {}, "libgomp (spin)": {"GOMP_SPINCOUNT": "300000"},
            "one thread": {"OMP_NUM_THREADS": "1"}}


def start_read(doc: str, out: Path, env: dict) -> subprocess.Popen:
    command = [sys.executable, "-m", "klevict_cli", "compress", doc, "-o", str(out), "--json", "--quiet"]
    return subprocess.Popen(command, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)


def seconds(read: subprocess.Popen) -> float:
    out, _ = read.communicate()
    if read.returncode != 0:
        raise SystemExit(f"compress failed (exit {read.returncode})")
    return json.loads(out)["read_seconds"]


def measure(doc: str, condition: str, env: dict, work: Path) -> list[float]:
    """The read_seconds of the read(s) under `condition`."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if condition == "beside a busy loop" else None
    try:
        reads = [start_read(doc, work / f"{i}.kvc", env) for i in range(2 if condition == "two at once" else 1)]
        return [seconds(read) for read in reads]
    finally:
        if busy is not None:
            busy.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("doc")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    env_base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    os.environ.clear()
    os.environ.update(env_base)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for condition in ("idle", "beside a busy loop", "two at once"):
            for name, env in SETTINGS.items():
                times = [t for _ in range(args.reps) for t in measure(args.doc, condition, env, Path(work))]
                results.setdefault(condition, {})[name] = times
                print(f"{condition:20} {name:18} median {statistics.median(times):7.2f} s  "
                      f"({', '.join(f'{t:.2f}' for t in times)})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"doc": args.doc, "cores": os.cpu_count(), "read_seconds": results},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
