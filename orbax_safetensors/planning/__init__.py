"""Layer 3: pure planning (no devices, no files): what to read and write where."""

from orbax_safetensors.planning.save_plan import (
    FilePlan,
    SavePlan,
    TensorSpec,
    plan_file,
    plan_hf_checkpoint,
    plan_single_file,
)

__all__ = [
    "FilePlan", "SavePlan", "TensorSpec", "plan_file", "plan_hf_checkpoint", "plan_single_file",
]
