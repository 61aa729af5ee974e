"""Resident memory of a loaded cache against its file size: does an int4 cache cost its quantized size in RAM?

    python examples/memory.py doc-int4.kvc doc-f32.kvc ... [--out results.json]

Each cache is loaded in a fresh process by the model that made it. The process's resident set (VmRSS) is read with
the model alone (after one short forward, so that the runtime's first-call allocations count as the model's), after
`Session.load` of the cache, and at its peak (VmHWM, reset after the model is loaded) while loading the cache and
answering one question of 16 tokens. Prints one line
per cache: its file size, what loading it added to the resident set, and the peak over the model alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def resident() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes (Linux)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def measure(path: str) -> dict:
    """In this process: the model, then the cache, then one answer."""
    import gc

    import torch

    from klevict_cli.cli import model_of
    from klevict_cli.models import load_model
    from klevict_cli.session import GenerateSettings, Session

    torch.set_num_threads(1)
    session = Session(load_model(model_of(Path(path)), "cpu", "float32"))
    with torch.inference_mode():
        session.lm.model(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]))
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak so far (loading the model's weights) does not count
    model_only = resident()["VmRSS"]
    stream, meta = session.load(Path(path))
    gc.collect()
    loaded = resident()["VmRSS"]
    session.answer(stream, "What is this text about?", GenerateSettings(max_new_tokens=16), meta["position_mode"])
    return {"cache": path, "cache_dtype": meta["cache_dtype"], "file_bytes": Path(path).stat().st_size,
            "rss_model": model_only, "rss_loaded": loaded, "rss_peak": resident()["VmHWM"],
            "cache_entries": sum(sum(c) for c in stream.cache.kept_counts())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("caches", nargs="+")
    parser.add_argument("--out", type=Path, help="Also write the raw numbers to this JSON file.")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.caches[0])))
        return
    rows = []
    for path in args.caches:
        done = subprocess.run([sys.executable, __file__, "--child", path], capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        mb = 1e6
        print(f"{path}: {row['cache_dtype']}, file {row['file_bytes'] / mb:.1f} MB; loading it added"
              f" {(row['rss_loaded'] - row['rss_model']) / mb:.1f} MB"
              f" ({(row['rss_loaded'] - row['rss_model']) / row['file_bytes']:.2f}x the file) to the model's"
              f" {row['rss_model'] / mb:.0f} MB; peak while answering {row['rss_peak'] / mb:.0f} MB"
              f" = {row['rss_peak'] / (row['rss_model'] + row['file_bytes']):.2f}x (model + file)")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
