"""The v0/v1 shim: each Orbax generation restores the safetensors items the other saved.

A step's ``_CHECKPOINT_METADATA`` records, per item, the typestr of the
handler that saved it, and a restore without arguments goes by that string.
The v0 handler records ``orbax_safetensors.SafetensorsCheckpointHandler``; v1
records the dotted path of ``SafetensorsHandler``. So:

- v1 → reads v0 steps: ``SafetensorsHandler`` is registered with the v0
  typestr as a secondary typestr.
- v0 → reads v1 steps: a v0 handler class answering to the v1 typestr is
  registered with Orbax's handler-type registry, with a restore-args class of
  its own (v0 pairs every handler class with exactly one args class, and the
  public ``SafetensorsRestore`` already belongs to the main handler).

Both directions read the same directory through the same engine; the shim
adds names, not code paths.
"""

from __future__ import annotations

import dataclasses

from orbax.checkpoint import args as ocp_args
from orbax.checkpoint.experimental import v1 as ocp_v1
from orbax.checkpoint.experimental.v1._src.handlers import types as v1_handler_types

from orbax_safetensors.integrations.orbax_items import SafetensorsRestore
from orbax_safetensors.integrations.orbax_v0 import TYPESTR, SafetensorsCheckpointHandler
from orbax_safetensors.integrations.orbax_v1 import SafetensorsHandler

V1_TYPESTR = v1_handler_types.typestr(SafetensorsHandler)

if SafetensorsHandler not in (h for h, _ in ocp_v1.handlers.global_registry().get_all_entries()):
    ocp_v1.handlers.register_handler(SafetensorsHandler, secondary_typestrs=[TYPESTR])


class V1StepHandler(SafetensorsCheckpointHandler):
    """The v0 handler under the typestr v1 records, so v0 managers restore v1-saved steps."""

    @classmethod
    def typestr(cls) -> str:
        return V1_TYPESTR


@dataclasses.dataclass
class V1StepRestore(SafetensorsRestore):
    """``SafetensorsRestore`` for ``V1StepHandler``; built by Orbax for argument-less restores."""


ocp_args.register_with_handler(V1StepHandler, for_save=True, for_restore=True)(V1StepRestore)
