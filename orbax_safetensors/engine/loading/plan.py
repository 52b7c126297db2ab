"""A load plan: everything one load reads and builds, a value complete before its first byte.

``plan_load`` builds it from one opened version of a checkpoint, the call's
``LoadTarget`` and the ``ReadPolicy`` resolved for it:

1. ``target_match.select``: the leaves to load and what each asks for;
2. per leaf, a job (``jobs``): small ones in groups, a mapped leaf of
   several stored tensors an ``AssembledLeaf`` of one job per tensor;
3. every refused cast raised at once (``casting.refuse_casts``);
4. ``planning.plan_reads``: the jobs' reads in batches under the budget.

``execute_load`` runs it (``execution.execute``) and shapes the values
into what ``ost.load`` returns. Nothing is decided while it runs.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import jax

from orbax_safetensors.engine.loading.assembled_leaf import AssembledLeaf, leaf_dtype
from orbax_safetensors.engine.loading.casting import refuse_casts
from orbax_safetensors.engine.core.catalog import Checkpoint
from orbax_safetensors.engine.core.progress import Progress
from orbax_safetensors.engine.loading.execution import LoadStats, execute
from orbax_safetensors.engine.loading.jobs import Job, group_jobs, groupable, host_job, sharded_job
from orbax_safetensors.engine.loading.options import ReadPolicy
from orbax_safetensors.engine.loading.target_match import LeafRequest, LoadTarget, Selection, select
from orbax_safetensors.engine.core.tree_names import nest as nest_names
from orbax_safetensors.planning import ReadPlan, TensorSource, plan_reads
from orbax_safetensors.planning.transforms import Transform

# Where a loaded leaf's value comes from: its job's result, a member of its group job's, or the
# leaf its jobs assembled.
Output = int | tuple[int, int] | AssembledLeaf


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """One load of one opened version of a checkpoint, decided whole.

    ``policy``: as planned (the budget narrowed when jobs stage through scratch).
    ``reads``: the jobs' reads, batched. ``outputs``: per loaded leaf, where its value
    comes from. ``names``: the loaded leaves' names; ``places``: their indices among the
    target's leaves. ``skeleton``: without a target ``None``; else the target's leaves as
    returned when not loaded (an array unchanged, an abstract leaf ``None``), ``treedef``
    their structure. ``skipped``: the target leaves a ``strict=False`` load leaves out.
    """

    checkpoint: Checkpoint
    policy: ReadPolicy
    reads: ReadPlan
    jobs: tuple[Job, ...]
    outputs: tuple[Output, ...]
    names: tuple[str, ...]
    places: tuple[int, ...]
    skeleton: tuple[Any, ...] | None
    treedef: Any
    nest: bool
    skipped: tuple[str, ...]

    def result(self, values: list[Any]) -> Any:
        """What ``ost.load`` returns, of the loaded leaves' ``values`` (in ``names`` order)."""
        if self.skeleton is None:
            flat = dict(zip(self.names, values))
            return nest_names(flat) if self.nest else flat
        leaves = list(self.skeleton)
        for i, value in zip(self.places, values):
            leaves[i] = value
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def plan_load(checkpoint: Checkpoint, target: LoadTarget, policy: ReadPolicy) -> LoadPlan:
    """The plan of loading ``target`` from ``checkpoint`` under ``policy``; raises before any
    read what would fail (mismatches ``target.strict`` refuses, refused casts, names that
    cannot nest)."""
    chosen = select(checkpoint, target)
    names = tuple(chosen.names[i] for i in chosen.wanted)
    if target.nest:
        nest_names(dict.fromkeys(names))  # names that cannot nest fail here, unread
    jobs, outputs = _jobs(checkpoint, chosen, policy)
    refuse_casts([job.refused for job in jobs if job.refused is not None]
                 + [r for out in outputs if isinstance(out, AssembledLeaf) for r in out.refused])
    if any(job.scratch for job in jobs):
        policy = policy.staging_scratch()
    reads = plan_reads([job.reads for job in jobs], policy.profile,
                       {file: c.grid for file, c in policy.checksums.items()})
    return LoadPlan(checkpoint, policy, reads, tuple(jobs), tuple(outputs), names, tuple(chosen.wanted),
                    _skeleton(chosen), chosen.treedef, target.nest, _skipped(chosen))


