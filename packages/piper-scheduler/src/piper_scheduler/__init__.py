"""piper-scheduler: per-rank plans from the global DAG, their verification, and a simulator.

``compile_program(graph)`` lowers a placed, ordered ``piper_ir.Graph`` to a verified
``piper_ir.Program``; ``verify(program)`` proves a program cannot deadlock; ``simulate``
runs it against a ``CostModel``; ``to_chrome_trace`` and ``plot_gantt`` export the result.
``forward_only(graph)`` is the evaluation step of a training graph (forwards only), which
compiles to a program that runs on the training program's workers.
"""

from piper_scheduler._version import __version__ as __version__
from piper_scheduler.analytic import CHUNKS, Link, Roofline, Topology, pipeline_step
from piper_scheduler.compile import compile_program
from piper_scheduler.costs import CostModel
from piper_scheduler.forward_only import forward_only
from piper_scheduler.simulate import measured_timeline, simulate
from piper_scheduler.timeline import Interval, Timeline
from piper_scheduler.trace import plot_gantt, to_chrome_trace
from piper_scheduler.verify import verify

__all__ = [
    "CHUNKS",
    "CostModel",
    "Interval",
    "Link",
    "Roofline",
    "Timeline",
    "Topology",
    "compile_program",
    "forward_only",
    "measured_timeline",
    "pipeline_step",
    "plot_gantt",
    "simulate",
    "to_chrome_trace",
    "verify",
]
