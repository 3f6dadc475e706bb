"""What a training run reports, step by step, and where it goes.

``StepMetrics`` / ``EvalMetrics`` / ``CheckpointMetrics`` are one step's, one evaluation's
and one checkpoint's figures; sinks receive them from ``piper_train.loop.fit`` (a sink
without ``on_checkpoint`` is not told of checkpoints):

- ``Progress``: a tqdm bar on a terminal (when tqdm is installed), else one plain line per
  step (``step   12/20  loss ...``), on the given stream, and a line per checkpoint;
- ``JsonlWriter``: one JSON object per line and event (``{"schema": 1, "kind": "step", ...}``),
  standard JSON only (a NaN or infinite number is written as ``null``);
- ``TensorBoardWriter``: scalars for torch's ``SummaryWriter`` (``train/loss``, ``train/lr``,
  ``train/grad_norm``, ``train/step_seconds``, ``train/samples_per_s``, ``train/tokens_per_s``,
  ``train/tflops_per_device``, ``train/mfu``,
  ``train/peak_memory_mib/rank<r>``, ``eval/loss``, ``checkpoint/seconds``); needs the
  ``tensorboard`` package;
- ``WandbWriter``: the JSONL records to a Weights & Biases run (``step/...``, ``eval/...``,
  ``checkpoint/...`` as ``wandb.log`` keys at the training step, ``train/peak_memory_mib/rank<r>``,
  the run's options as its config); ``WANDB_MODE=offline`` and ``WANDB_DIR`` are wandb's own;
  needs the ``wandb`` package (``piper-train[wandb]``);
- ``ProfileWriter``: the measured timeline of one step as a Chrome/Perfetto trace and a
  Gantt PNG (``piper_scheduler.measured_timeline``, ``to_chrome_trace``, ``plot_gantt``).

Only the driver's process writes (under torchrun, rank 0's: the others have no sinks).
"""

from __future__ import annotations

import json
import math
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import attrs

if TYPE_CHECKING:  # this module stays importable without torch (the scheduling commands use it)
    from piper_ir import Program
    from piper_runtime import StepResult

SCHEMA = 1  # version of the machine-readable documents (--json, --metrics)
MIB = 2**20


@attrs.frozen
class StepMetrics:
    """One training step. ``step`` counts from 1; ``step_seconds`` is the step on the
    workers as the driver waits for it, ``data_seconds`` the wait for its batch before;
    ``tokens_per_s`` is ``None`` unless the inputs are token ids; ``peak_memory_bytes`` is
    each rank's peak over the step; ``eta_seconds`` the remaining steps at the mean pace so
    far (``None`` when the run's length is unknown); ``plans`` the programs the run holds after
    it (one per shape of a batch's pieces seen so far: ``Trainer.plans``), ``plan_seconds`` the
    seconds spent compiling those beyond the first (``Trainer.variant_seconds``);
    ``tflops_per_device`` the model's FLOPs per second per device and ``mfu`` that over the
    device's peak (piper_train.flops), ``None`` when unknown."""

    step: int
    epoch: int
    loss: float
    lr: float | None
    grad_norm: float | None
    step_seconds: float
    data_seconds: float
    samples_per_s: float
    tokens_per_s: float | None
    peak_memory_bytes: tuple[int, ...]
    eta_seconds: float | None
    total_steps: int | None = None
    nonfinite: str | None = None  # where a NaN/Inf loss or gradient first appeared (``--on-nan``)
    skipped: bool = False  # the step was undone for it (``on_nan="skip-step"``)
    plans: int = 1
    plan_seconds: float = 0.0
    tflops_per_device: float | None = None  # model FLOPs per second per device (piper_train.flops)
    mfu: float | None = None  # tflops_per_device over the hardware's peak (--hardware), else None
    # Seconds the slowest rank spent compiling segments in this step (--compile; included in
    # step_seconds): the first step's, and a new shape's, are the compile cost.
    torch_compile_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return record("step", self)


@attrs.frozen
class EvalMetrics:
    """One held-out evaluation after training step ``step``: the mean loss over ``batches``."""

    step: int
    loss: float
    batches: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return record("eval", self)


@attrs.frozen
class CheckpointMetrics:
    """A checkpoint written after step ``step`` to ``path``: ``bytes`` on disk, ``seconds`` from
    asking the workers to the rename, of which the steps waited ``waited_seconds`` (all of it,
    unless the ranks wrote their files while the next steps ran: ``Checkpoints.asynchronous``)."""

    step: int
    path: str
    bytes: int
    seconds: float
    waited_seconds: float

    def as_dict(self) -> dict[str, Any]:
        return record("checkpoint", self)


