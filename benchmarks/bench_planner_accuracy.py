"""Predicted against measured step time on this machine: the analytic planner's own top 3 after
calibration (issue 38's third "Done when"; docs/planning.md, "Calibration").

Each round, one after another in one process so the machine's load is alike for all:

1. ``piper tune --calibrate --runtime R`` measures this machine into a hardware file
   (``--devices`` ranks at once as runtime R runs them: the model's own captured step at one
   sequence and at each rank's share of the batch, to which the FLOP efficiency and the
   per-operator cost are fitted; the memory bandwidth and the link);
2. ``piper tune --hardware FILE`` ranks every strategy for ``--devices`` ranks of the model
   (from that round's file);
3. ``piper train --runtime R`` runs the top ``--top`` as tune printed them, and the median
   step time after the first (``--metrics``) is held against the prediction.

Rounds alternate calibration and runs so a drift in the machine's load shows up in both. The
model is a Hugging Face Llama config built from the config alone (random weights, never the
hub): ``piper train`` generates its batches of 32 tokens, so the plan is made for 32 tokens
per sequence. Prints the load average with every figure: the calibration's measured step and
fitted figures; per strategy and round the prediction (and its parts: compute, exposed
data-parallel traffic, optimizer), the measured step and measured / predicted; at the end how
many runs are within ``TOLERANCE`` of their prediction.

    .venv/bin/python benchmarks/bench_planner_accuracy.py --rounds 2 [--runtime ray]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: A small Llama (GQA, SwiGLU) whose step is long enough on one CPU core that its matrix
#: products, not Python, dominate.
CONFIG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
          "tie_word_embeddings": False}
SEQ_LEN = 32  # piper_train.hf.SEQ_LEN: the tokens of piper train's generated batches
PIPER = [sys.executable, "-m", "piper_train.cli"]
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
TOLERANCE = 0.15  # issue 38: predicted within 15% of measured


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _json(cmd: list[str]) -> dict:
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, check=False)
    try:
        return json.loads(done.stdout)
    except ValueError:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}") from None


def _train_flags(row: dict) -> list[str]:
    flags = ["--schedule", row["schedule"], "--pp", str(row["pp"]), "--dp", str(row["dp"]), "--tp", str(row["tp"]),
             "--zero", str(row["zero"]), "--microbatches", str(row["microbatches"])]
    return flags + (["--recompute", "all"] if row["recompute"] else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, help="a Hugging Face decoder config.json (default: a small Llama)")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first is not timed)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--runtime", choices=["local", "ray"], default="local",
                    help="the runtime the strategies run on, and calibration times the step as (default: local)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="piper-accuracy-"))
    config = args.config
    if config is None:
        config = work / "config.json"
        config.write_text(json.dumps(CONFIG), encoding="utf-8")
    model = f"hf:{config}"
    rows: dict[str, list[tuple[float, float]]] = {}
    print(f"{os.cpu_count()} CPUs; load average (1/5/15 min) {_load()}; model {config}, {args.devices} ranks "
          f"(--runtime {args.runtime}), batch {args.batch_size} x {SEQ_LEN} tokens, {args.steps} steps per run")
    for r in range(args.rounds):
        hw = work / f"calibrated-{r}.json"
        started = time.perf_counter()
        cal = _json([*PIPER, "tune", "--calibrate", "--devices", str(args.devices), "--model", model, "--seq-len",
                     str(SEQ_LEN), "--batch-size", str(max(1, args.batch_size // args.devices)), "--out", str(hw),
                     "--runtime", args.runtime, "--json"])
        h, fit = cal["hardware"], cal["step"]
        peak = h["peak_tflops"]["fp32"] * 1e3
        print(f"\nround {r + 1}: calibrated in {time.perf_counter() - started:.0f} s (load {_load()}): the model's "
              f"step on {args.devices} {args.runtime} ranks at once "
              + ", ".join(f"{b} seq {t * 1e3:.1f} ms" for b, t in zip(fit["sequences"], fit["seconds"], strict=True))
              + f"; fitted {h['flop_efficiency'] * peak:.1f} GFLOP/s (efficiency {h['flop_efficiency']:.3f} of a "
              f"{peak:.1f} GFLOP/s peak), {h.get('op_overhead_us', 0):.1f} us/op x {fit['operators']} operators"
              + ("" if fit["exact"] else " (not exact)")
              + f"; {h['memory_tb_per_s'] * 1e3:.1f} GB/s; link {h.get('intra_node_gb_per_s', 0):.3f} GB/s "
              f"{h.get('intra_node_latency_us', 0):.0f} us, reduce-scatter/all-gather "
              f"{h.get('scatter_gather_factor', 1.0):.2f}x the ring's")
        plan = _json([*PIPER, "tune", "--hardware", str(hw), "--precision", "fp32", "--devices", str(args.devices),
                      "--model", model, "--seq-len", str(SEQ_LEN), "--batch-size", str(args.batch_size),
                      "--recompute", "none", "--microbatch-range", f"1-{args.batch_size}", "--top", str(args.top),
                      "--json"])
        for row in plan["ranking"][: args.top]:
            label = row["strategy"]
            metrics = work / f"metrics-{r}-{len(rows)}.jsonl"
            run = _json([*PIPER, "train", "--model", model, "--runtime", args.runtime, "--batch-size", str(args.batch_size),
                         "--steps", str(args.steps), "--no-progress-bar", "--json", "--metrics", str(metrics),
                         *_train_flags(row)])
            if run.get("mean_step_seconds") is None:
                print(f"  {label}: failed: {run.get('error')}")
                continue
            steps = [rec["step_seconds"] for rec in map(json.loads, metrics.read_text().splitlines())
                     if rec.get("step_seconds") is not None][1:]  # the first step is not timed
            measured = statistics.median(steps)  # a load spike on this shared machine moves the mean, not this
            predicted = row["step_seconds"]
            rows.setdefault(label, []).append((predicted, measured))
            parts = row["parts"]
            compute = row["microbatches"] * sum(parts[k] for k in ("F", "BI", "BW"))
            print(f"  {label:<32} predicted {predicted * 1e3:7.1f} ms (compute {compute * 1e3:.1f}, dp exposed "
                  f"{parts['dp_exposed'] * 1e3:.1f}, optimizer {parts['optimizer'] * 1e3:.1f})  measured "
                  f"{measured * 1e3:7.1f} ms (steps {min(steps) * 1e3:.0f}-{max(steps) * 1e3:.0f})  measured/predicted "
                  f"{measured / predicted:5.2f}{'  within 15%' if abs(measured / predicted - 1) <= TOLERANCE else ''}"
                  f"  (load {_load()})")
    print(f"\nsummary (median over rounds): strategy, predicted ms, measured ms, measured/predicted; load {_load()}")
    within = total = 0
    for label, pairs in rows.items():
        p = statistics.median(x for x, _ in pairs)
        m = statistics.median(y for _, y in pairs)
        ratios = ", ".join(f"{y / x:.2f}" for x, y in pairs)
        within += sum(abs(y / x - 1) <= TOLERANCE for x, y in pairs)
        total += len(pairs)
        print(f"  {label:<40} {p * 1e3:8.1f} {m * 1e3:8.1f}  {m / p:5.2f}  (rounds: {ratios})")
    print(f"{within} of {total} runs within {TOLERANCE:.0%} of their prediction; load average at the end {_load()}")


if __name__ == "__main__":
    main()
