"""Layer 3: pure planning (no devices, no files): what to read and write where."""

from orbax_safetensors.planning.boxes import (
    Box,
    bounding_box,
    box_shape,
    box_size,
    byte_runs,
    full_box,
    intersect,
    normalize_index,
    relative_slices,
)
from orbax_safetensors.planning.read_plan import (
    GAP,
    Piece,
    ReadOp,
    Region,
    RegionRead,
    Runs,
    coalesce,
    plan_region_reads,
    plan_regions,
    read_once_boxes,
    replication_factor,
    row_blocks,
    tensor_runs,
)
from orbax_safetensors.planning.save_plan import (
    FilePlan,
    SavePlan,
    SliceSpec,
    TensorSpec,
    owned_ranges,
    plan_distributed_files,
    plan_file,
    plan_hf_checkpoint,
    plan_single_file,
)

__all__ = [
    "Box", "bounding_box", "box_shape", "box_size", "byte_runs", "full_box", "intersect",
    "normalize_index", "relative_slices",
    "GAP", "Piece", "ReadOp", "Region", "RegionRead", "Runs", "coalesce", "plan_region_reads", "plan_regions", "read_once_boxes",
    "replication_factor", "row_blocks", "tensor_runs",
    "FilePlan", "SavePlan", "SliceSpec", "TensorSpec", "owned_ranges", "plan_distributed_files", "plan_file", "plan_hf_checkpoint", "plan_single_file",
]
