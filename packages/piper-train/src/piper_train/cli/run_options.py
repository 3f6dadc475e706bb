"""The run's options (``piper_runtime.RunOptions``) of ``piper train``'s and ``piper check``'s
flags. Imports no torch: ``early_start`` builds them before the command imports it."""

from __future__ import annotations

import argparse

from piper_runtime import ClusterOptions, ExecutionOptions, FaultOptions, RunOptions


def run_options(args: argparse.Namespace) -> RunOptions:
    """The run's options, from the ``run`` group's flags."""
    return RunOptions(
        execution=ExecutionOptions(bind_cores=not getattr(args, "no_bind_cores", False),
                                   profile_kernels=getattr(args, "profile_step", None) is not None,
                                   memory_snapshot=getattr(args, "memory_snapshot", False),
                                   compile=getattr(args, "compile", None)),
        faults=FaultOptions(timeout_s=args.timeout, on_nan=getattr(args, "on_nan", "stop")),
        cluster=ClusterOptions(runtime=args.runtime, address=args.address, backend=args.backend,
                               placement=args.placement, ranks_per_gpu=args.ranks_per_gpu),
        seed=args.seed,
    )
