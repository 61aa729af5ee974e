"""compress (its defaults) and summarize (one new token) on three ~300-token Moby Dick notes, each against the same
command with --method none: read_seconds from --json, one process per command, interleaved, 2 rounds."""
import json, statistics, subprocess, sys
from pathlib import Path
K = "/work/main/.venv/bin/klevict"
text = Path("/work/shared/data/moby-dick.txt").read_text()
notes = []
for k, start in enumerate((200_000, 600_000, 1_000_000)):
    p = Path(f"/tmp/clicost/note{k}.txt"); p.write_text(" ".join(text[start:].split()[:230])); notes.append(p)
cmds = {"compress": lambda p, extra: [K, "compress", str(p), "-o", "/tmp/clicost/x.kvc", "--json", *extra],
        "compress --estimate": lambda p, extra: [K, "compress", str(p), "-o", "/tmp/clicost/x.kvc", "--json", "--estimate", *extra],
        "summarize": lambda p, extra: [K, "summarize", str(p), "--json", "--max-new-tokens", "1", *extra]}
for name in sys.argv[1].split(","):
    cmd, rows = cmds[name], []
    for rep in range(2):
        for p in notes:
            none = json.loads(subprocess.run(cmd(p, ["--method", "none"]), capture_output=True, text=True, check=True).stdout)
            comp = json.loads(subprocess.run(cmd(p, []), capture_output=True, text=True, check=True).stdout)
            rows.append(comp["read_seconds"] / none["read_seconds"])
            print(name, p.name, comp["document"]["tokens"], none["read_seconds"], comp["read_seconds"], f"{rows[-1]:.2f}x",
                  "estimated" if comp.get("estimated_kl") else "", flush=True)
    print(f"{name}: median {statistics.median(rows):.2f}x, range {min(rows):.2f}-{max(rows):.2f}x over {len(rows)} pairs", flush=True)
