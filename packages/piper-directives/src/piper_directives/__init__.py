"""piper-directives: annotations, graph capture, directive rewrites and the schedule library.

Only ``capture`` (and ``CapturedModel``, ``LossModule``) and ``shard_modules`` (the
tensor-parallel code rewrite) need torch; they are imported on first use, so directive
programs and schedules can be built and applied without torch.
"""

from piper_directives._version import __version__ as __version__
from piper_directives.annotate import annotate
from piper_directives.common import written_at
from piper_directives.communication import insert_communication
from piper_directives.order import Order
from piper_directives.parallelize import data_parallel, expert_parallel, parallelize, tensor_parallel
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
from piper_directives.shard import Shard, shard_all
from piper_directives.shard_buckets import sharded_buckets
from piper_directives.split import Split
from piper_directives.split_backward import requested_splits, split_backward
from piper_directives.strategy import DIRECTIVES, Directive, Strategy, apply_strategy
from piper_directives.torch_format import strategy_from_torch_csv, strategy_to_torch_csv

_TORCH_SIDE = {"capture", "CapturedModel", "LossModule"}


def __getattr__(name: str) -> object:
    if name in _TORCH_SIDE:
        from piper_directives import capturing

        return getattr(capturing, name)
    if name == "shard_modules":
        from piper_directives.shard_code import shard_modules

        return shard_modules
    raise AttributeError(f"module 'piper_directives' has no attribute {name!r}")


__all__ = [
    "DIRECTIVES", "SCHEDULES", "CapturedModel", "Directive", "LossModule", "Order", "Place", "Recompute", "Replicate", "Shard",
    "Split", "Strategy", "annotate", "apply_strategy", "build_schedule", "capture", "data_parallel", "dualpipe",
    "dualpipev", "expert_parallel", "gpipe", "insert_communication", "interleaved_1f1b", "one_f_one_b",
    "parallelize", "place_all", "rank_actions", "recompute_all", "replicate_all", "requested_splits", "send_streams", "shard_all",
    "shard_modules", "sharded_buckets", "split_backward", "strategy_from_torch_csv", "strategy_to_torch_csv", "tensor_parallel", "written_at", "zb1p",
]
