"""``piper train`` and ``piper check`` start their embedded Ray cluster before they import torch.

The ``ray`` runtime's embedded cluster starts on a thread of its own while the driver works
(``piper_runtime.prepare_runtime``), and its raylet prestarts the rank workers, whose imports
take most of a start's CPU. ``Trainer`` asks for it once it has the model, after the command
has imported torch and built the workload: on two cores the machine's second core idled
through that first second. So the command asks first, from its flags alone: ``prepare_runtime``
and what it needs (Ray, the runtime options, the cluster code) import no torch
(``piper_runtime``'s names load where first used), and neither do the strategy's device count
and the run options here. ``Trainer`` then finds the start under way and takes it, as it would
its own.

Only where the flags alone say the world (no ``--strategy`` file: that is the user's code, run
once, later) and only if they make sense: any error is left to the command, which says it in
its own words; a cluster started for a command that then refuses its input dies with the
process (``piper_runtime.driver.reaper``).
"""

from __future__ import annotations

import argparse

from piper_directives import device_count

STARTS_EARLY = ("train", "check")


def start_cluster(args: argparse.Namespace) -> None:
    """Start what the run's runtime can start ahead, for the world the flags give (module doc)."""
    if args.command not in STARTS_EARLY or getattr(args, "print_config", None) or getattr(args, "strategy", None):
        return
    from piper_runtime import prepare_runtime
    from piper_train.cli.request import StrategyRequest
    from piper_train.cli.run_options import run_options

    try:
        world = device_count(StrategyRequest.from_args(args).for_trainer())
        options = run_options(args)
    except Exception:  # bad input: the command's to say (module doc)
        return
    if world is not None:
        prepare_runtime(options, world)
