"""The load path: from stored bytes to host arrays or sharded ``jax.Array``s.

One vocabulary: a load has *options* resolved into a *policy*, a *plan* of
*jobs*, and an *execution*. A load walks these rooms in order:

1. ``load``: the call resolved once (a ``Location``, a ``LoadTarget``, the
   ``LoadOptions``); per opened version of the checkpoint, steps 2–5.
2. ``options``: ``LoadOptions`` resolved into a ``ReadPolicy`` for this checkpoint.
3. ``target_match``: the target matched against the stored tensors (and a
   mapping's rules); ``targets`` builds such a target from the headers.
4. ``plan``: a ``LoadPlan``, complete before the first byte: per leaf a job
   (``jobs``, ``assembled_leaf``, with the dtype conversions of ``casting``),
   the reads batched under the budget.
5. ``execution``: the plan run: bytes into host buffers (``host_buffers``,
   ``staging``, viewed by ``host_work``), buffers into results, results onto
   devices (``device_assembly``).
"""
