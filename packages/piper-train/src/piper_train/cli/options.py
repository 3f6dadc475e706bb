"""The ``piper`` command line: each option group defined once, added to the subcommands that
take it, and the checks argparse cannot express.

| group | options | subcommands |
| --- | --- | --- |
| model | --model (default lm), --batch-size, --data, --tokenizer, --seq-len (text data: piper_train.text), --regions, --capture | train, check, tune (--regions, --capture: plan) |
| pipeline | --schedule, --strategy, --pp, --stages, --microbatches | train, check, simulate, plan |
| parallelism | --dp, --zero, --tp, --tp-plan, --sp, --ep, --recompute | train, check |
| run | --memory-budget-mb, --optimizer, --optimizer-impl, --lr, --seed, --precision, --runtime, --address, --backend, --placement, --ranks-per-gpu, --timeout | train, check |
| optimization | --lr-schedule, --warmup-steps, --min-lr, --lr-step-size, --lr-gamma, --clip-grad-norm, --weight-decay | train, check |
| job | --config (a job file: .toml or .yaml), --print-config (the effective options as one; piper_train.cli.jobs) | train, check |
| summary | --json (a machine-readable summary; standard JSON: a NaN or infinite number is written as the string "NaN", "Infinity" or "-Infinity") | train, check |
| length, evaluation, metrics | --steps, --epochs, --eval-every, --eval-batches, --metrics, --tensorboard, --wandb, --profile-step, --steps-per-call, --on-nan, ... | train |
| checkpoints | --checkpoint-dir, --checkpoint-every, --keep-checkpoints, --checkpoint-async, --resume, --max-restarts | train |
| simulation | --cost, --json, --png, --trace | simulate, show |
| planning | --hardware, --devices, --model hf:CONFIG, --batch-size, --seq-len, --tp, --zero, --recompute, --sp, --cp (docs/planning.md) | simulate (tune: --hardware, --tp) |
| tune | --devices, --calibrate, --precision, --stages, --memory-budget-mb, --microbatch-range, --schedules, --zero-levels, --recompute, --sp, --cp, --top, --out, --validate, ... | tune |
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from piper_directives import PLAN_STYLES, SCHEDULES, DegreeError, check_degrees
from piper_scheduler import CostModel
from piper_train import bounds
from piper_train.call_size import parse_steps_per_call
from piper_train.cli.outputs import output_file
from piper_train.cli.tp_plan import tp_plan
from piper_train.cli.tp_plan import write as write_tp_plan
from piper_train.schedule import SCHEDULES as LR_SCHEDULES

Group = Callable[[argparse.ArgumentParser], None]

# piper_runtime.optim.IMPLEMENTATIONS, spelled out so that parsing the command line imports no torch.
OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="lm", help="mlp, transformer, lm, moe, path/to/file.py:factory, or hf:PATH (a "
                   "Hugging Face causal LM from a config.json or a model directory with safetensors weights; needs "
                   "piper-train[hf]) (default: lm). A file is EXECUTED (like `python file.py`): name only files you "
                   "trust")
    p.add_argument("--batch-size", type=int, help="samples per batch, for a factory that returns a Dataset, an hf: "
                   "model or --data (refused for data that comes batched)")
    p.add_argument("--data", metavar="text:GLOB|hf:PATH",
                   help="train the built-in lm model (or an hf: model) on text: local files (text:GLOB, each file a document, '**' "
                        "for folders) or a Hugging Face dataset in local files (hf:PATH: a save_to_disk folder, or "
                        ".parquet/.jsonl/.json/.csv/.txt/.arrow files; its 'text' column; needs piper-train[text]), "
                        "tokenized, packed into --seq-len rows with document boundaries kept, reshuffled each epoch")
    p.add_argument("--tokenizer", metavar="FILE|bytes",
                   help="with --data: a tokenizer.json (Hugging Face tokenizers), or bytes: UTF-8 bytes, vocabulary "
                        "256 (default: bytes)")
    p.add_argument("--seq-len", type=int, help="with --data: tokens per packed row (default: 64)")
    p.add_argument("--init-from", type=Path, metavar="PATH",
                   help="initial weights by name from safetensors: a file, or a folder with model.safetensors or a "
                        "sharded set and its index (as save_pretrained and piper export write them); every weight "
                        "of the model must be there (a resumed checkpoint's weights replace them)")
    add_capture(p)


def add_capture(p: argparse.ArgumentParser) -> None:
    p.add_argument("--regions", help="the model's regions by module path, for a model that does not call annotate: "
                   "regions separated by '|', modules of one region by ',', '*' one path component, a lone pattern "
                   "with '*' one region per match (e.g. 'model.embed_tokens | model.layers.* | model.norm, lm_head'; "
                   "default: one region per entry of the model's largest ModuleList)")
    p.add_argument("--capture", choices=["auto", "fx", "export"], default="auto",
                   help="how the model is traced: torch.fx, torch.export, or auto: fx, and export where fx cannot "
                        "(default: auto)")


def add_pipeline(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES), help="pipeline schedule (default: 1f1b)")
    p.add_argument("--strategy", type=Path, help="a directive program (.json) or a torch.distributed.pipelining "
                   "schedule (.csv, one row of actions per rank); replaces --schedule/--pp/--microbatches")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (default: 2)")
    p.add_argument("--stages", type=int,
                   help="annotated regions of a built-in model (default: what the schedule places on --pp ranks)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default: 4)")


def add_parallelism(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel replicas of the pipeline; devices = pp x dp x tp x ep (default: 1)")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                   help="ZeRO level with --dp > 1 or --ep > 1 (for --ep: on the non-expert weights, and on "
                        "the experts across --dp) (default: 0)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per pipeline stage and replica (Megatron-style Shard; adjacent "
                        "devices) (default: 1)")
    p.add_argument("--tp-plan", type=tp_plan, metavar="PATTERN=STYLE,...|FILE.json",
                   help="with --tp: what to cut, by module path ('*' one path component; first match wins), "
                        "instead of the Linears found automatically: e.g. 'layers.*.attention.wq=colwise,"
                        "layers.*.attention.wo=rowwise,output=colwise_vocab', or a JSON file of one object "
                        "pattern -> style (a table in a job file); styles: " + ", ".join(PLAN_STYLES))
    p.add_argument("--sp", action="store_true",
                   help="with --tp: sequence parallelism, the norms, dropout and residual adds between the "
                        "tensor-parallel regions on sequence shards (reduce-scatter / all-gather instead of "
                        "all-reduce; docs/strategies.md)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks per pipeline stage and replica (Shard kind='ep': data-parallel for "
                        "non-expert weights, experts split across the group, each expert's gradient reduced "
                        "over the --dp ranks holding it; adjacent devices) (default: 1)")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel ranks per pipeline stage and replica: every sequence cut along dimension "
                        "1 over them, attention gathering keys and values (ContextParallel; adjacent devices; not "
                        "with --tp or --ep); devices = pp x dp x cp (default: 1)")
    p.add_argument("--recompute", type=_recompute_every, default=0, metavar="none|all|N",
                   help="all: drop every region's activations after its forward and recompute them in its "
                        "backward (activation checkpointing; torchtitan's --activation_checkpoint.mode full): less "
                        "memory for about one more forward per step; N: every N-th region only (regions 0, N, "
                        "2N, ...; torchtitan's selective mode with an int); the Recompute directive chooses any "
                        "regions (default: none)")


def add_seed(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the built-in models and every random draw (dropout) of the run (default: 0)")


def add_precision(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", choices=["fp32", "bf16", "fp64"], default=None,
                   help="bf16: compute in bfloat16 on fp32 master weights, gradients and optimizer state; fp64 "
                        "(piper check only): the strategy and the single-device reference both run a float64 copy "
                        "of the model and its floating batch tensors, so a difference above rounding (default "
                        "rtol 1e-10) is a real one (default: the model's own dtypes)")


def add_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-budget-mb", type=finite_float, default=None,
                   help="fail at compile time if the estimated memory per GPU (per rank on the CPU) exceeds this "
                        "many MiB")
    p.add_argument("--optimizer", default="adamw", choices=["sgd", "adam", "adamw"], help="(default: adamw)")
    p.add_argument("--optimizer-impl", default="auto", choices=list(OPTIMIZER_IMPLEMENTATIONS),
                   help="which torch implementation updates the parameters; auto: the fused kernel for adam and "
                        "adamw, torch's default for sgd (default: auto)")
    p.add_argument("--lr", type=finite_float, default=None,
                   help="learning rate (default: 3e-3 for adam/adamw, 0.05 for sgd)")
    add_seed(p)
    add_precision(p)
    p.add_argument("--runtime", default=None, metavar="NAME",
                   help="what runs the ranks: ray (one Ray actor per rank, on an embedded or --address cluster), "
                        "local (every rank a thread of this process: no Ray, a debugger steps through ranks; CPU "
                        "only), torchrun (this process is one rank of a job `torchrun`/`srun` launched), or one a "
                        "package adds (entry point group piper.runtimes) (default: $PIPER_RUNTIME, else ray)")
    p.add_argument("--address", help="an existing Ray cluster's address (host:port of its head, as `ray start --head` "
                   "prints; or 'auto'); default: RAY_ADDRESS where set, else start an embedded local cluster")
    p.add_argument("--backend", choices=["cpu", "cuda"], default=None,
                   help="where ranks run: cpu (gloo) or cuda (a GPU per rank, NCCL); default: cuda when the Ray "
                        "cluster has a GPU for every rank, else cpu (the choice is printed)")
    p.add_argument("--placement", choices=["pack", "spread"], default="pack",
                   help="ranks on as few nodes as possible (pack) or as many (spread); either way pipeline "
                        "neighbours and tensor-parallel groups share a node where they fit (default: pack)")
    p.add_argument("--ranks-per-gpu", type=int, default=1,
                   help="ranks sharing one GPU with --backend cuda (e.g. a multi-rank strategy checked on one "
                        "GPU; they talk through host memory, not NCCL) (default: 1)")
    p.add_argument("--timeout", type=finite_float, default=60.0, metavar="SECONDS",
                   help="a rank that makes no progress for this long stops the run (exit code 3), naming the rank, "
                        "the instruction it is stuck in and what its peers were doing (default: 60)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, choices=["inductor", "aot_eager"],
                   help="run each segment's forward and backward passes (BI and BW apart) as compiled functions: "
                        "inductor, or aot_eager (the traced graphs without code generation); each rank compiles a "
                        "segment on its first step, which --timeout must allow (docs/compile.md) (default: eager)")


def add_optimization(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lr-schedule", default="constant", choices=LR_SCHEDULES,
                   help="learning-rate schedule after the warm-up (torch lr_scheduler; default: constant); cosine and "
                        "linear decay to --min-lr over the run")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps to --lr (default: 0)")
    p.add_argument("--min-lr", type=finite_float, default=0.0, help="where cosine and linear decay end (default: 0)")
    p.add_argument("--lr-step-size", type=int, default=None, help="steps between decays of the step schedule")
    p.add_argument("--lr-gamma", type=finite_float, default=0.1,
                   help="decay factor of the step schedule (default: 0.1)")
    p.add_argument("--clip-grad-norm", type=finite_float, default=None,
                   help="clip the gradients to this global 2-norm before each update (over every parameter of "
                        "every rank, as torch.nn.utils.clip_grad_norm_ on one device)")
    p.add_argument("--weight-decay", type=finite_float, default=None,
                   help="weight decay of parameters with 2 or more dimensions; biases, norms and other 1-d "
                        "parameters never decay (default: the optimizer's, 0.01 for adamw, 0 otherwise)")


def add_summary(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print a machine-readable summary on stdout")


def add_job(p: argparse.ArgumentParser) -> None:
    """``--config`` and ``--print-config`` (``piper_train.cli.jobs``; docs/jobs.md)."""
    p.add_argument("--config", type=Path, metavar="JOB",
                   help="read the options from a job file (.toml, or .yaml/.yml): keys are the long options' names "
                        "in snake_case (batch_size = 8), a strategy embedded as a [strategy] table or named "
                        "(strategy = \"s.json\"); flags on the command line override the file; read as data only")
    p.add_argument("--print-config", nargs="?", const="toml", choices=["toml", "yaml"], metavar="toml|yaml",
                   help="print the effective options (the job file's, the flags', the defaults) as a job file on "
                        "stdout (with --json: as the document's \"config\") and exit without running")


def add_simulation(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cost", type=_costs, default="F=1,B=2,W=1",
                   help="per-phase costs, e.g. F=1,B=2,W=1,FB=2.5,loss=0 (FB: an overlapped F&B pair; default: "
                        "F=1,B=2,W=1)")
    p.add_argument("--json", action="store_true", help="print makespan, per-rank busy and idle time as JSON")
    p.add_argument("--png", type=output_file, help="write a Gantt chart of the simulated step (needs matplotlib)")
    p.add_argument("--trace", type=output_file, help="write a Chrome/Perfetto trace of the simulated step")


def finite_float(text: str) -> float:
    """An argparse type: a finite number. ``float()`` also reads ``nan`` and ``inf``, which no
    option means; refused here, argparse's usage error names the flag before anything runs
    (how small a value may be is ``MINIMUMS``'s, checked by ``check_args``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _costs(text: str) -> str:
    """``--cost``: as given, once ``CostModel.parse`` (the one parser of the format) reads it:
    a backward is one quantity however it is spelled (B, or BI and W), costs finite and >= 0."""
    try:
        CostModel.parse(text, source="--cost")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--cost: ")) from None
    return text


def _recompute_every(text: str) -> int:
    """``--recompute``: ``none`` (0), ``all`` (1) or every N-th region (N >= 1)."""
    named = {"none": 0, "all": 1}
    if text in named:
        return named[text]
    try:
        every = int(text)
    except ValueError:
        every = 0
    if every < 1:
        raise argparse.ArgumentTypeError(f"expected none, all or a region interval N >= 1; got {text!r}")
    return every


def _comma_list(kind: Callable[[str], object], choices: Sequence[object] | None = None) -> Callable[[str], list]:
    """An argparse type: a comma-separated list of ``kind`` values, each among ``choices``."""

    def parse(text: str) -> list:
        try:
            values = [kind(part.strip()) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
        bad = [v for v in values if choices is not None and v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(map(str, choices or []))}"
                                             f"; got {text!r}")
        return values

    return parse


def add_planning(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", metavar="NAME|FILE",
                   help="price one strategy of --model on hardware that need not be here, from the model's shapes "
                        "and the hardware file (a100, b200, h100, h200, mi300x or a JSON file; docs/planning.md), "
                        "instead of a synthetic schedule in --cost units")
    p.add_argument("--devices", type=int, help="with --hardware: devices in all; data-parallel replicas = devices / "
                   "(pp x tp)")
    p.add_argument("--model", metavar="hf:CONFIG", help="with --hardware: a Hugging Face decoder config (config.json "
                   "or its folder), counted on fake tensors: no weights are allocated")
    p.add_argument("--batch-size", type=int, help="with --hardware: sequences per step (default: --devices)")
    p.add_argument("--seq-len", type=int, help="with --hardware: tokens per sequence (default: 4096)")
    p.add_argument("--tp", type=int, default=1, help="with --hardware: tensor-parallel degree (default: 1)")
    p.add_argument("--zero", dest="plan_zero", type=int, default=0, choices=[0, 1, 2, 3],
                   help="with --hardware: ZeRO level (default: 0)")
    p.add_argument("--recompute", dest="plan_recompute", choices=["none", "all"], default="none",
                   help="with --hardware: recompute every layer's activations in its backward (default: none)")
    p.add_argument("--sp", dest="plan_sp", action="store_true",
                   help="with --hardware and --tp > 1: sequence parallelism between the tensor-parallel regions")
    p.add_argument("--cp", dest="plan_cp", type=int, default=1,
                   help="with --hardware: context-parallel degree (each sequence cut over cp adjacent devices; not "
                        "with --tp); data-parallel replicas = devices / (pp x cp) (default: 1)")
    add_precision(p)  # with --hardware: the dtype computed in (default bf16)


def add_tune(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, required=True, help="devices (ranks) to tune for")
    p.add_argument("--hardware", metavar="NAME|FILE",
                   help="plan for this hardware instead of profiling here (a100, b200, h100, h200, mi300x or a JSON "
                        "file): --model hf:CONFIG counted on fake tensors, every strategy priced in closed form, "
                        "nothing run (docs/planning.md); --batch-size is the global batch in sequences (default: "
                        "--devices), --seq-len tokens per sequence (default: 4096)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (--model hf:CONFIG's own captured step at 1 and --batch-size "
                        "sequences, to which the FLOP efficiency and per-operator cost are fitted; matrix products, "
                        "elementwise bandwidth, the links among --devices ranks) and write a hardware file to --out "
                        "(default: calibrated.json) that --hardware reads (docs/planning.md)")
    p.add_argument("--calibrate-seconds", type=finite_float, default=None, metavar="SECONDS",
                   help="with --calibrate: time the model's step at least this long at each size and strategy, "
                        "every other figure a sixth of it (default: 3; longer steadies the figures on a busy "
                        "machine, shorter calibrates quicker)")
    p.add_argument("--runtime", dest="calibrate_runtime", choices=["local", "ray"], default=None,
                   help="with --calibrate --model: time the model's step on --devices ranks as this runtime runs "
                        "them: local (threads of one process) or ray (processes) (default: local)")
    p.add_argument("--tp", dest="tps", type=_comma_list(int), default=None,
                   help="with --hardware: tensor-parallel degrees to try, comma-separated (default: every divisor "
                        "of --devices up to a node)")
    p.add_argument("--sp", dest="sp_search", choices=["none", "all", "search"], default=None,
                   help="sequence parallelism for every candidate with tensor parallelism: never, always, or both "
                        "ways (default: none; each tp degree searched with it is one more variant to profile)")
    p.add_argument("--cp", dest="cps", type=_comma_list(int), default=None,
                   help="context-parallel degrees to try besides none, comma-separated, each dividing --devices "
                        "and the sequence length: pp x dp x cp candidates (no tp/ep with cp) (default: none)")
    p.add_argument("--stages", type=int, help="annotated regions of a built-in model (default: 2 x --devices)")
    p.add_argument("--memory-budget-mb", type=finite_float, default=None,
                   help="per-rank memory budget: strategies whose estimate exceeds it are pruned before simulation")
    p.add_argument("--microbatch-range", default=None,
                   help="microbatch counts to try: LO-HI (the powers of two between) or a list like 2,4,8 "
                        "(default: 1-16; with --hardware 1-256)")
    p.add_argument("--schedules", type=_comma_list(str, sorted(SCHEDULES)), default=sorted(SCHEDULES),
                   help="schedules to try, comma-separated (default: all)")
    p.add_argument("--zero-levels", type=_comma_list(int, [0, 1, 2, 3]), default=[0, 1, 2, 3],
                   help="ZeRO levels to try, comma-separated (default: 0,1,2,3)")
    p.add_argument("--pp", type=_comma_list(int), default=None,
                   help="pipeline degrees to try, comma-separated (default: every divisor of --devices)")
    p.add_argument("--recompute", choices=["none", "all", "search"], default=None,
                   help="recomputing every region's activations in its backward: never, always, or both ways "
                        "for every candidate without --tp/--ep (default: search with --memory-budget-mb, where "
                        "it can make a strategy fit; else none)")
    p.add_argument("--top", type=int, default=10, help="rows of the ranking to print (default: 10)")
    p.add_argument("--exhaustive", action="store_true",
                   help="compile and simulate every candidate (default: only those that could still enter the "
                        "top --top / --validate, by a lower bound of their step time)")
    p.add_argument("--out", type=output_file, help="write the best strategy here as a directive program (JSON) that "
                   "`piper train --strategy` runs")
    p.add_argument("--validate", type=int, default=0, metavar="K",
                   help="run the top K strategies on the runtime and print predicted vs measured step times")
    p.add_argument("--validate-steps", type=int, default=5, help="timed steps per validated strategy (default: 5)")
    p.add_argument("--profile-steps", type=int, default=3, help="timed steps per profiling run (default: 3)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where profiles are cached (default: $PIPER_CACHE_DIR/tune or ~/.cache/piper/tune)")
    p.add_argument("--no-cache", action="store_true", help="profile again, and do not write the cache")
    p.add_argument("--latency-us", type=finite_float,
                   help="link latency in microseconds (with --bandwidth-mbs: instead of measuring it)")
    p.add_argument("--bandwidth-mbs", type=finite_float, help="link bandwidth in MiB/s (with --latency-us)")
    p.add_argument("--optimizer", default="adamw", choices=["sgd", "adam", "adamw"],
                   help="the optimizer whose state the memory estimate counts (default: adamw)")
    add_seed(p)
    p.add_argument("--address", help="an existing Ray cluster's address (default: RAY_ADDRESS where set, else start "
                   "an embedded local cluster)")
    p.add_argument("--backend", choices=["cpu", "cuda"], default="cpu", help="where ranks run (default: cpu)")
    p.add_argument("--json", action="store_true", help="print the ranking and the best strategy as JSON on stdout")
    p.add_argument("--no-progress-bar", action="store_true", help="no progress bar even on a terminal")
    add_precision(p)  # --hardware and --calibrate: the dtype computed in (default bf16; calibrate: fp32 on a CPU)


def _steps_per_call(text: str) -> int | str:
    try:
        return parse_steps_per_call(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 1 or auto, got {text!r}") from None


def wandb_target(text: str) -> str:
    """``PROJECT`` or ``PROJECT/RUN``, each part non-empty."""
    project, slash, run = text.partition("/")
    if not project.strip() or (slash and (not run.strip() or "/" in run)):
        raise argparse.ArgumentTypeError(f"expected PROJECT or PROJECT/RUN, got {text!r}")
    return text


class FileForm(NamedTuple):
    """How a job file holds the value of an option of one argparse type: the TOML/YAML kinds
    it may be (``kinds``: never a bool unless the option is a flag; ``kind``: what a message
    calls them), read by the type itself from ``str(value)``; and ``write``, the parsed value
    as a job file spells it (``--print-config``; the type reads it back to the same value)."""

    kinds: tuple[type, ...] = (str,)
    kind: str = "a string"
    write: Callable[[Any], Any] = str


#: ``FileForm`` by argparse type, for the types whose file form is not a string.
FILE_FORMS: dict[Callable[[str], Any] | None, FileForm] = {
    int: FileForm((int,), "an integer", int),
    finite_float: FileForm((int, float), "a number", float),
    _recompute_every: FileForm((str, int), "none, all or an integer", lambda v: {0: "none", 1: "all"}.get(v, v)),
    _steps_per_call: FileForm((str, int), "auto or an integer", lambda v: v),
    tp_plan: FileForm((str, dict), "a string (PATTERN=STYLE,... or a JSON file) or a table", write_tp_plan),
    None: FileForm((str,), "a string", lambda v: v),
}


def file_form(kind: Callable[[str], Any] | None) -> FileForm:
    return FILE_FORMS.get(kind, FileForm())


def _add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", metavar="NAME|FILE",
                   help="the devices, for each step's MFU (model FLOPs per second per device over the device's peak "
                        "in the run's dtype): a shipped part (a100, b200, h100, h200, mi300x: datasheet dense peaks) "
                        "or a JSON hardware file (docs/mfu.md); without it the TFLOP/s per device are still reported")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: 20, unless --epochs is given)")
    p.add_argument("--epochs", type=int, default=None, help="passes over the model's data (with --steps: whichever "
                   "ends first)")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate the held-out data every N steps (default: never)")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches per evaluation (default: 4)")
    p.add_argument("--log-grad-norm", action="store_true", help="report the global gradient norm without clipping")
    p.add_argument("--prefetch", type=int, default=2, help="batches loaded ahead on a background thread (0: load "
                   "each when its step starts; default: 2)")
    p.add_argument("--metrics", type=output_file, help="write one JSON object per step and evaluation to this .jsonl file")
    p.add_argument("--tensorboard", type=Path, help="write TensorBoard scalars to this directory (needs tensorboard)")
    p.add_argument("--wandb", type=wandb_target, metavar="PROJECT[/RUN]",
                   help="log the --metrics records and the run's options to a Weights & Biases run (needs wandb: "
                        "pip install 'piper-train[wandb]'; WANDB_MODE=offline writes it locally, under WANDB_DIR)")
    p.add_argument("--profile-step", type=int, help="write the measured timeline of this step (1-based) as a "
                   "Chrome/Perfetto trace and a Gantt PNG, and the ranks' torch.profiler traces of it merged, each "
                   "operator under the instruction that ran it (stepN.kernels.trace.json)")
    p.add_argument("--profile-dir", type=Path, default=Path("."), help="where --profile-step writes (default: .)")
    p.add_argument("--memory-snapshot", action="store_true",
                   help="with --profile-step: also the step's memory over time, each rank's bytes by category after "
                        "every instruction (stepN.memory.trace.json), and on a GPU CUDA's memory history "
                        "(stepN.rankR.cuda-memory.pickle, for pytorch.org/memory_viz)")
    p.add_argument("--no-progress-bar", action="store_true", help="plain progress lines even on a terminal")
    p.add_argument("--steps-per-call", type=_steps_per_call, default="auto", metavar="N|auto",
                   help="send up to N consecutive steps to the workers in one call (saves each rank Ray's "
                        "hand-over of a call and the driver its work of sending one, per step; results then arrive "
                        "in bursts; N above 1 not with --on-nan skip-step); auto: one step per call while the pace "
                        "is measured, then as many as take about half a second, at most 16 and 64 MiB of batches "
                        "(default: auto)")
    p.add_argument("--no-bind-cores", action="store_true",
                   help="leave the ranks' threads to the operating system; by default each rank's step threads "
                        "are bound to cores of their own where a host has a free core per rank (cores another Piper "
                        "job's ranks hold are left to it; turn binding off when other programs share the "
                        "machine's cores)")
    p.add_argument("--on-nan", choices=["stop", "skip-step", "continue"], default="stop",
                   help="a NaN or Inf loss or gradient: stop the run (exit code 3) naming the step, microbatch and "
                        "rank where it first appeared; skip-step: undo that step (parameters and optimizer state "
                        "exactly as before it; the workers keep a copy of that state) and go on; continue: keep "
                        "it (default: stop)")


