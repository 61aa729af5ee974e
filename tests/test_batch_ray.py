"""`compress --engine ray` on a local 2-CPU Ray instance: the same caches and manifest as a local batch, and a
worker killed mid-batch costs nothing but time. Skipped where the `ray` extra is not installed."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from klevict_cli import batch
from klevict_cli.batch import MANIFEST

from .test_batch import FAST_BATCH, corpus, manifest, model, tensors_of  # noqa: F401 (fixtures)
from .test_cli import assert_error, assert_ok, invoke, no_temp_files

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module; the CLI joins it rather than starting its own."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}})
    yield
    ray.shutdown()


def same_outputs(local: Path, remote: Path) -> None:
    """Byte-identical tensors in every .kvc, and the same manifest but for the timings."""
    names = sorted(p.name for p in local.glob("*.kvc"))
    assert names == sorted(p.name for p in remote.glob("*.kvc")) and names
    for name in names:
        a, b = tensors_of(local / name), tensors_of(remote / name)
        assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and (a[k] == b[k]).all() for k in a), name

    def untimed(folder):
        timings = ("seconds", "read_seconds", "tokens_per_second")
        return [{k: v for k, v in r.items() if k not in timings} for r in manifest(folder)]

    assert untimed(local) == untimed(remote)


def test_ray_batch_matches_the_local_batch(local_ray, corpus, model, tmp_path):
    files = [corpus / f"doc{i}.txt" for i in range(3)]
    (corpus / "bad.txt").write_bytes(b"\x00" * 10)
    args = [*files, corpus / "bad.txt", "--model", model, *FAST_BATCH]
    local = invoke("compress", *args, "-o", f"{tmp_path / 'local'}/")
    remote = invoke("compress", *args, "-o", f"{tmp_path / 'ray'}/", "--engine", "ray", "--workers", "2")
    assert local.exit_code == remote.exit_code == batch.EXIT_SOME_FAILED, remote.stderr
    same_outputs(tmp_path / "local", tmp_path / "ray")


def test_a_killed_worker_does_not_stop_the_batch(local_ray, corpus, model, tmp_path, monkeypatch):
    from klevict_cli.batch_ray import RayEngine

    files = sorted(corpus.rglob("*.*"))
    killed = []
    original = RayEngine.run

    def run_and_kill(self, sources):
        for i, item in enumerate(original(self, sources)):
            if not killed:  # after the first result, while the other documents are in flight
                pid = ray.get(self.actors[0].pid.remote())
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            yield item

    monkeypatch.setattr(RayEngine, "run", run_and_kill)
    out = tmp_path / "ray"
    assert_ok(invoke("compress", *files, "-o", f"{out}/", "--engine", "ray", "--workers", "2", "--model", model,
                     *FAST_BATCH))
    assert killed and no_temp_files(out) == []
    monkeypatch.undo()
    assert_ok(invoke("compress", *files, "-o", f"{tmp_path / 'local'}/", "--model", model, *FAST_BATCH))
    same_outputs(tmp_path / "local", out)

