"""`compress --engine ray`: the batch's documents as tasks on a pool of Ray actors, each holding the model once.

Ray (an existing distributed engine, the optional extra `klevict[ray]`) does the scheduling, restarts a worker that
dies and retries its documents; klevict only hands each actor a document's bytes and gets back its manifest record
and `.kvc` bytes. The driver writes every file, so workers need no shared folder for outputs and a worker killed
mid-document leaves nothing half-written; the workers run the same `batch.Worker` as a local batch, so the caches
are the same.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterator

from klevict_cli.batch import Source, Worker, failed
from klevict_cli.errors import DocumentError, KlevictError, UsageError

TASK_RETRIES = 2  # a document whose worker died is tried this many more times (a document that kills every
#                   worker it meets, e.g. out of memory, is then recorded as failed instead of looping forever)
IN_FLIGHT = 2  # documents queued per actor, so that none waits for the driver between documents


def import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--engine ray needs Ray, which is not installed; pip install 'klevict[ray]'") from None
    return ray


class RemoteWorker:
    """The actor: one `Worker` per process. A load failure is kept and returned, not raised, so that it reaches
    the user as the same one-line error as a local run's (a constructor that raised would just be a dead actor)."""

    def __init__(self, opts: dict):
        try:
            self.worker, self.error = Worker(opts), None
        except KlevictError as exc:
            self.worker, self.error = None, exc

    def key(self) -> tuple[str | None, KlevictError | None]:
        return (None, self.error) if self.error is not None else (self.worker.key(), None)

    def compress(self, path: str, kvc: str, data: bytes) -> tuple[dict, bytes | None]:
        return self.worker.compress(path, kvc, data)

    def pid(self) -> int:
        return os.getpid()


class RayEngine:
    """Joins the cluster at `address` (else $RAY_ADDRESS, else starts a local one) and starts `workers` actors
    (default: one per CPU of the cluster, at most one per document)."""

    def __init__(self, opts: dict, address: str | None = None, workers: int | None = None, documents: int = 1,
                 note: Callable[[str], None] = lambda line: None):
        ray = import_ray()
        self.ray = ray
        self.started = not ray.is_initialized()
        if self.started:
            try:
                ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                         logging_level=logging.ERROR, configure_logging=True)
            except Exception as exc:  # ConnectionError, a bad address format, a version mismatch, ...
                where = f"at {address}" if address else "(a local one)"
                raise UsageError(f"--engine ray: cannot start or join the Ray cluster {where}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        cpus = int(ray.cluster_resources().get("CPU", 1))
        count = workers or max(1, min(cpus, documents))
        gpus = 1 if str(opts.get("device", "cpu")).startswith("cuda") else 0
        actor = ray.remote(num_cpus=1, num_gpus=gpus, max_restarts=-1, max_task_retries=TASK_RETRIES)(RemoteWorker)
        self.actors = [actor.remote(opts) for _ in range(count)]
        note(f"ray: {count} worker{'s' if count > 1 else ''} on a cluster of {cpus} CPUs")
        self._key = None

    def key(self) -> str:
        if self._key is None:
            key, error = self.ray.get(self.actors[0].key.remote())
            if error is not None:
                raise error
            self._key = key
        return self._key

    def run(self, sources: list[Source]) -> Iterator[tuple[int, dict, bytes | None]]:
        """Results as they finish, each with its index in `sources`."""
        from klevict_cli.documents import read_source

        queue = deque(enumerate(sources))
        free = [a for a in self.actors for _ in range(IN_FLIGHT)]
        pending: dict = {}  # object ref -> (index, actor)
        while queue or pending:
            while queue and free:
                index, source = queue.popleft()
                try:
                    data = read_source(source.path)
                except DocumentError as exc:
                    yield index, failed(source, exc), None
                    continue
                actor = free.pop()
                pending[actor.compress.remote(source.path, source.kvc, data)] = (index, actor)
            if not pending:
                continue
            done, _ = self.ray.wait(list(pending), num_returns=1)
            for ref in done:
                index, actor = pending.pop(ref)
                free.append(actor)
                try:
                    record, blob = self.ray.get(ref)
                except self.ray.exceptions.RayError as exc:  # its worker died more often than we retry
                    record, blob = failed(sources[index], exc), None
                    record["message"] = str(exc).strip().splitlines()[0] if str(exc).strip() else record["error"]
                yield index, record, blob

    def close(self) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # already gone
                pass
        if self.started:
            self.ray.shutdown()
