"""``install_orbax_layout``: Orbax's own v1 safetensors entry points load through ours.

Orbax (0.12.5 to 0.12.x) has no registry of layouts: ``CheckpointLayout.SAFETENSORS``
is resolved by ``layout/registry.py``'s ``get_layout_class``, at every call, to the
class its ``safetensors_layout`` module names ``SafetensorsLayout``. Installing
rebinds that one name to ``ost.SafetensorsLayout``, so every caller that asks Orbax
for its safetensors layout gets ours, whatever it imported and however it asked:

* ``ocp.v1.load_pytree``/``load``, ``load_pytree_async``/``load_async`` and
  ``pytree_metadata``/``metadata`` under ``Context(checkpoint_layout=SAFETENSORS)``
  (MaxText 0.2.5's ``source_checkpoint_layout="safetensors_dynamic"`` goes through
  exactly these), and ``CheckpointLayout.AUTO`` where it detects safetensors;
* ``ocp.v1.save_pytree``/``save`` under that context, which Orbax's layout refuses
  (``NotImplementedError``): ours writes the PyTree as ``model.safetensors``, beside the
  step files Orbax adds (``_CHECKPOINT_METADATA``, an empty ``state/``); ``ost.save``
  writes a directory with nothing but the checkpoint.

The switch is process-wide, like Orbax's handler registry, and undone by
``install_orbax_layout(False)``.
"""

from __future__ import annotations

from orbax.checkpoint.experimental.v1._src.layout import safetensors_layout as orbax_safetensors_layout

from orbax_safetensors.integrations.orbax_v1 import SafetensorsLayout

ORBAX_LAYOUT = orbax_safetensors_layout.SafetensorsLayout  # Orbax's own, as imported


def install_orbax_layout(enable: bool = True) -> None:
    """From now on, Orbax's v1 safetensors entry points use ``ost.SafetensorsLayout``.

    ``ocp.v1.load_pytree(path, abstract_state)``, ``ocp.v1.load_async``,
    ``ocp.v1.pytree_metadata`` and everything else that resolves
    ``ocp.v1.options.CheckpointLayout.SAFETENSORS`` (a ``Context(checkpoint_layout=...)``,
    or ``AUTO`` detecting safetensors) get our layout: the checkpoint the catalog finds at
    the path (an HF index decides which files count; without one every ``*.safetensors``),
    read per process from the target sharding with checksums checked, a subset of its
    tensors if the abstract state names one. What code written for Orbax's layout relies
    on holds: a missing tensor is a ``KeyError``, a shape mismatch a ``ValueError``,
    ``metadata`` fills ``commit_timestamp_nsecs``, the context's read budget and
    ``SafetensorsOptions`` apply. ``ost.SafetensorsLayout``'s docstring lists where it
    differs (errors raised before any read, nested abstract states, host arrays for
    leaves without a sharding, and saving).

    Args:
      enable: ``False`` gives Orbax its own layout back.
    """
    orbax_safetensors_layout.SafetensorsLayout = SafetensorsLayout if enable else ORBAX_LAYOUT