def add_checkpoints(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-dir", type=Path, help="write checkpoints here (safetensors and JSON: data only, "
                   "one step-NNNNNNNN directory each; on several nodes a filesystem every node shares)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="checkpoint every N steps (default: 0, only at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="keep the newest K checkpoints (default: 3)")
    p.add_argument("--checkpoint-async", action="store_true",
                   help="write each periodic checkpoint while the next steps run: the steps wait only for the ranks "
                        "to copy what they hold (host memory for one more copy of it); torchtitan's "
                        "checkpoint.async_mode")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in --checkpoint-dir (saved under any strategy)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="when a worker dies or a step fails, start new workers and continue from the latest "
                        "checkpoint, at most N times (default: 0)")


def _add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help="a checkpoint, or a --checkpoint-dir (its latest checkpoint)")
    p.add_argument("--out", type=Path, required=True,
                   help="where to write: the state_dict's file (.safetensors, or torch.save's format otherwise), or "
                        "with --format hf a new folder")
    p.add_argument("--format", choices=["state_dict", "hf"], default="state_dict",
                   help="state_dict: the model's state_dict in one file; hf: a Hugging Face model folder (config.json "
                        "and safetensors weights) that AutoModelForCausalLM.from_pretrained loads, for a run of "
                        "--model hf:PATH (default: state_dict)")
    p.add_argument("--model", help="with --format hf: the run's --model hf:PATH, whose config the folder gets")


