"""piper-ir: the intermediate representation shared by every Piper package (no torch)."""

from piper_ir._version import __version__ as __version__
from piper_ir.algorithms import (
    critical_path,
    find_cycle,
    gc_paused,
    is_acyclic,
    rank_order_positions,
    rank_orders,
    reachable,
    topological_order,
)
from piper_ir.construct import slot_maker
from piper_ir.errors import (
    CaptureError,
    CheckpointError,
    ClusterError,
    DeadlockError,
    DirectiveError,
    ExecutionError,
    HangError,
    MemoryPlanError,
    NumericalError,
    PiperError,
    SchedulingError,
    SerializationError,
    StorageError,
    ValidationError,
)
from piper_ir.graph import (
    BUCKET_KINDS,
    COMMUNICATION_KINDS,
    COMPUTE_KINDS,
    POINT_TO_POINT_KINDS,
    TIE_STREAM,
    Bucket,
    CodeRef,
    Edge,
    EdgeKind,
    GradNorm,
    Graph,
    Node,
    NodeKind,
    NormTerm,
    ParamShard,
    Precision,
    Replication,
    Residency,
    Segment,
    SegmentRole,
    Sharding,
    ShardKind,
    TensorMeta,
    Tie,
    Value,
)
from piper_ir.names import (
    EVENT_PREFIX,
    GRAD_PREFIX,
    MICROBATCH_INFIX,
    backward_halves,
    compute_id,
    event_id,
    grad_name,
    grad_of,
    is_grad,
    microbatch_id,
    transfer_ids,
)
from piper_ir.program import Communicator, ExecutionOptions, Instruction, Program, RankPlan
from piper_ir.rng import rng_seed
from piper_ir.serialize import from_json, to_json
from piper_ir.summary import graph_summary, program_text
from piper_ir.tags import ANY, MB, PASS, SEG, Filter, Phase, Tags
from piper_ir.text import Listing, format_instruction, format_listing, parse_instruction, parse_listing
from piper_ir.validate import cycle_error, validate

__all__ = [
    "ANY", "MB", "PASS", "SEG", "BUCKET_KINDS", "COMMUNICATION_KINDS", "COMPUTE_KINDS", "GRAD_PREFIX",
    "POINT_TO_POINT_KINDS", "TIE_STREAM", "Residency", "ShardKind", "ExecutionOptions", "grad_name", "grad_of", "is_grad", "Bucket", "Replication", "CaptureError", "CheckpointError", "ClusterError", "CodeRef", "Communicator",
    "DeadlockError", "DirectiveError", "Edge", "EdgeKind", "ExecutionError", "Filter", "Graph", "HangError", "NumericalError", "StorageError",
    "GradNorm", "Instruction", "Listing", "MemoryPlanError", "Node", "NodeKind", "NormTerm", "ParamShard", "Phase", "Precision", "PiperError",
    "Program", "RankPlan", "SchedulingError", "Segment", "SegmentRole", "SerializationError", "Sharding", "Tags",
    "TensorMeta", "Tie", "ValidationError", "Value", "critical_path", "cycle_error", "find_cycle", "format_instruction",
    "format_listing", "from_json", "gc_paused", "graph_summary", "is_acyclic", "parse_instruction", "parse_listing",
    "program_text", "rank_order_positions", "rank_orders", "reachable", "rng_seed", "slot_maker", "to_json", "topological_order", "validate",
    "EVENT_PREFIX", "MICROBATCH_INFIX", "backward_halves", "compute_id", "event_id", "microbatch_id", "transfer_ids",
]
