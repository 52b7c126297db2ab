"""Executing a read plan: bytes into host buffers, buffers into results, under a memory budget.

``planning.plan_reads`` cut the jobs' reads into batches under the memory
budget, with every request already decided. ``execute`` runs them:

1. a batch takes its bytes from the budget (``_Budget``: a batch waits until
   earlier ones gave theirs back) and its buffers: fresh pages, or recycled
   staging for jobs that only copy from them (``staging.StagingPool``: page-locked
   for accelerators where the platform allows);
2. the read threads (an ``Executor``) fetch its requests (``transfer``: one
   ranged read scattered into the buffers, checked against the files' block
   checksums) and its bounce reads (strided boxes, cut into shards);
3. a single transfer thread finishes the previous batch meanwhile: each job's
   ``finish`` turns its buffers into arrays, and the batch gives its bytes
   back once they exist. The single thread also keeps every process issuing
   cross-process collectives (read once, row blocks resharded) in one order.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from orbax_safetensors.engine.loading.host_buffers import populate, tensor_buffers
from orbax_safetensors.engine.core.integrity import Verifier
from orbax_safetensors.engine.core.progress import Progress
from orbax_safetensors.engine.loading.jobs import Job
from orbax_safetensors.engine.loading.options import ReadPolicy
from orbax_safetensors.engine.loading.staging import StagingPool, accelerator_clients
from orbax_safetensors.planning import GAP, Batch, BounceRead, ReadPlan, Transfer, box_shape
from orbax_safetensors.storage import Storage
from orbax_safetensors.storage.executor import Executor


STOP_WAIT_S = 60.0  # the longest a failed or interrupted load waits for the job finishing then


@dataclasses.dataclass
class LoadStats:
    """What one process's load cost. Pass one to ``ost.load(..., stats=...)``.

    ``bytes_needed`` counts the bytes of the shards this process's devices
    hold (a replicated tensor counts in full); ``bytes_read`` the bytes it
    fetched from storage, which exceeds it by coalesced gaps and falls below
    it for tensors read once per cluster and all-gathered. ``tensors_resharded``
    counts tensors read in row blocks and moved to the target sharding on
    device (``LoadOptions.reshard_thin_shards``). ``bytes_verified`` counts the
    bytes read that were checked against their files' block checksums
    (``LoadOptions.verify_checksums``), ``checksum_overread`` the bytes among
    ``bytes_read`` read only to complete blocks needed in part (less than two
    blocks per contiguous run: 512 KiB at the default block size).
    ``skipped`` names the target leaves a ``strict=False`` load left out
    (absent from the checkpoint, or of another shape). ``staging_peak``: the
    most bytes of recycled staging held at once (``LoadOptions.staging``), of
    which ``staging_pinned`` were registered for DMA with an accelerator.
    """

    bytes_needed: int = 0
    bytes_read: int = 0
    requests: int = 0
    files: int = 0
    tensors: int = 0
    tensors_read_once: int = 0
    tensors_resharded: int = 0
    bytes_verified: int = 0
    checksum_overread: int = 0
    seconds: float = 0.0
    staging_peak: int = 0
    staging_pinned: int = 0
    skipped: list[str] = dataclasses.field(default_factory=list)


def transfer(storage: Storage, file: str, request: Transfer, buffers: Sequence[np.ndarray],
             verifier: Verifier | None = None) -> None:
    """One ranged read, scattered into ``buffers``, its bytes checked by ``verifier`` when it
    holds the file's checksums (raising ``ChecksumError`` for a damaged block).

    Gap bytes land in scratch memory: all gaps in one buffer, overwriting each other,
    unless they are checked (then each keeps its own bytes until hashed).
    """
    checked = verifier is not None and verifier.checks(file)
    gaps = request.lengths[request.targets == GAP]
    scratch = memoryview(np.empty(int(gaps.sum() if checked else gaps.max()) if len(gaps) else 0, np.uint8))
    views: list[memoryview | np.ndarray] = []
    used = 0
    for target, offset, length in zip(request.targets.tolist(), request.offsets.tolist(),
                                      request.lengths.tolist()):  # no Segment per tiny tensor
        if target == GAP:
            views.append(scratch[used:used + length])
            used += length if checked else 0
        elif offset == 0 and length == buffers[target].nbytes:  # all of it (a small tensor, say)
            views.append(buffers[target])
        else:
            views.append(memoryview(buffers[target])[offset:offset + length])
    storage.read_scatter(file, request.offset, views)
    if checked:
        damage = verifier.check(file, request.offset, views)
        if damage:
            raise damage[0].error()


def execute(storage: Storage, plan: ReadPlan, jobs: Sequence[Job], policy: ReadPolicy, stats: LoadStats,
            *, cancelled: threading.Event | None = None, progress: Progress | None = None,
            meet: Callable[[str], None] = lambda step: None,
            check_peers: Callable[[], None] = lambda: None) -> list[Any]:
    """Runs ``plan`` (of ``jobs``' reads, planned under ``policy``): every job's result, in job
    order; stops with ``KeyboardInterrupt`` once ``cancelled`` is set. Reads of the files
    ``policy.checksums`` holds are checked against them (``plan`` reads their blocks whole:
    ``plan_reads`` with their block grids). Before a ``collective`` job's device collective the
    processes ``meet``: one whose reads failed never leaves the others inside a collective it
    will not enter. Each batch and read first calls ``check_peers``, which raises once another
    process failed: the survivors stop within a read, not at the end of their share."""
    stats.tensors += sum(job.tensors for job in jobs)
    stats.tensors_read_once += sum(j.reads.read_once for j in jobs)
    stats.tensors_resharded += sum(j.reads.resharded for j in jobs)
    stats.bytes_needed += sum(j.reads.needed for j in jobs)
    stats.files += len(plan.files)
    stats.checksum_overread += plan.padding
    run = _Run(storage, jobs, policy, stats, progress, meet, check_peers)
    with Executor(policy.threads, name="orbax_safetensors-read", cancelled=cancelled) as run.reading, \
            Executor(1, name="orbax_safetensors-transfer", cancelled=cancelled) as transferring:
        finishing = []
        try:
            for batch in plan.batches:
                if any(f.done() and f.exception() for f in finishing):
                    break
                run.reading.check_cancelled()
                check_peers()
                finishing.append(transferring.submit(run.finish, batch, *run.start(batch)))
            transferring.wait(finishing)
        except BaseException:
            run.pool.close(lent_done=run.stop(finishing))
            raise
    run.pool.close(lent_done=True)
    stats.staging_peak = max(stats.staging_peak, run.pool.peak)
    stats.staging_pinned = max(stats.staging_pinned, run.pool.pinned)
    run.verifier.finish()
    stats.bytes_verified += run.verifier.bytes_verified
    return run.results


class _Run:
    """One execution's state: the budget, the buffers, the checks, the results so far."""

    reading: Executor  # the read threads, set by ``execute``

    def __init__(self, storage: Storage, jobs: Sequence[Job], policy: ReadPolicy, stats: LoadStats,
                 progress: Progress | None, meet: Callable[[str], None], check_peers: Callable[[], None]):
        self.storage, self.jobs, self.stats, self.progress, self.meet = storage, jobs, stats, progress, meet
        self.check_peers = check_peers
        self.budget = _Budget(policy.profile.memory_budget)
        self.pool = StagingPool(policy.profile.memory_budget,
                                accelerator_clients(jax.local_devices()) if policy.pooled else ())
        self.verifier = Verifier(policy.checksums)
        self.results: list[Any] = [None] * len(jobs)
        self.stopped = threading.Event()  # set: no further job finishes
        self._lock = threading.Lock()
        self._bounce = threading.local()

    def start(self, batch: Batch) -> tuple[list[list[np.ndarray]], list[Any], int]:
        """Takes the batch's bytes from the budget and its buffers, and submits its reads."""
        reserved = self.budget.acquire(batch.nbytes)
        buffers = _batch_buffers([self.jobs[i] for i in batch.tensors], self.pool)
        flat = [b for job_buffers in buffers for b in job_buffers]
        by_tensor = dict(zip(batch.tensors, buffers))
        reads = [self.reading.submit(self.bounce, b, by_tensor[b.tensor]) for b in batch.bounced]
        reads += [self.reading.submit(self.read, file, request, flat)
                  for file, transfers in batch.transfers for request in transfers]
        for i in batch.tensors:
            if self.jobs[i].prepare is not None:
                self.jobs[i].prepare()
        return buffers, reads, reserved

    def read(self, file: str, request: Transfer, buffers: Sequence[np.ndarray]) -> None:
        self.reading.check_cancelled()  # queued reads of a cancelled load end here, unread
        self.check_peers()
        transfer(self.storage, file, request, buffers, self.verifier)
        with self._lock:
            self.stats.bytes_read += request.length
            self.stats.requests += 1
        if self.progress is not None:
            self.progress.advance(request.length)

    def bounce(self, bounced: BounceRead, buffers: list[np.ndarray]) -> None:
        """Reads ``bounced.box`` into a temporary and copies each shard's part out."""
        tensor = self.jobs[bounced.tensor].reads
        if getattr(self._bounce, "buffer", np.zeros(0, np.uint8)).size < bounced.nbytes:
            self._bounce.buffer = np.empty(bounced.nbytes, np.uint8)  # reused: faulted in once per thread
        temp = self._bounce.buffer[:bounced.nbytes]
        for request in bounced.transfers:
            self.read(bounced.file, request, [temp])
        source = temp.reshape(box_shape(bounced.box) + (tensor.itemsize,))
        for shard, into, out_of in bounced.copies:
            target = buffers[shard].reshape(box_shape(tensor.shards[shard]) + (tensor.itemsize,))
            populate(target[into])  # faulting page by page from a copy loop costs twice as much
            target[into] = source[out_of]

    def finish(self, batch: Batch, buffers: list[list[np.ndarray]], reads: list[Any], reserved: int) -> None:
        """Once the batch's reads are done, its jobs' results; then its bytes go back."""
        try:
            for future in reads:
                if self.stopped.is_set():
                    return
                future.result()
            for i, job_buffers in zip(batch.tensors, buffers):
                if self.stopped.is_set():
                    return
                job = self.jobs[i]
                if job.collective:
                    self.meet(f"job/{i}")
                self.results[i] = job.finish(job_buffers)
                if isinstance(self.results[i], jax.Array):
                    self.results[i].block_until_ready()  # host buffers may go only once copied
                if job.scratch:
                    self.pool.give(job_buffers)
            buffers.clear()
        finally:
            self.budget.release(reserved)

    def stop(self, finishing: list[concurrent.futures.Future]) -> bool:
        """After a failure or Ctrl-C: no further job finishes, and the one finishing now is
        waited for (up to ``STOP_WAIT_S``), so that no thread is inside a device transfer
        when the error reaches the caller. One that is when the interpreter exits (a script
        ended by its Ctrl-C) takes the process down with SIGABRT from inside jaxlib
        ("terminate called ...") instead of a ``KeyboardInterrupt``. Whether it ended."""
        self.stopped.set()
        return not concurrent.futures.wait(finishing, timeout=STOP_WAIT_S).not_done


class _Budget:
    """Bytes of host buffers alive at once; a request above the total waits for all."""

    def __init__(self, total: int):
        self.total, self.free = total, total
        self._cond = threading.Condition()

    def acquire(self, n: int) -> int:
        n = min(n, self.total)
        with self._cond:
            self._cond.wait_for(lambda: self.free >= n)
            self.free -= n
        return n

    def release(self, n: int) -> None:
        with self._cond:
            self.free += n
            self._cond.notify_all()


def _batch_buffers(jobs: Sequence[Job], pool: StagingPool) -> list[list[np.ndarray]]:
    """Each job's shard buffers: recycled staging for ``scratch`` jobs, fresh pages for the
    others (small tensors sharing allocations: ``host_buffers.tensor_buffers``)."""
    fresh = iter(tensor_buffers([job.reads.shard_nbytes for job in jobs if not job.scratch]))
    return [pool.take(job.reads.shard_nbytes) if job.scratch else next(fresh) for job in jobs]