def _add_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help="a checkpoint written by an earlier Piper (torch distributed "
                   "checkpoint: .metadata and pickled objects)")
    p.add_argument("--out", type=Path, required=True,
                   help="a checkpoint directory: the converted checkpoint goes into it under the same step name "
                        "(the pickles are read as data: DCP's metadata classes only, torch.load(weights_only=True))")


def _add_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--eval-batches", type=int, default=0,
                   help="also compare the held-out loss of this many batches (forward only; default: 0)")
    p.add_argument("--rtol", type=finite_float, default=None,
                   help="relative tolerance (default: 1e-5; with --precision bf16 5e-2 of each tensor's largest entry, "
                        "with --precision fp64 1e-10: check.TOLERANCES)")
    p.add_argument("--atol", type=finite_float, default=None,
                   help="absolute tolerance (default: 1e-6, bf16 1e-5, fp64 1e-12)")


def _add_simulate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--segments-per-stage", type=int, default=1, help="segments in each region (default: 1)")


def _add_plan_source(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", help="mlp, transformer, lm, or path/to/file.py:factory: capture this model. "
                        "A file is EXECUTED (like `python file.py`): name only files you trust")
    source.add_argument("--synthetic", action="store_true", help="a synthetic chain of regions (default)")
    add_capture(p)


