"""Documents per minute for a corpus: a shell loop of single `compress` calls against one batch `compress` (one model
load), and Ray with 1 and 2 workers; then the resume check (a batch killed halfway and rerun processes only the
rest).

    python examples/corpus_throughput.py ../shared/data/moby-dick.txt --out benchmarks/results/corpus-throughput.json

The text is cut into `--docs` pieces of about `--tokens` tokens (at paragraph breaks) in a temporary folder; every
run compresses all of them with the same settings into its own output folder. Each run is a fresh `klevict` process,
as a user would start it, so model loading counts. Prints a table; `--out` keeps the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KLEVICT = [sys.executable, "-m", "klevict_cli"]


def cut(text: str, docs: int, chars: int) -> list[str]:
    """`docs` consecutive pieces of about `chars` characters, each ending at a paragraph break."""
    pieces, start = [], len(text) // 10  # skip the front matter
    for _ in range(docs):
        end = text.find("\n\n", start + chars)
        end = len(text) if end < 0 else end
        pieces.append(text[start:end].strip())
        start = end
    return pieces


def run(args: list[str]) -> float:
    """Seconds for one klevict command (a local Ray instance, never one named by $RAY_ADDRESS)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    start = time.perf_counter()
    subprocess.run(KLEVICT + args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def manifest_lines(folder: Path) -> list[dict]:
    path = folder / "manifest.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def kill_halfway(args: list[str], folder: Path, docs: int) -> int:
    """Start a batch, SIGKILL it once half the documents are in the manifest; returns how many were."""
    proc = subprocess.Popen(KLEVICT + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    while proc.poll() is None and len(manifest_lines(folder)) < docs // 2:
        time.sleep(0.5)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return len(manifest_lines(folder))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text", type=Path)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=3000, help="about this many tokens per document")
    parser.add_argument("--settings", default="--budget 10% --no-reconstruct",
                        help="compress options shared by every run")
    parser.add_argument("--runs", default="loop,batch,ray1,ray2,resume")
    parser.add_argument("--out", type=Path)
    ns = parser.parse_args()
    settings = ns.settings.split()
    work = Path(tempfile.mkdtemp(prefix="klevict-corpus-"))
    sources = work / "docs"
    sources.mkdir()
    for i, piece in enumerate(cut(ns.text.read_text(encoding="utf-8"), ns.docs, ns.tokens * 4)):
        (sources / f"doc{i:02d}.txt").write_text(piece, encoding="utf-8")
    files = sorted(str(p) for p in sources.iterdir())
    rows = {}
    for name in ns.runs.split(","):
        out = work / name
        if name == "loop":
            out.mkdir()
            seconds = sum(run(["compress", f, "-o", str(out / (Path(f).stem + ".kvc")), "--quiet", *settings])
                          for f in files)
        elif name == "batch":
            seconds = run(["compress", str(sources), "-o", f"{out}/", "--quiet", *settings])
        elif name.startswith("ray"):
            seconds = run(["compress", str(sources), "-o", f"{out}/", "--quiet", "--engine", "ray", "--workers",
                           name[3:], *settings])
        elif name == "resume":
            args = ["compress", str(sources), "-o", f"{out}/", "--quiet", *settings]
            done = kill_halfway(args, out, ns.docs)
            seconds = run(args)
            lines = manifest_lines(out)
            rows[name] = {"done_before_kill": done, "manifest_lines": len(lines),
                          "processed_after_resume": len(lines) - done, "seconds_after_resume": seconds,
                          "kvc_files": len(list(out.glob("*.kvc")))}
            print(f"resume: {done} documents before the kill, {len(lines) - done} after the rerun "
                  f"({len(list(out.glob('*.kvc')))} .kvc files, {seconds:.0f} s)", flush=True)
            continue
        else:
            raise SystemExit(f"unknown run {name!r}")
        rows[name] = {"seconds": seconds, "docs_per_minute": 60 * ns.docs / seconds}
        print(f"{name:6s} {seconds:7.1f} s  {60 * ns.docs / seconds:5.2f} documents/minute", flush=True)
    result = {"docs": ns.docs, "tokens_per_doc": ns.tokens, "settings": ns.settings, "runs": rows,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "python": platform.python_version()}
    if ns.out:
        ns.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
