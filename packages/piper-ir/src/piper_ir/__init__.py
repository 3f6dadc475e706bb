"""piper-ir: the intermediate representation shared by every Piper package (no torch)."""

from importlib.metadata import PackageNotFoundError, version

from piper_ir.algorithms import critical_path, find_cycle, rank_orders, reachable, topological_order
from piper_ir.errors import (
    CaptureError,
    DeadlockError,
    DirectiveError,
    ExecutionError,
    MemoryPlanError,
    PiperError,
    SchedulingError,
    SerializationError,
    ValidationError,
)
from piper_ir.graph import (
    BUCKET_KINDS,
    COMMUNICATION_KINDS,
    COMPUTE_KINDS,
    POINT_TO_POINT_KINDS,
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
    Replication,
    Residency,
    Segment,
    SegmentRole,
    Sharding,
    ShardKind,
    TensorMeta,
    Value,
)
from piper_ir.names import GRAD_PREFIX, grad_name, grad_of, is_grad
from piper_ir.program import Communicator, ExecutionOptions, Instruction, Program, RankPlan
from piper_ir.serialize import from_json, to_json
from piper_ir.summary import graph_summary, program_text
from piper_ir.tags import ANY, MB, PASS, SEG, Filter, Phase, Tags
from piper_ir.validate import validate

try:
    __version__ = version("piper-ir")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "ANY", "MB", "PASS", "SEG", "BUCKET_KINDS", "COMMUNICATION_KINDS", "COMPUTE_KINDS", "GRAD_PREFIX",
    "POINT_TO_POINT_KINDS", "Residency", "ShardKind", "ExecutionOptions", "grad_name", "grad_of", "is_grad", "Bucket", "Replication", "CaptureError", "CodeRef", "Communicator",
    "DeadlockError", "DirectiveError", "Edge", "EdgeKind", "ExecutionError", "Filter", "Graph",
    "GradNorm", "Instruction", "MemoryPlanError", "Node", "NormTerm", "NodeKind", "ParamShard", "Phase", "PiperError", "Program",
    "RankPlan", "SchedulingError", "Segment", "SegmentRole", "SerializationError", "Sharding", "Tags",
    "TensorMeta", "ValidationError", "Value", "critical_path", "find_cycle", "from_json",
    "graph_summary", "program_text", "rank_orders", "reachable", "to_json", "topological_order", "validate",
]
