"""piper-directives: annotations, graph capture, directive rewrites and the schedule library.

Only the torch side (``_TORCH_SIDE``: ``capture`` and what goes with it, ``shard_modules`` the
tensor-parallel code rewrite, ``PrecisionModel``, ``Randomness``) needs torch; it is imported
on first use, so directive programs and schedules can be built and applied without torch.
"""

import importlib

from piper_directives._version import __version__ as __version__
from piper_directives.annotate import annotate
from piper_directives.common import written_at
from piper_directives.communication import insert_communication
from piper_directives.context_parallel import ContextParallel, context_parallel
from piper_directives.order import Order
from piper_directives.parallelize import (
    DegreeError,
    check_degrees,
    data_parallel,
    expert_parallel,
    parallelize,
    tensor_parallel,
)
from piper_directives.place import Place, place_all, send_streams
from piper_directives.recompute import Recompute, recompute_all
from piper_directives.replicate import Replicate, replicate_all
from piper_directives.schedules import (
    SCHEDULES,
    build_schedule,
    dualpipe,
    dualpipev,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    rank_actions,
    zb1p,
)
from piper_directives.shard import PLAN_STYLES, Shard, shard_all
from piper_directives.shard_buckets import sharded_buckets
from piper_directives.split import Split
from piper_directives.split_backward import requested_splits, split_backward
from piper_directives.strategy import (
    DIRECTIVES,
    Directive,
    SizedStrategy,
    Strategy,
    apply_strategy,
    device_count,
)
from piper_directives.synthetic import synthetic_graph
from piper_directives.torch_format import strategy_from_torch_csv, strategy_to_torch_csv

#: The torch-side public names, by the module that defines them (imported on first use).
_TORCH_SIDE = {
    "capture": "capturing", "CapturedModel": "capturing", "LossModule": "capturing", "Tensors": "capturing",
    "as_tensors": "capturing", "shard_modules": "shard_code", "context_modules": "context_code",
    "ContextLayout": "context_code", "context_degree": "context_code", "PrecisionModel": "precision",
    "Randomness": "randomness",
}


def __getattr__(name: str) -> object:
    module = _TORCH_SIDE.get(name)
    if module is None:
        raise AttributeError(f"module 'piper_directives' has no attribute {name!r}")
    return getattr(importlib.import_module(f"piper_directives.{module}"), name)


__all__ = [
    "DIRECTIVES", "PLAN_STYLES", "SCHEDULES", "CapturedModel", "ContextLayout", "ContextParallel", "context_modules",
    "context_degree", "context_parallel", "DegreeError", "Directive", "LossModule", "Order", "Place",
    "PrecisionModel", "Randomness", "Recompute", "Replicate", "Shard", "Tensors", "as_tensors", "synthetic_graph",
    "SizedStrategy", "Split", "Strategy", "annotate", "apply_strategy", "device_count", "build_schedule", "capture", "check_degrees", "data_parallel", "dualpipe",
    "dualpipev", "expert_parallel", "gpipe", "insert_communication", "interleaved_1f1b", "one_f_one_b",
    "parallelize", "place_all", "rank_actions", "recompute_all", "replicate_all", "requested_splits", "send_streams", "shard_all",
    "shard_modules", "sharded_buckets", "split_backward", "strategy_from_torch_csv", "strategy_to_torch_csv", "tensor_parallel", "written_at", "zb1p",
]
