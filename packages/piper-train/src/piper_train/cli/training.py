"""``piper train`` and ``piper check``: a strategy on Ray workers, and against single-device
training; ``piper export``: a checkpoint's model as a plain ``state_dict``. Imports torch and
ray (``piper_train.cli`` imports this module only for them)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from piper_ir import CheckpointError
from piper_runtime import OptimizerSpec, StepResult
from piper_train.batches import Prefetcher
from piper_train.check import TOLERANCES, run_check
from piper_train.checkpoints import (
    Checkpoints,
    check_compatible,
    model_state_dict,
    read_checked,
    resolve,
    save_atomically,
    skipped_newer,
)
from piper_train.cli.document import Document, emit, fail
from piper_train.cli.options import say as _say
from piper_train.cli.outputs import output_file, writable_folder, writing
from piper_train.cli.request import StrategyRequest, model_regions
from piper_train.cli.run_options import run_options
from piper_train.hardware import load_hardware
from piper_train.loop import Restart, fit
from piper_train.metrics import (
    SCHEMA,
    CheckpointMetrics,
    EvalMetrics,
    JsonlWriter,
    ProfileWriter,
    Progress,
    Sink,
    StepMetrics,
    TensorBoardWriter,
    WandbWriter,
)
from piper_train.models import MODELS, ModelSpec
from piper_train.schedule import LRSchedule
from piper_train.startup import FirstStepLine
from piper_train.stopping import EXIT_TERMINATED, StopRequest, stopping_on_sigterm
from piper_train.trainer import Trainer
from piper_train.weights import load_weights
from piper_train.workload import load_workload

DEFAULT_STEPS = 20


def say(args: argparse.Namespace, text: str) -> None:
    """``options.say``, except in a torchrun job's processes but rank 0's (``_spmd``)."""
    if not getattr(args, "quiet", False):
        _say(args, text)


def _spmd(args: argparse.Namespace) -> None:
    """Under ``--runtime torchrun`` every process runs the command (docs/torchrun.md): all but
    rank 0's stay quiet (no progress, metrics, profile or ``--json`` document; errors still
    go to stderr). ``piper train`` also refuses Piper's own restarts there (torchrun's
    ``--max-restarts`` starts the processes again) and, in a restarted attempt, resumes from
    the latest checkpoint in ``--checkpoint-dir`` by itself (this job's own)."""
    if args.runtime != "torchrun":
        return
    if os.environ.get("RANK", "0") not in ("", "0"):  # torchrun's variables (the runtime checks them all)
        args.quiet = True
        if isinstance(getattr(args, "document", None), Document):
            args.document.quiet = True
    if getattr(args, "max_restarts", 0):
        raise ValueError("--max-restarts with --runtime torchrun: torchrun restarts the job's processes (its own "
                         "--max-restarts), and each attempt after the first resumes from the latest checkpoint in "
                         "--checkpoint-dir by itself")
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")
    if restarted and getattr(args, "checkpoint_dir", None) is not None:
        args.resume = Checkpoints(args.checkpoint_dir).latest() is not None


def _budget(args: argparse.Namespace) -> int | None:
    return None if args.memory_budget_mb is None else int(args.memory_budget_mb * 2**20)


def _optimizer(args: argparse.Namespace) -> OptimizerSpec:
    lr = args.lr if args.lr is not None else (0.05 if args.optimizer == "sgd" else 3e-3)
    spec = OptimizerSpec(args.optimizer, lr)
    decay = args.weight_decay if args.weight_decay is not None else spec.default_weight_decay
    return OptimizerSpec(args.optimizer, lr, weight_decay=decay, implementation=args.optimizer_impl)


def _schedule(args: argparse.Namespace, total: int | None) -> LRSchedule:
    if args.lr_schedule in ("cosine", "linear") and total is None:
        raise ValueError(f"--lr-schedule {args.lr_schedule} decays over the run, whose length is unknown here "
                         "(the data does not say how many batches an epoch has): give --steps")
    return LRSchedule(args.lr_schedule, args.warmup_steps, total, args.min_lr, args.lr_step_size, args.lr_gamma)


def trainer_options(args: argparse.Namespace, total: int | None) -> dict[str, Any]:
    """``Trainer``'s keyword arguments of the command's options (a job file's too:
    ``jobs.load``): the objects ``piper train`` hands it, for a run of ``total`` steps."""
    return dict(optimizer=_optimizer(args), options=run_options(args), memory_budget_bytes=_budget(args),
                lr_schedule=_schedule(args, total), clip_grad_norm=args.clip_grad_norm,
                measure_grad_norm=args.log_grad_norm, precision=args.precision)


def _load(args: argparse.Namespace) -> ModelSpec:
    workload = load_workload(args.model, stages=model_regions(args), seed=args.seed, batch_size=args.batch_size,
                             regions=args.regions, capture=args.capture, data=args.data, tokenizer=args.tokenizer,
                             seq_len=args.seq_len)
    if workload.about:
        say(args, f"data: {workload.about}")
    if args.init_from is not None:
        loaded = load_weights(workload.model, args.init_from)
        say(args, f"initial weights: {loaded.tensors} tensors from {loaded.files} safetensors file(s) in "
                  f"{args.init_from}")
    return workload


def _describe(args: argparse.Namespace, request: StrategyRequest) -> str:
    """What runs: the strategy's own pipeline ranks and microbatches (a ``--strategy`` file
    says them, not ``--pp``/``--microbatches``), the parallelisms and the precision."""
    pp, microbatches = request.shape()
    precision = f", precision={args.precision}" if args.precision else ""
    recompute = f", recompute={request.recompute_name}" if request.recompute else ""
    cp = f", cp={args.cp}" if getattr(args, "cp", 1) > 1 else ""
    return (f"model {args.model}, {request.name}, pp={pp}, dp={args.dp}, tp={args.tp}, ep={args.ep}{cp}, "
            f"zero={args.zero}, microbatches={microbatches}{precision}{recompute}")


def train_command(args: argparse.Namespace) -> int:
    _spmd(args)
    hardware = load_hardware(args.hardware) if args.hardware is not None else None
    workload = _load(args)
    stream = workload.stream()
    if args.epochs is not None and stream.kind == "function":
        raise ValueError(f"--epochs: the data of model {args.model} is a function of the step, without epochs; "
                         "use --steps")
    steps = args.steps if args.steps is not None or args.epochs is not None else DEFAULT_STEPS
    per_epoch = stream.batches_per_epoch
    total = steps if steps is not None else (args.epochs * per_epoch if per_epoch else None)
    if args.epochs is not None and steps is not None and per_epoch:
        total = min(steps, args.epochs * per_epoch)
    if args.eval_every and workload.eval_batches is None:
        raise ValueError(f"--eval-every: model {args.model} has no held-out data (a factory returns it as eval_data)")
    length = f"{steps} steps" if steps is not None else ""
    if args.epochs is not None:
        length = f"{args.epochs} epochs" + (f" or {length}" if length else "")
    request = StrategyRequest.from_args(args)
    say(args, f"piper train: {_describe(args, request)}, {length}")
    started = time.perf_counter()
    checkpoints = (Checkpoints(args.checkpoint_dir, args.checkpoint_every, args.keep_checkpoints,
                               asynchronous=args.checkpoint_async)
                   if args.checkpoint_dir is not None else None)
    if checkpoints is not None and not args.resume and checkpoints.latest() is not None:
        # Refused before any worker starts (fit refuses too).
        raise CheckpointError(f"{args.checkpoint_dir} already holds checkpoints (the latest: "
                              f"{checkpoints.latest().name}); pass --resume to continue from it, or choose another "
                              "--checkpoint-dir (no checkpoint of another run is overwritten)")
    if checkpoints is not None and args.resume:
        # Nothing to resume from, or a checkpoint of another model: said before any worker starts.
        source = resolve(args.checkpoint_dir)
        try:
            manifest = read_checked(source)  # every file's header too: a damaged one is named now
        except CheckpointError as err:  # damaged after it was written: the user decides what to do with it
            raise CheckpointError(f"{err}; to resume from the checkpoint before it, move {source} out of "
                                  f"{args.checkpoint_dir}") from None
        passed_over = "".join(f"; not from the newer {p.name}: {why}"
                              for p, why in skipped_newer(Path(args.checkpoint_dir)))
        say(args, f"piper train: resuming from {source}{passed_over}")
        try:
            check_compatible(
                source, manifest,
                {name: tuple(p.shape) for name, p in workload.model.named_parameters(remove_duplicate=False)},
                args.optimizer)
        except CheckpointError as err:
            if args.model in MODELS and "another model" in str(err):  # the usual cause with a built-in model
                raise CheckpointError(f"{err}; a built-in model's depth follows --stages (here {model_regions(args)}, "
                                      "by default the schedule's stages on --pp ranks): pass the --stages it was "
                                      "trained with") from None
            raise
    # Folders written during the run: one that cannot be is refused now, not at its first use.
    if checkpoints is not None:
        writable_folder(args.checkpoint_dir, "--checkpoint-dir")
    if args.profile_step is not None:
        writable_folder(args.profile_dir, "--profile-dir")
    with contextlib.ExitStack() as stack:
        sinks = _sinks(args, stack)  # before any worker starts: a sink that cannot be made is bad input
        sinks.append(_NonFinite(args))
        sinks.append(FirstStepLine(lambda text: say(args, text)))
        record = _Record()
        sinks.append(record)
        stack.push(record.on_exit(args))  # a run that fails or is interrupted: its document so far
        trainer = stack.enter_context(Trainer(
            workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn,
            request.for_trainer(), **trainer_options(args, total), log=lambda text: say(args, text),
            regions=workload.regions, capture_method=workload.capture,
        ))
        record.trainer = trainer
        say(args, f"workers up after {time.perf_counter() - started:.1f} s")
        if args.profile_step is not None and trainer.coordinator:
            profile = ProfileWriter(args.profile_step, args.profile_dir, trainer.program, lambda s: say(args, s))
            stack.callback(profile.close)  # waits for its chart
            sinks.append(profile)
        data = Prefetcher(stream, args.prefetch) if args.prefetch else stream
        if args.prefetch:
            stack.callback(data.close)
        # Under torchrun a SIGTERM ends the process at once: it comes from torchrun's agent (a peer
        # failed, or the job is cancelled), and a last checkpoint would need every rank.
        with (stopping_on_sigterm(StopRequest()) if args.runtime != "torchrun"
              else contextlib.nullcontext(None)) as stop:
            run = fit(trainer, data, steps=steps, epochs=args.epochs, held_out=workload.eval_batches,
                      eval_every=args.eval_every, eval_batches=args.eval_batches, sinks=sinks,
                      profile_step=args.profile_step, checkpoints=checkpoints, resume=args.resume,
                      max_restarts=args.max_restarts, steps_per_call=args.steps_per_call, stop=stop,
                      hardware=hardware)
        for r in run.restarts:
            say(args, f"restarted after step {r.failed_step - 1} failed ({r.error}): new workers, checkpoint of step "
                      f"{r.resumed_from} loaded in {r.seconds:.1f} s, {r.recomputed} steps recomputed")
    history = run.steps
    summary = _summary(args, trainer, history, run.evals, run.checkpoints, run.restarts, run.stopped)
    losses = summary["losses"]
    if args.json:
        emit(args, summary)
    elif losses:
        ending = "stopped" if run.stopped else "done"
        say(args, f"{ending}: {len(history)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
                  f"{summary['mean_step_seconds'] * 1000:.1f} ms/step")
    if run.stopped:
        latest = checkpoints.latest() if checkpoints is not None else None
        if checkpoints is None:
            saved = "nothing is saved without --checkpoint-dir"
        else:
            ended = f" (the workers ended first: {run.stop_failure})" if run.stop_failure else ""
            saved = (f"no checkpoint was written{ended}" if latest is None
                     else f"the latest checkpoint is {latest}{ended} (--resume continues from it)")
        fail(args, f"piper train: stopped on {run.stopped} after step {trainer.state.step}; {saved}")
        return EXIT_TERMINATED
    return 0


def _summary(args: argparse.Namespace, trainer: Trainer | None, history: Sequence[StepMetrics],
             evals: Sequence[EvalMetrics], checkpoints: Sequence[Path], restarts: Sequence[Restart],
             stopped: str | None) -> dict[str, Any]:
    """``piper train --json``'s document: of the whole run, or of the steps before it failed
    (``trainer`` ``None``: it never started; its figures are then ``None``)."""
    program = trainer.program if trainer is not None else None
    losses = [m.loss for m in history]
    steady = [m.step_seconds for m in history[1:]] or [m.step_seconds for m in history]
    return {
        "schema": SCHEMA, "command": "train", "model": args.model,
        "schedule": None if args.strategy else args.schedule,
        "strategy": str(args.strategy) if args.strategy else None,
        "pp": len(program.ranks) // (program.replicas * args.tp) if program is not None else None,
        "dp": program.replicas // (args.ep * getattr(args, "cp", 1)) if program is not None else None, "tp": args.tp,
        "ep": args.ep, "cp": getattr(args, "cp", 1),
        "zero": args.zero, "microbatches": program.microbatches if program is not None else None,
        "steps": len(history), "epochs": history[-1].epoch + 1 if history else 0,
        "losses": losses, "lrs": [m.lr for m in history], "grad_norms": [m.grad_norm for m in history],
        "eval": [{"step": e.step, "loss": e.loss} for e in evals],
        "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "mean_step_seconds": sum(steady) / len(steady) if steady else None,
        "compile_seconds": trainer.compile_seconds if trainer is not None else None,
        # --compile: the ranks' torch.compile time, the slowest rank's per step, summed
        "torch_compile_seconds": sum(m.torch_compile_seconds for m in history),
        # one program per shape of a batch's pieces (another sequence length, a partial batch)
        "plans": trainer.plans if trainer is not None else None,
        "plan_compile_seconds": list(trainer.variant_seconds) if trainer is not None else [],
        # (a resumed run's steps before its first accounted one carry no peaks)
        "peak_memory_bytes": [max(per_rank) for per_rank in zip(
            *(m.peak_memory_bytes for m in history if m.peak_memory_bytes), strict=True)],
        "first_step": history[0].step if history else None,
        "checkpoints": [str(p) for p in checkpoints],
        "restarts": [{"failed_step": r.failed_step, "resumed_from": r.resumed_from, "recomputed": r.recomputed,
                      "seconds": r.seconds, "error": r.error} for r in restarts],
        "skipped_steps": [m.step for m in history if m.skipped],
        "stopped": stopped,
        # model FLOPs per second per device and MFU (--hardware), medians of the steps after the first
        "tflops_per_device": _median([m.tflops_per_device for m in history[1:] or history]),
        "mfu": _median([m.mfu for m in history[1:] or history]),
        "hardware": args.hardware,
    }


def _median(values: Sequence[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    return known[len(known) // 2] if known else None


class _Record:
    """The steps, evaluations and checkpoints of a run as they come: with ``--json``, a run
    that fails or is interrupted still leaves a document of what it did (``on_exit``; the
    restarts it made are known only to a run that ends)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.steps: dict[int, StepMetrics] = {}  # by step: a step recomputed after a restart replaces its first run
        self.evals: list[EvalMetrics] = []
        self.checkpoints: list[Path] = []

    def on_step(self, metrics: StepMetrics, result: StepResult) -> None:
        self.steps[metrics.step] = metrics

    def on_eval(self, metrics: EvalMetrics) -> None:
        self.evals.append(metrics)

    def on_checkpoint(self, metrics: CheckpointMetrics) -> None:
        self.checkpoints.append(Path(metrics.path))

    def close(self) -> None:
        pass

    def on_exit(self, args: argparse.Namespace) -> Callable[..., bool]:
        """An exit callback (``ExitStack.push``) handing the document so far to ``--json``
        when the block ends by an exception; it lets the exception go on."""

        def exit_(kind: type[BaseException] | None, *_: object) -> bool:
            if kind is not None and args.json:
                history = [self.steps[k] for k in sorted(self.steps)]
                emit(args, _summary(args, self.trainer, history, self.evals, self.checkpoints, (), None))
            return False

        return exit_


def export_command(args: argparse.Namespace) -> int:
    if args.format == "hf":
        return _export_hf(args)
    out = _checked_output(args.out, "--out")
    state = model_state_dict(args.checkpoint)
    with writing(out, "--out"):
        save_atomically(state, out)
    count = sum(t.numel() for t in state.values())
    print(f"piper export: {len(state)} tensors ({count} elements) to {out}")
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from piper_train.hf import is_hf, save_pretrained

    if args.model is None or not is_hf(args.model):
        raise ValueError("piper export --format hf needs the run's --model hf:PATH (its config goes into the folder)")
    if args.out.exists():
        raise ValueError(f"--out {args.out} exists; --format hf writes a new folder")
    _checked_output(args.out, "--out")
    state = model_state_dict(args.checkpoint)
    with writing(args.out, "--out"):
        count = save_pretrained(args.model, state, args.out)
    print(f"piper export: {count} tensors to the Hugging Face folder {args.out}")
    return 0


def _checked_output(path: Path, option: str) -> Path:
    try:
        return output_file(str(path))
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"{option}: {err}") from None


def convert_command(args: argparse.Namespace) -> int:
    from piper_train.legacy import convert

    out = convert(args.checkpoint, args.out)
    print(f"piper convert-checkpoint: {args.checkpoint} -> {out}")
    return 0


def _sinks(args: argparse.Namespace, stack: contextlib.ExitStack) -> list[Sink]:
    """Where the steps' metrics go (the profile writer, which needs the program, comes
    later); each is closed when the run ends."""
    if getattr(args, "quiet", False):  # a torchrun job's process but rank 0's (``_spmd``)
        return []
    stream = sys.stderr if args.json else sys.stdout
    sinks: list[Sink] = [Progress(stream, bar=False if args.no_progress_bar else None)]
    if args.metrics is not None:
        sinks.append(JsonlWriter(args.metrics))
    if args.tensorboard is not None:
        sinks.append(TensorBoardWriter(args.tensorboard))
    if args.wandb is not None:
        sinks.append(WandbWriter(args.wandb, run_config(args)))
    for sink in sinks:
        stack.callback(sink.close)
    return sinks


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The command's options as plain values (a sink's record of how the run was started)."""
    skip = {"func", "subparser", "document", "quiet"}
    return {k: v if isinstance(v, bool | int | float | str | type(None)) else str(v)
            for k, v in sorted(vars(args).items()) if k not in skip}


class _NonFinite:
    """Says where a step went non-finite and what ``--on-nan`` did with it (with ``stop`` the
    run has already failed, naming it)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def on_step(self, metrics: StepMetrics, result: StepResult) -> None:
        if metrics.nonfinite is not None:
            what = ("step skipped (parameters and optimizer state as before it)" if metrics.skipped
                    else "kept (--on-nan continue)")
            say(self.args, f"step {metrics.step}: {metrics.nonfinite}; {what}")

    def on_eval(self, metrics: object) -> None:
        pass

    def close(self) -> None:
        pass


def check_command(args: argparse.Namespace) -> int:
    _spmd(args)
    workload = _load(args)
    if args.eval_batches and workload.eval_batches is None:
        raise ValueError(f"--eval-batches: model {args.model} has no held-out data (a factory returns it as eval_data)")
    request = StrategyRequest.from_args(args)
    say(args, f"piper check: {_describe(args, request)}, {args.steps} steps vs single-device training")
    rtol, atol = TOLERANCES[args.precision or "fp32"]
    args.rtol = rtol if args.rtol is None else args.rtol
    args.atol = atol if args.atol is None else args.atol
    report = run_check(workload, request.for_trainer(), steps=args.steps,
                       optimizer=_optimizer(args), rtol=args.rtol, atol=args.atol, options=run_options(args),
                       log=lambda s: say(args, s), memory_budget_bytes=_budget(args),
                       lr_schedule=_schedule(args, args.steps), clip_grad_norm=args.clip_grad_norm,
                       eval_batches=args.eval_batches, precision=args.precision)
    quantities = ["loss", "grad", "param"] + [w for w in ("grad_norm", "eval") if any(
        d.what == w for d in report.differences)]
    rows = {what: report.worst(what) for what in quantities}
    for what, d in rows.items():
        say(args, f"largest {what:<5} difference: abs {d.abs:.3e}  rel {d.rel:.3e}  ({d.where})")
    verdict = "PASS" if report.ok else "FAIL"
    say(args, f"{verdict}: within rtol={args.rtol:g}, atol={args.atol:g}" if report.ok
        else f"{verdict}: differences exceed rtol={args.rtol:g}, atol={args.atol:g}")
    if not report.ok:
        say(args, report.failures())
    if args.json:
        emit(args, {"schema": SCHEMA, "command": "check", "ok": report.ok, "steps": report.steps,
                     "grad_norms": list(report.grad_norms),
                     **{f"max_{w}_abs": d.abs for w, d in rows.items()},
                     **{f"max_{w}_rel": d.rel for w, d in rows.items()},
                     # the first batch's loss whole against the mean of its pieces' (a warning when not)
                     "whole_batch_loss_matches": report.whole_batch.ok if report.whole_batch else None,
                     "whole_batch_loss_rel": report.whole_batch.rel if report.whole_batch else None,
                     "params_not_compared": report.params_not_compared})
    return 0 if report.ok else 1