class Sink(Protocol):
    """Receives a run's figures; ``on_checkpoint(CheckpointMetrics)`` is optional."""

    def on_step(self, metrics: StepMetrics, result: StepResult) -> None: ...

    def on_eval(self, metrics: EvalMetrics) -> None: ...

    def close(self) -> None: ...


def record(kind: str, figures: Any) -> dict[str, Any]:
    """One JSON record of ``figures`` (an attrs instance): the schema, its ``kind``, its fields."""
    return json_safe({"schema": SCHEMA, "kind": kind, **attrs.asdict(figures)})


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by the string ``"NaN"``,
    ``"Infinity"`` or ``"-Infinity"``: standard JSON has no such numbers (Python's ``json``
    would write a bare ``NaN``, which most parsers refuse), and a string keeps what it was."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def dumps(value: Any) -> str:
    """Standard JSON (``allow_nan=False`` after ``json_safe``)."""
    return json.dumps(json_safe(value), allow_nan=False)


def step_line(m: StepMetrics) -> str:
    """The plain progress line of one step."""
    total = f"/{m.total_steps}" if m.total_steps else ""
    parts = [f"step {m.step:>4}{total}", f"loss {m.loss:8.4f}"]
    if m.lr is not None:
        parts.append(f"lr {m.lr:.3g}")
    if m.grad_norm is not None:
        parts.append(f"grad norm {m.grad_norm:.3g}")
    parts.append(f"{m.step_seconds * 1000:7.1f} ms/step")
    if m.torch_compile_seconds:
        parts.append(f"(compiling {m.torch_compile_seconds:.1f} s of it)")
    parts.append(f"{m.samples_per_s:,.0f} samples/s")
    if m.tokens_per_s is not None:
        parts.append(f"{m.tokens_per_s:,.0f} tokens/s")
    if m.tflops_per_device is not None:
        parts.append(f"{_tflops(m.tflops_per_device)} TFLOP/s/device" + (f" (MFU {m.mfu:.1%})" if m.mfu is not None else ""))
    if m.peak_memory_bytes:
        parts.append(f"peak {max(m.peak_memory_bytes) / MIB:.1f} MiB/rank")
    if m.eta_seconds is not None:
        parts.append(f"eta {_clock(m.eta_seconds)}")
    return "  ".join(parts)


def _tflops(value: float) -> str:
    """TFLOP/s with three significant digits (a CPU's 0.00412, a GPU's 412)."""
    return f"{value:.3g}"


def eval_line(m: EvalMetrics) -> str:
    return f"eval after step {m.step}: loss {m.loss:.4f} over {m.batches} held-out batches ({m.seconds:.2f} s)"


