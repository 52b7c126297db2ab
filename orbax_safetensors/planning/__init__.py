"""Layer 3: pure planning (no devices, no files): what to read and write where."""

from orbax_safetensors.planning.assembly import Assembly, Constant, Piece, Tiling
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
    row_runs,
    row_slabs,
    tiles,
)
from orbax_safetensors.planning.chunking import chunk_boxes, chunk_shape
from orbax_safetensors.planning.read_plan import (
    Batch,
    BlockPart,
    BounceRead,
    ReadPlan,
    ReadProfile,
    Region,
    RegionRead,
    SliceRead,
    StoredSlice,
    TensorReads,
    TensorSource,
    WholeReads,
    box_runs,
    plan_block,
    plan_byte_reads,
    plan_reads,
    plan_region_reads,
    plan_regions,
    plan_tensor_reads,
    plan_whole_reads,
    read_once_boxes,
    replication_factor,
    reshard_parts,
    row_blocks,
)
from orbax_safetensors.planning.group_quantization import NVFP4, IntQuantized, MXFP4Packed
from orbax_safetensors.planning.quantization import FP8, MXFP4
from orbax_safetensors.planning.rules import ConfigSize, Mapping, Rule, Strided
from orbax_safetensors.planning.transfers import GAP, Runs, Segment, Transfer, Transfers, coalesce
from orbax_safetensors.planning.transforms import Transform
from orbax_safetensors.planning.write_plan import (
    HEADER,
    FilePlan,
    SliceSpec,
    TensorSpec,
    Upload,
    WritePlan,
    owned_ranges,
    plan_distributed_files,
    plan_file,
    plan_hf_checkpoint,
    plan_single_file,
    plan_uploads,
)

__all__ = [
    "Assembly", "Constant", "Piece", "Tiling",
    "Box", "bounding_box", "box_shape", "box_size", "byte_runs", "full_box", "intersect",
    "normalize_index", "relative_slices", "row_runs", "row_slabs", "tiles",
    "chunk_boxes", "chunk_shape",
    "Batch", "BlockPart", "BounceRead", "ReadPlan", "ReadProfile", "Region", "RegionRead", "SliceRead",
    "StoredSlice", "TensorReads", "TensorSource", "WholeReads", "box_runs", "plan_block", "plan_byte_reads",
    "plan_reads",
    "plan_region_reads", "plan_regions", "plan_tensor_reads", "plan_whole_reads", "read_once_boxes",
    "replication_factor", "reshard_parts", "row_blocks",
    "FP8", "MXFP4", "IntQuantized", "MXFP4Packed", "NVFP4", "ConfigSize", "Mapping", "Rule", "Strided",
    "GAP", "Runs", "Segment", "Transfer", "Transfers", "coalesce",
    "Transform",
    "HEADER", "FilePlan", "SliceSpec", "TensorSpec", "Upload", "WritePlan", "owned_ranges",
    "plan_distributed_files", "plan_file", "plan_hf_checkpoint", "plan_single_file",
    "plan_uploads",
]
