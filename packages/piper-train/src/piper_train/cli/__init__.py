"""The ``piper`` command: ``piper train``, ``piper check``, ``piper simulate``, ``piper plan``,
``piper show``, ``piper export`` and ``piper tune``.

``options`` defines the option groups and the parser, ``request`` the strategy the user
asked for (``StrategyRequest``), ``scheduling`` the commands that run no processes
(simulate, plan, show), ``training`` those on Ray (train, check), ``tuning`` the strategy
search (tune) and ``jobs`` the job files of ``--config`` and ``--print-config`` (train,
check). Exit codes: 0 ok, 1 a check found a difference, 2 bad input (argparse's usage
errors, a bad job file, or a ``PiperError``/``ValueError`` printed as ``piper <command>: error: ...``), 3 the run failed (an ``ExecutionError``: a worker
died, hung past ``--timeout`` or raised; a NaN/Inf with ``--on-nan stop``; printed as
``piper <command>: run failed: ...``), 130 interrupted (Ctrl-C), 143 ended by SIGTERM
(``piper train`` first stops at a step boundary and writes a checkpoint with
``--checkpoint-dir``: ``piper_train.stopping``). With ``--json``, stdout holds exactly one JSON
document in each of these outcomes, with ``ok``, ``exit_code`` and ``error``; all else goes to
stderr (``document``). Messages carry a worker's colour codes only to a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence

from piper_ir import ExecutionError, PiperError
from piper_train import stopping
from piper_train.cli import document, early_start, jobs
from piper_train.cli.options import build_parser, check_args
from piper_train.cli.request import StrategyRequest
from piper_train.cli.scheduling import plan_command, show_command, simulate_command

__all__ = ["StrategyRequest", "main"]

RUN_FAILED = 3  # the exit code of a run that failed (a dead or hung worker, NaN)


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    if name == "print-config":  # --print-config (train, check): the options as a job file, nothing run
        return jobs.print_config_command
    if name == "tune":
        # Imported here for the same reason: tune profiles the model on the runtime.
        from piper_train.cli import tuning

        return tuning.tune_command
    if name in ("train", "check", "export", "convert-checkpoint"):
        # Imported here, not at the top: train and check need torch and ray, and importing
        # them only for these keeps `piper simulate/plan/show` (no processes) free of both.
        from piper_train.cli import training

        return {"train": training.train_command, "check": training.check_command,
                "export": training.export_command, "convert-checkpoint": training.convert_command}[name]
    return {"simulate": simulate_command, "plan": plan_command, "show": show_command}[name]


def _run(args: argparse.Namespace) -> int:
    try:
        early_start.start_cluster(args)
        return _command("print-config" if getattr(args, "print_config", None) else args.command)(args)
    except Exception:
        # An interrupt can come out as another error: one that cut an import short leaves a
        # "partially initialized module", and the code after it fails on that. Such an error
        # is the interrupt's, not the user's input's.
        stopping.raise_if_interrupted()
        raise


def main(argv: Sequence[str] | None = None) -> int:
    code = _documented(argv)
    if code == RUN_FAILED and os.environ.get("TORCHELASTIC_RUN_ID"):
        _end_now(code)
    return code


def _end_now(code: int) -> None:
    """End a torchrun rank whose run failed without the interpreter's shutdown: its rank's
    daemon threads may still be inside gloo's or the store's native calls, and finalizing
    the interpreter under them aborted the process now and then (torchrun then reported
    signal 6, not the run's exit code). Everything the command owed is done by now: its
    message and document written, its checkpoints and sinks closed."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _documented(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not document.wanted(argv):
        return _main(argv, None)
    doc = document.Document()
    doc.command = argv[0] if argv and not argv[0].startswith("-") else None  # argparse may refuse it
    code = 1
    try:
        with document.stdout_to_stderr():
            code = _main(argv, doc)
    except SystemExit as exit_:  # argparse: a usage error (2), or --help (0)
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        raise
    except KeyboardInterrupt:  # Ctrl-C outside the command's own handling (while parsing)
        code = 130
        doc.fail(f"{_prog(doc)}: interrupted")
        raise
    except BaseException as exc:  # a bug: its traceback follows on stderr (exit 1)
        doc.fail(f"{_prog(doc)}: {type(exc).__name__}: {exc}")
        raise
    finally:
        doc.write(sys.stdout, code)
    return code


def _prog(doc: document.Document) -> str:
    return f"piper {doc.command}" if doc.command else "piper"


def _main(argv: list[str], doc: document.Document | None) -> int:
    parser = build_parser()
    tee = document.Tee(sys.stderr) if doc is not None else None
    try:
        with contextlib.redirect_stderr(tee) if tee is not None else contextlib.nullcontext():
            args = parser.parse_args(argv)
            if getattr(args, "config", None) is not None:  # a job file: its options, the flags over them
                args = jobs.apply(parser, args, argv)
            check_args(parser, args)
    except SystemExit as exit_:
        if doc is not None and tee is not None and exit_.code:
            doc.fail(tee.usage_error() or "bad command line")
        raise
    args.document = doc  # where the command's --json document goes (``document.emit``)
    if doc is not None:
        doc.command = args.command
    # When one rank fails, the runtime reports it and tears every worker down; the other
    # ranks' answers it never reads would otherwise reach stderr as Ray's "Unhandled error"
    # tracebacks after the command's own message.
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    try:
        with stopping.handling_signals():
            return _run(args)
    except ExecutionError as err:  # the input was fine; the run itself failed
        document.fail(args, f"piper {args.command}: run failed: {err}")
        return RUN_FAILED
    except (PiperError, ValueError) as err:
        document.fail(args, f"piper {args.command}: error: {err}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or a SIGTERM that ends the command at once (``Terminated``)
        if stopping.terminating():
            document.fail(args, f"piper {args.command}: terminated (SIGTERM)")
            return stopping.EXIT_TERMINATED
        document.fail(args, f"piper {args.command}: interrupted")
        return 130
