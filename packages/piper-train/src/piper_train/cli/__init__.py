"""The ``piper`` command: ``piper train``, ``piper check``, ``piper simulate``, ``piper plan``,
``piper show``, ``piper export`` and ``piper tune``.

``options`` defines the option groups and the parser, ``request`` the strategy the user
asked for (``StrategyRequest``), ``scheduling`` the commands that run no processes
(simulate, plan, show), ``training`` those on Ray (train, check) and ``tuning`` the
strategy search (tune). Exit codes: 0 ok, 1 a
check found a difference, 2 bad input (argparse's usage errors, or a ``PiperError``/``ValueError``
printed as ``piper <command>: error: ...``), 3 the run failed (an ``ExecutionError``: a worker
died, hung past ``--timeout`` or raised; a NaN/Inf with ``--on-nan stop``; printed as
``piper <command>: run failed: ...``), 130 interrupted (Ctrl-C), 143 ended by SIGTERM
(``piper train`` first stops at a step boundary and writes a checkpoint with
``--checkpoint-dir``: ``piper_train.stopping``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from piper_ir import ExecutionError, PiperError
from piper_train import stopping
from piper_train.cli.options import build_parser, check_args
from piper_train.cli.request import StrategyRequest
from piper_train.cli.scheduling import plan_command, show_command, simulate_command

__all__ = ["StrategyRequest", "main"]


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    if name == "tune":
        # Imported here for the same reason: tune profiles the model on the runtime.
        from piper_train.cli import tuning

        return tuning.tune_command
    if name in ("train", "check", "export"):
        # Imported here, not at the top: train and check need torch and ray, and importing
        # them only for these keeps `piper simulate/plan/show` (no processes) free of both.
        from piper_train.cli import training

        return {"train": training.train_command, "check": training.check_command,
                "export": training.export_command}[name]
    return {"simulate": simulate_command, "plan": plan_command, "show": show_command}[name]


def _run(args: argparse.Namespace) -> int:
    try:
        return _command(args.command)(args)
    except Exception:
        # An interrupt can come out as another error: one that cut an import short leaves a
        # "partially initialized module", and the code after it fails on that. Such an error
        # is the interrupt's, not the user's input's.
        stopping.raise_if_interrupted()
        raise


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    # When one rank fails, the runtime reports it and tears every worker down; the other
    # ranks' answers it never reads would otherwise reach stderr as Ray's "Unhandled error"
    # tracebacks after the command's own message.
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    try:
        with stopping.handling_signals():
            return _run(args)
    except ExecutionError as err:  # the input was fine; the run itself failed
        print(f"piper {args.command}: run failed: {err}", file=sys.stderr)
        return 3
    except (PiperError, ValueError) as err:
        print(f"piper {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or a SIGTERM that ends the command at once (``Terminated``)
        if stopping.terminating():
            print(f"piper {args.command}: terminated (SIGTERM)", file=sys.stderr)
            return stopping.EXIT_TERMINATED
        print(f"piper {args.command}: interrupted", file=sys.stderr)
        return 130
