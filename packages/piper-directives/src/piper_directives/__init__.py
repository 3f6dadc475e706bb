"""piper-directives: annotations, graph capture, directive rewrites and the schedule library."""

from importlib.metadata import PackageNotFoundError, version

from piper_directives.annotate import annotate
from piper_directives.capturing import CapturedModel, LossModule, capture
from piper_directives.order import Order
from piper_directives.place import Place, insert_communication, place_all
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
from piper_directives.split import Split
from piper_directives.split_backward import requested_splits, split_backward
from piper_directives.strategy import Directive, Strategy, apply_strategy

try:
    __version__ = version("piper-directives")
except PackageNotFoundError:
    __version__ = "0.0.0"

__all__ = [
    "SCHEDULES", "CapturedModel", "Directive", "LossModule", "Order", "Place", "Split", "Strategy",
    "annotate", "apply_strategy", "build_schedule", "capture", "dualpipe", "dualpipev", "gpipe",
    "insert_communication", "interleaved_1f1b", "one_f_one_b", "place_all", "rank_actions",
    "requested_splits", "split_backward", "zb1p",
]