def _add_plan_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--torch-csv", type=output_file, help="also write the strategy's compute actions as a torch "
                   "pipelining schedule CSV (one row per rank)")
    add_seed(p)
    add_precision(p)
    p.add_argument("--out", type=output_file, required=True, help="where to write the program (piper-ir JSON)")


def _add_program(p: argparse.ArgumentParser) -> None:
    p.add_argument("program", type=Path, help="a program written by 'piper plan'")


_TRAINING = (add_model, add_pipeline, add_parallelism, add_run, add_optimization, add_summary, add_job)

#: subcommand -> (help, its option groups in the order --help lists them)
SUBCOMMANDS: dict[str, tuple[str, tuple[Group, ...]]] = {
    "train": ("train a model with a strategy on Ray", (*_TRAINING, _add_train, add_checkpoints)),
    "check": ("compare a strategy with single-device training", (*_TRAINING, _add_check)),
    "simulate": ("simulate a schedule on a synthetic model (no torch work), or price it on --hardware",
                 (add_pipeline, _add_simulate, add_simulation, add_planning)),
    "plan": ("compile a strategy to a program and save it as JSON", (add_pipeline, _add_plan_source, _add_plan_output)),
    "show": ("print a saved program as a rank x step grid, simulate it", (_add_program, add_simulation)),
    "export": ("write a checkpoint's model as a plain single-device state_dict", (_add_export,)),
    "convert-checkpoint": ("convert a checkpoint of an earlier Piper (pickles) to the current format (data only)",
                           (_add_convert,)),
    "tune": ("search strategies with the simulator and the memory estimate; write the best",
             (add_model, add_tune)),
}


