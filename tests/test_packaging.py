"""What `pip install klevict` puts in site-packages: no top-level name another package could also own."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_installs_no_top_level_kernels_package(tmp_path):
    """Hugging Face's `kernels` package (imported by transformers when installed) would share site-packages/kernels/
    with ours: the scoring kernels install as `klevict_kernels`, from the repository's kernels/ folder."""
    pytest.importorskip("setuptools")
    source = tmp_path / "src"  # a copy, so the build leaves no build/ or egg-info in the repository
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                               "tests", "benchmarks", "docs", "examples"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("klevict-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"klevict_cli", "klevict_kernels"}
    assert "klevict_kernels/kl.py" in names and "klevict_cli/policies/kl.py" in names
    shipped = {path.name for path in (ROOT / "klevict_cli" / "model_calibrations").glob("*.json")}
    assert shipped and {f"klevict_cli/model_calibrations/{name}" for name in shipped} <= set(names)


def test_a_checkout_never_shadows_hugging_faces_kernels():
    """Run from the repository's root (`python -m pytest`, `python -m klevict_cli`), the current folder comes first
    on the path: a kernels/__init__.py there would be found before Hugging Face's `kernels`, which transformers
    (5.25 and later) imports, and break it. Without one, the folder is at most a namespace portion, which any
    installed regular package outranks."""
    code = ("import importlib.util, sys; s = importlib.util.find_spec('kernels'); "
            "print('' if s is None or s.origin is None else s.origin)")
    found = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    assert not found.stdout.strip().startswith(str(ROOT / "kernels"))


def test_klevict_imports_its_kernels_under_their_own_name():
    import klevict_kernels.kl
    from klevict_cli.adapters import through_norm

    assert through_norm is klevict_kernels.kl.through_norm
    assert through_norm.__module__ == "klevict_kernels.kl"