def checkpoint_line(m: CheckpointMetrics) -> str:
    waited = f"; the steps waited {m.waited_seconds:.2f} s" if m.waited_seconds < m.seconds else ""
    return f"checkpoint after step {m.step}: {m.path} ({m.bytes / MIB:,.1f} MiB in {m.seconds:.2f} s{waited})"


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """Progress on ``stream``: a tqdm bar on a terminal, else plain lines (module doc)."""

    def __init__(self, stream: IO[str] | None = None, *, bar: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self._bar: Any = None
        if bar is None:
            bar = bool(getattr(self.stream, "isatty", lambda: False)())
        if bar:
            try:
                import tqdm
            except ImportError:
                bar = False
            else:
                self._tqdm = tqdm.tqdm
        self.bar = bar

    def on_step(self, metrics: StepMetrics, result: StepResult) -> None:
        if not self.bar:
            print(step_line(metrics), file=self.stream, flush=True)
            return
        if self._bar is None:
            self._bar = self._tqdm(total=metrics.total_steps, file=self.stream, unit="step", dynamic_ncols=True)
        post = {"loss": f"{metrics.loss:.4f}"}
        if metrics.lr is not None:
            post["lr"] = f"{metrics.lr:.3g}"
        if metrics.grad_norm is not None:
            post["gnorm"] = f"{metrics.grad_norm:.3g}"
        if metrics.tokens_per_s is not None:
            post["tok/s"] = f"{metrics.tokens_per_s:,.0f}"
        else:
            post["samples/s"] = f"{metrics.samples_per_s:,.0f}"
        if metrics.peak_memory_bytes:
            post["MiB/rank"] = f"{max(metrics.peak_memory_bytes) / MIB:.1f}"
        self._bar.set_postfix(post, refresh=False)
        self._bar.update(1)

    def on_eval(self, metrics: EvalMetrics) -> None:
        self._line(eval_line(metrics))

    def on_checkpoint(self, metrics: CheckpointMetrics) -> None:
        self._line(checkpoint_line(metrics))

    def _line(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class JsonlWriter:
    """One JSON object per step and evaluation, a line each, flushed as written."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.file = self.path.open("w")
        except OSError as err:
            raise ValueError(f"cannot write metrics to {self.path}: {err}") from None

    def on_step(self, metrics: StepMetrics, result: StepResult) -> None:
        self._write(metrics.as_dict())

    def on_eval(self, metrics: EvalMetrics) -> None:
        self._write(metrics.as_dict())

    def on_checkpoint(self, metrics: CheckpointMetrics) -> None:
        self._write(metrics.as_dict())

    def _write(self, record: dict[str, Any]) -> None:
        self.file.write(dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardWriter:
    """Scalars for TensorBoard through torch's ``SummaryWriter`` (module doc)."""

    def __init__(self, logdir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError(
                f"--tensorboard {logdir}: the tensorboard package is not installed (pip install tensorboard)"
            ) from None
        self.writer = SummaryWriter(log_dir=str(logdir))

    def on_step(self, metrics: StepMetrics, result: StepResult) -> None:
        add, step = self.writer.add_scalar, metrics.step
        add("train/loss", metrics.loss, step)
        for name in ("lr", "grad_norm", "step_seconds", "samples_per_s", "tokens_per_s", "tflops_per_device", "mfu"):
            value = getattr(metrics, name)
            if value is not None:
                add(f"train/{name}", value, step)
        for rank, peak in enumerate(metrics.peak_memory_bytes):
            add(f"train/peak_memory_mib/rank{rank}", peak / MIB, step)

    def on_eval(self, metrics: EvalMetrics) -> None:
        self.writer.add_scalar("eval/loss", metrics.loss, metrics.step)

    def on_checkpoint(self, metrics: CheckpointMetrics) -> None:
        self.writer.add_scalar("checkpoint/seconds", metrics.seconds, metrics.step)

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """A Weights & Biases run receiving what ``JsonlWriter`` writes (module doc). ``target`` is
    ``PROJECT`` or ``PROJECT/RUN`` (the run's display name); ``config``: the run's options.
    ``wandb``: the module (tests give a stand-in); imported here when not given."""

    def __init__(self, target: str, config: dict[str, Any], wandb: Any = None) -> None:
        project, _, name = target.partition("/")
        if wandb is None:
            try:
                import wandb
            except ImportError:
                raise ValueError(
                    f"--wandb {target}: the wandb package is not installed (pip install 'piper-train[wandb]')"
                ) from None
        # console="off": wandb would otherwise wrap this process's stdout (``--json`` promises
        # one document there) to upload it.
        self.run = wandb.init(project=project, name=name or None, config=json_safe(config),
                              settings=wandb.Settings(console="off"))

    def on_step(self, metrics: StepMetrics, result: StepResult) -> None:
        values = _numbers("train", metrics)
        values.update({f"train/peak_memory_mib/rank{r}": peak / MIB for r, peak in enumerate(metrics.peak_memory_bytes)})
        if metrics.nonfinite is not None:
            values["train/nonfinite"] = 1
        self.run.log(values, step=metrics.step)

    def on_eval(self, metrics: EvalMetrics) -> None:
        self.run.log(_numbers("eval", metrics), step=metrics.step)

    def on_checkpoint(self, metrics: CheckpointMetrics) -> None:
        self.run.log(_numbers("checkpoint", metrics), step=metrics.step)

    def close(self) -> None:
        self.run.finish()


def _numbers(prefix: str, figures: Any) -> dict[str, float]:
    """The numeric fields of ``figures`` (an attrs instance) under ``prefix/``, but its step (the
    log's own); NaN and infinities as they are (W&B plots them as such)."""
    return {
        f"{prefix}/{key}": value for key, value in attrs.asdict(figures).items()
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
    }


def merged_kernel_traces(traces: Sequence[tuple[int, str]], world_size: int) -> dict[str, Any]:
    """The ranks' torch.profiler Chrome traces (``StepResult.kernel_traces``) as one: their
    events on one timeline (one host's processes share a clock), each process named after
    the rank(s) it ran (one trace for all of them from the ``local`` runtime's one process)."""
    events: list[Any] = []
    for rank, text in traces:
        document = json.loads(text)
        found = [e for e in (document.get("traceEvents", []) if isinstance(document, dict) else []) if isinstance(e, dict)]
        name = f"piper rank {rank}" if len(traces) == world_size else f"piper ranks 0-{world_size - 1} (one process)"
        for event in found:  # the process's own name ("python") -> the rank(s) it ran
            if event.get("ph") == "M" and event.get("name") == "process_name" and isinstance(event.get("pid"), int):
                event["args"] = {"name": name}
        events.extend(found)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def memory_counters(timelines: Sequence[tuple[int, Sequence[tuple[float, Sequence[int]]]]]) -> dict[str, Any]:
    """Each rank's memory samples (``StepResult.memory_timelines``) as Chrome/Perfetto counter
    tracks: MiB per category (``piper_runtime.rank.memory.CATEGORIES``) over the step, each
    rank's clock from its step's start (as in ``stepN.trace.json``)."""
    from piper_runtime import MEMORY_CATEGORIES as CATEGORIES

    events: list[Any] = []
    for rank, samples in timelines:
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"piper rank {rank} memory"}})
        events.extend(
            {"ph": "C", "name": "memory (MiB)", "pid": rank, "tid": 0, "ts": seconds * 1e6,
             "args": {c: b / MIB for c, b in zip(CATEGORIES, sizes, strict=True)}}
            for seconds, sizes in samples
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_cuda_snapshot(path: Path, snapshot: str) -> Path:
    """A rank's CUDA memory snapshot (JSON text from the rank) written as the pickle that
    https://pytorch.org/memory_viz opens. Piper writes this file and never loads it."""
    import pickle

    with path.open("wb") as f:
        pickle.dump(json.loads(snapshot), f)
    return path


class ProfileWriter:
    """Writes the measured timeline of step ``step`` (whose ``StepResult.timings`` the loop
    asked for) to ``<directory>/step<N>.trace.json`` (Chrome/Perfetto), the ranks'
    torch.profiler traces, when the run recorded them (``ExecutionOptions.profile_kernels``),
    merged into ``<directory>/step<N>.kernels.trace.json`` (every operator, and on a GPU every
    kernel, under the Piper instruction that ran it: ``piper F.s0.mb1``), and, with
    matplotlib installed, ``<directory>/step<N>.png`` (Gantt chart). The chart is drawn on a
    thread of its own (a few hundred ms, most of it importing matplotlib), so the steps after
    the profiled one neither wait for it nor report its time as theirs; ``close`` waits."""

    DRAW_TIMEOUT_S = 120.0

    def __init__(self, step: int, directory: str | Path, program: Program, say: Any = print) -> None:
        self.step = step
        self.directory = Path(directory)
        self.program = program
        self.say = say
        self.written: list[Path] = []
        self._drawing: threading.Thread | None = None

    def on_step(self, metrics: StepMetrics, result: StepResult) -> None:
        if metrics.step != self.step or not result.timings:
            return
        from piper_scheduler import measured_timeline, to_chrome_trace

        spans = [(t.rank, t.instruction, t.start * 1e3, t.end * 1e3) for t in result.timings]
        timeline = measured_timeline(self.program, spans)
        self.directory.mkdir(parents=True, exist_ok=True)
        trace = self.directory / f"step{self.step}.trace.json"
        trace.write_text(json.dumps(to_chrome_trace(timeline)))
        self.written.append(trace)
        if result.kernel_traces:
            kernels = self.directory / f"step{self.step}.kernels.trace.json"
            kernels.write_text(json.dumps(merged_kernel_traces(result.kernel_traces, self.program.world_size)))
            self.written.append(kernels)
        if result.memory_timelines:
            memory = self.directory / f"step{self.step}.memory.trace.json"
            memory.write_text(json.dumps(memory_counters(result.memory_timelines)))
            self.written.append(memory)
        for rank, snapshot in result.cuda_snapshots:
            self.written.append(write_cuda_snapshot(self.directory / f"step{self.step}.rank{rank}.cuda-memory.pickle",
                                                    snapshot))
        self._drawing = threading.Thread(target=self._draw, args=(timeline,), name="piper-profile-chart", daemon=True)
        self._drawing.start()

    def _draw(self, timeline: Any) -> None:
        from piper_scheduler import plot_gantt

        try:
            png = plot_gantt(
                timeline, self.directory / f"step{self.step}.png",
                title=f"step {self.step}, measured (each rank's clock from its step start)", unit="ms",
            )
            self.written.append(png)
        except ImportError:
            self.say("matplotlib is not installed: no Gantt chart (pip install matplotlib)")
        except Exception as err:  # a chart is a convenience: the trace is written, training goes on
            self.say(f"could not draw the Gantt chart of step {self.step}: {err}")
        self.say(f"wrote the timeline of step {self.step}: {', '.join(map(str, self.written))}")

    def on_eval(self, metrics: EvalMetrics) -> None:
        pass

    def close(self) -> None:
        if self._drawing is not None:
            self._drawing.join(self.DRAW_TIMEOUT_S)