PACKAGES = ("piper-train", "piper-ir", "piper-directives", "piper-scheduler", "piper-memory", "piper-runtime",
            "torch", "ray")


def versions() -> str:
    """``piper --version``: each Piper package's version and those of torch and Ray, as
    installed (read from the packages' metadata: nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return "piper " + of("piper-train") + " (" + ", ".join(f"{name} {of(name)}" for name in PACKAGES[1:]) + ")"


class _Version(argparse.Action):
    """``--version``: ``versions()`` on one line, unwrapped (argparse's own action wraps it)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0,
                         help="print the versions of Piper's packages, torch and Ray, and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(versions())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="piper", description="Programmable distributed training for PyTorch.")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (text, groups) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=text)
        command.set_defaults(subparser=command)  # check_args's errors say "piper <command>: error: ..."
        for add in groups:
            add(command)
    return parser


#: Every numeric option's smallest meaningful value, by its name in ``args``: (minimum, strict:
#: above it, not at it). A count of things is at least 1, a count of steps or an amount at least
#: 0; a time, a size, a rate or a factor is above 0. ``--seed`` (any integer) is the one not here.
MINIMUMS: dict[str, tuple[float, bool]] = {
    **dict.fromkeys(("pp", "microbatches", "steps", "dp", "tp", "ep", "cp", "epochs", "batch_size", "seq_len", "profile_step",
                     "lr_step_size", "ranks_per_gpu", "devices", "stages", "top", "validate_steps", "profile_steps",
                     "keep_checkpoints", "segments_per_stage"), (1, False)),
    **dict.fromkeys(("warmup_steps", "eval_every", "eval_batches", "prefetch", "checkpoint_every", "max_restarts",
                     "validate", "lr", "min_lr", "weight_decay", "rtol", "atol", "latency_us", "calibrate_seconds"),
                    (0, False)),
    **dict.fromkeys(("timeout", "memory_budget_mb", "clip_grad_norm", "lr_gamma", "bandwidth_mbs"), (0, True)),
}
#: The few whose larger values overflow where they are used (a deadline, a budget in bytes).
MAXIMUMS: dict[str, float] = {"timeout": bounds.MAX_TIMEOUT_S, "memory_budget_mb": 1e12}  # MiB: about 1 EiB


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check (a usage error, exit code 2, like argparse's own, with the
    subcommand's usage)."""
    parser = getattr(args, "subparser", parser)
    for name, (minimum, strict) in MINIMUMS.items():
        value = getattr(args, name, None)
        for each in value if isinstance(value, list) else [value]:  # a list: tune's --pp
            wrong = None if each is None else bounds.problem(each, minimum=minimum, strict=strict,
                                                             maximum=MAXIMUMS.get(name))
            if wrong is not None:
                parser.error(f"--{name.replace('_', '-')} {wrong}, got {each}")
    if getattr(args, "eval_every", 0) and getattr(args, "eval_batches", 1) < 1:
        parser.error("--eval-batches must be >= 1 with --eval-every")
    if getattr(args, "memory_snapshot", False) and getattr(args, "profile_step", None) is None:
        parser.error("--memory-snapshot records the step --profile-step N names: give --profile-step")
    parallel = [f"--{n} {getattr(args, n)}" for n in ("tp", "ep", "cp") if (getattr(args, n, 1) or 1) > 1]
    if getattr(args, "compile", None) and parallel:
        parser.error(f"--compile cannot trace the collectives inside a segment's forward ({', '.join(parallel)}): "
                     "drop one of them (docs/compile.md)")
    if getattr(args, "lr_schedule", None) == "step" and args.lr_step_size is None:
        parser.error("--lr-schedule step needs --lr-step-size")
    recompute = getattr(args, "recompute", 0)
    if recompute and isinstance(recompute, int) and (getattr(args, "tp", 1) > 1 or getattr(args, "ep", 1) > 1):
        parser.error("--recompute with --tp or --ep: recomputing a tensor- or expert-parallel region (its "
                     "forward's collectives issued again in its backward) is not supported yet; a --strategy "
                     "file can Recompute the regions it does not Shard")
    if getattr(args, "precision", None) == "fp64" and getattr(args, "command", None) != "check":
        parser.error("--precision fp64 is for piper check (the strategy and the reference on a float64 copy of "
                     f"the model); to {args.command} in float64, make the model and its floating data float64 "
                     "(model.double()) and leave --precision out")
    if getattr(args, "tp_plan", None) and getattr(args, "tp", 1) < 2:
        parser.error("--tp-plan says how --tp cuts the model: give --tp 2 or more")
    if getattr(args, "sp", False) and getattr(args, "tp", 1) < 2:
        parser.error("--sp shards the sequence between --tp's regions: give --tp 2 or more")
    if getattr(args, "sp", False) and (getattr(args, "ep", 1) or 1) > 1:
        parser.error("--sp with --ep (sequence parallelism with expert parallelism) is not supported yet")
    check_parallelism(parser, args)
    check_runtime(parser, args)
    per_call = getattr(args, "steps_per_call", 1)
    if isinstance(per_call, int) and per_call > 1 and getattr(args, "on_nan", None) == "skip-step":
        parser.error("--steps-per-call above 1 cannot be combined with --on-nan skip-step (a step is undone before "
                     "the next one runs)")
    if getattr(args, "checkpoint_dir", None) is None:
        for name in ("resume", "checkpoint_every", "max_restarts", "checkpoint_async"):
            if getattr(args, name, None):
                parser.error(f"--{name.replace('_', '-')} needs --checkpoint-dir")


def check_runtime(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--runtime``: one this installation has, with the options it can honour."""
    if not hasattr(args, "runtime"):
        return
    from piper_runtime import default_runtime, runtime_names  # only for commands that run ranks

    runtime = args.runtime = args.runtime or default_runtime()
    known = runtime_names()
    if runtime not in known:
        parser.error(f"--runtime {runtime}: no such runtime here; this installation has {', '.join(known)}")
    if runtime == "local" and getattr(args, "backend", None) == "cuda":
        parser.error("--runtime local with --backend cuda: the local runtime runs every rank as a thread of this "
                     "process on the CPU; use --runtime ray or torchrun for GPUs")
    if runtime != "ray" and getattr(args, "address", None):
        parser.error(f"--address with --runtime {runtime}: only the ray runtime joins a Ray cluster")


def check_parallelism(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--dp/--zero/--tp/--ep`` against piper-directives' own rules (``check_degrees``, which
    ``parallelize`` applies later): refused now, before anything runs, as a usage error that
    names the flags at fault (``DegreeError.options``) with their values."""
    degrees = {name: getattr(args, name, default) for name, default in (("dp", 1), ("zero", 0), ("tp", 1), ("ep", 1))}
    try:
        check_degrees(**degrees)
    except DegreeError as err:
        flags = " with ".join(f"--{name} {degrees[name]}" for name in err.options)
        parser.error(f"{flags}: {err.message}" if flags else err.message)


def say(args: argparse.Namespace, text: str) -> None:
    """Progress and reports: on stdout, or on stderr when ``--json`` owns stdout."""
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)