def execute_load(plan: LoadPlan, stats: LoadStats, *, progress: bool = False,
                 cancelled: threading.Event | None = None,
                 meet: Callable[[str], None] = lambda step: None,
                 check_peers: Callable[[], None] = lambda: None) -> Any:
    """Runs ``plan``: what ``ost.load`` returns. ``progress``: a progress line (process 0);
    ``cancelled``, ``meet`` and ``check_peers`` as ``execution.execute``'s."""
    report = None
    if progress and jax.process_index() == 0:
        report = Progress(f"load {plan.checkpoint.survey.location.url}", plan.reads.nbytes, enabled=True).start()
    values = execute(plan.checkpoint.storage, plan.reads, plan.jobs, plan.policy, stats,
                     cancelled=cancelled, progress=report, meet=meet,
                     check_peers=check_peers)
    if report is not None:
        report.close()
    return plan.result([_output(out, values) for out in plan.outputs])


def _jobs(checkpoint: Checkpoint, chosen: Selection, policy: ReadPolicy) -> tuple[list[Job], list[Output]]:
    """Every job of the wanted leaves, and where each leaf's value will come from."""
    jobs: list[Job] = []
    outputs: list[Output] = []
    grouped: list[tuple[str, TensorSource, Any]] = []  # small tensors read in groups: (stored, source, sharding)
    grouped_outputs: list[int] = []  # where each goes in ``outputs``
    tensors, requests, assemblies = checkpoint.tensors, chosen.requests, chosen.assemblies  # once: 100 000 leaves
    for i in chosen.wanted:
        request = requests[i]
        assembly = None if assemblies is None else assemblies[i]
        if assembly is not None and assembly.transform is None:  # several stored tensors, or quantized
            dtype = request.dtype or leaf_dtype(assembly, tensors)
            leaf = AssembledLeaf(chosen.names[i], tensors, assembly, dtype, request.sharding, policy)
            outputs.append(leaf)
            jobs.extend(leaf.jobs)
            continue
        stored = chosen.names[i] if assembly is None else assembly.pieces[0].stored
        source = tensors[stored]
        transform = None if assembly is None or assembly.transform.is_identity else assembly.transform
        if transform is None and groupable(source, request.dtype, request.sharding):
            grouped.append((stored, source, request.sharding))
            grouped_outputs.append(len(outputs))
            outputs.append(-1)  # its group's job, once the groups are made
            continue
        outputs.append(len(jobs))
        jobs.append(_job(stored, source, request, policy, transform))
    for job, members in group_jobs(grouped, policy.pooled):
        for k, member in enumerate(members):
            outputs[grouped_outputs[member]] = (len(jobs), k)
        jobs.append(job)
    return jobs, outputs


def _job(name: str, source: TensorSource, request: LeafRequest, policy: ReadPolicy,
         transform: Transform | None) -> Job:
    if request.sharding is None:
        return host_job(name, source, request.dtype, policy, transform)
    return sharded_job(name, source, request.dtype, request.sharding, policy, transform)


def _output(out: Output, values: list[Any]) -> Any:
    """A wanted leaf's value: its job's, its group's member's, or its assembled leaf's."""
    if isinstance(out, int):
        return values[out]
    if isinstance(out, tuple):
        return values[out[0]][out[1]]
    return out.value


def _skeleton(chosen: Selection) -> tuple[Any, ...] | None:
    """The target's leaves as returned when not loaded: a skipped leaf the caller gave as a
    value stays; one given as a shape only (nothing to return) becomes None, an empty subtree,
    so no abstract leaf passes for an array."""
    if chosen.treedef is None:
        return None
    return tuple(None if isinstance(leaf, jax.ShapeDtypeStruct) else leaf for leaf in chosen.leaves)


def _skipped(chosen: Selection) -> tuple[str, ...]:
    """The target leaves not loaded (none without a target: only what it holds is named)."""
    if chosen.treedef is None:
        return ()
    loaded = set(chosen.wanted)
    return tuple(name for i, name in enumerate(chosen.names) if i not in loaded)
