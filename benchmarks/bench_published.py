"""Published training throughput held against the analytic planner (issue 38, item 6;
docs/published-results.md).

``benchmarks/published/results.json`` (data) lists published runs: their source, model (a
Hugging Face config written from the model's published sizes, ``benchmarks/published/models``),
GPUs, layout, batch, sequence length, precision, recompute and the figure the source
published (tokens/s or model TFLOP/s per GPU). Each row is priced with the planner's public
API, as ``piper simulate --hardware`` prices one strategy (``hf_census``, ``Setting``,
``Planner.price`` on a ``Candidate``), twice:

- **uncalibrated**: the family's base hardware file (a shipped part, or a file in
  ``benchmarks/published/hardware``) with planning's default efficiencies;
- **calibrated**: the family's calibrated hardware file, fitted (``--fit``) on ONE row of the
  family (``calibrate_on``): one speed factor multiplies every peak and bandwidth of the base
  file and divides its latencies, which divides every time the planner prices, so the step,
  by exactly that factor; the factor is the one that reproduces that row's published figure.
  Every other row of the family is a prediction. (One row fits one number; a factor that
  scales every rate alike presumes nothing about which part of the step the planner gets
  wrong. The factor times the base's flop efficiency is the efficiency it amounts to.)

Prints one Markdown table (the one docs/published-results.md shows) and how many predicted
rows fall within 15% after calibration. ``--fit`` refits each family's file first and writes
it (data: ``load_hardware`` reads it). ``--json`` prints the rows as one JSON document.

    .venv/bin/python benchmarks/bench_published.py
    .venv/bin/python benchmarks/bench_published.py --fit   # rewrite the calibrated files
    .venv/bin/python benchmarks/bench_published.py --update-doc   # and the doc's table
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import attrs

DATA = Path(__file__).resolve().parent / "published" / "results.json"
DOC = Path(__file__).resolve().parent.parent / "docs" / "published-results.md"
#: The lines of docs/published-results.md between which the printed table stands.
BEGIN, END = "<!-- bench_published.py table: begin -->", "<!-- bench_published.py table: end -->"
TOLERANCE = 0.15  # the goal: every predicted row of a family within 15% after calibration


@attrs.frozen
class Priced:
    """One row priced: the published figure, the planner's uncalibrated and calibrated
    figures in the same metric, and the calibrated plan's memory and exposed data-parallel
    share."""

    row: dict[str, Any]
    published: float
    uncalibrated: float
    calibrated: float
    calibration_row: bool
    peak_gib: float  # the planner's peak memory per device (GiB)
    dp_share: float  # the exposed data-parallel traffic's share of the planner's step
    budget_gib: float  # the GPU's memory in the hardware file

    @property
    def error_uncalibrated(self) -> float:
        return self.uncalibrated / self.published - 1

    @property
    def error_calibrated(self) -> float:
        return self.calibrated / self.published - 1


def load(path: Path = DATA) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def hardware_spec(data_dir: Path, name: str) -> str:
    """A shipped part's name as it is, a file relative to the data folder as a path."""
    return name if "/" not in name else str(data_dir / name)


class Pricer:
    """Prices rows with the planner; each (model, sequence length) is counted once."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._census: dict[tuple[str, int], Any] = {}

    def census(self, row: dict[str, Any]) -> Any:
        from piper_train.tuning.census import hf_census  # torch and transformers: only when pricing

        key = (row["model"], row["seq_len"])
        if key not in self._census:
            self._census[key] = hf_census(f"hf:{self.data_dir / row['model']}", row["seq_len"])
        return self._census[key]

    def plan(self, row: dict[str, Any], hardware: Any) -> Any:
        """The planner's ``Plan`` of ``row`` on ``hardware`` (a ``Hardware``)."""
        from piper_train.tuning.planner import Planner, Setting
        from piper_train.tuning.space import Candidate

        dp, mb = row["dp"], row["micro_batch"]
        if row["tp"] * row["pp"] * dp * row["cp"] != row["gpus"]:
            raise ValueError(f"row {row['id']}: tp x pp x dp x cp is not its {row['gpus']} GPUs")
        if row["cp"] != 1:
            raise ValueError(f"row {row['id']}: context parallelism is not priced by the planner")
        if row["global_batch"] % (dp * mb):
            raise ValueError(f"row {row['id']}: global batch {row['global_batch']} is not dp x micro batch x k")
        setting = Setting(self.census(row), hardware, row["gpus"], row["global_batch"], dtype=row["precision"])
        candidate = Candidate(schedule=row["schedule"], pp=row["pp"], microbatches=row["global_batch"] // (dp * mb),
                              dp=dp, tp=row["tp"], zero=row["zero"], recompute=row["recompute"] == "all")
        plan = Planner(setting).price(candidate)
        if not plan.peak_bytes:
            raise ValueError(f"row {row['id']}: the planner refuses {candidate.label}: {plan.reason}")
        return plan

    def figure(self, row: dict[str, Any], hardware: Any) -> tuple[float, Any]:
        """The planner's figure in the row's published metric, and its ``Plan``."""
        plan = self.plan(row, hardware)
        metric = row["published"]["metric"]
        if metric == "tflops_per_gpu":
            value = plan.tflops_per_device
        elif metric == "tokens_per_s_per_gpu":
            value = plan.tokens_per_second / row["gpus"]
        else:
            raise ValueError(f"row {row['id']}: unknown metric {metric!r}")
        return value, plan


#: The rates a uniform speed factor multiplies (and the latencies it divides): every time the
#: planner prices is a sum of work over one of these rates plus latencies, so the step scales by
#: exactly 1 / factor (docs/published-results.md, "Calibration").
RATES = ("memory_tb_per_s", "intra_node_gb_per_s", "inter_node_gb_per_s")
LATENCIES = ("intra_node_latency_us", "inter_node_latency_us")


def scaled(hardware: Any, factor: float) -> dict[str, Any]:
    """``hardware``'s fields (a hardware file's JSON) with every peak and rate times
    ``factor`` and every latency over it (planning's default latency where the file has
    none); the efficiencies stay as they are."""
    from piper_train.hardware import Hardware

    fields = {f.name: getattr(hardware, f.name) for f in attrs.fields(Hardware) if getattr(hardware, f.name) is not None}
    fields["peak_tflops"] = {k: v * factor for k, v in hardware.peak_tflops.items()}
    for key in RATES:
        fields[key] = fields[key] * factor
    for key in LATENCIES:
        fields[key] = hardware.planning(key) / factor
    if hardware.planning("op_overhead_us"):
        fields["op_overhead_us"] = hardware.planning("op_overhead_us") / factor
    return fields


def fit(uncalibrated: float, row: dict[str, Any]) -> float:
    """The speed factor that makes the planner give ``row``'s published figure: the figure is
    work over the step, and the step scales by 1 / factor, so it is published / uncalibrated."""
    return row["published"]["value"] / uncalibrated


def calibrated_file(base_path: str, base: Any, factor: float, family: str, row: dict[str, Any],
                    source: dict[str, Any]) -> dict[str, Any]:
    """The calibrated hardware file: the base's fields scaled by the fitted factor, and a
    source saying how it was fitted."""
    fields = scaled(base, factor)
    fields.update(name=f"{family}-calibrated",
                  source=(f"{base_path} with every peak and bandwidth times {factor:.4f} and every latency over it "
                          f"(efficiencies as the base's), fitted by benchmarks/bench_published.py --fit so that the "
                          f"planner gives row {row['id']}'s published {row['published']['value']} "
                          f"{row['published']['metric']} ({source['title']}). Base file's source: {base.source}"))
    return fields


def price_all(data: dict[str, Any], data_dir: Path, *, refit: bool = False) -> list[Priced]:
    """Every row priced, uncalibrated and calibrated; with ``refit`` the calibrated files are
    fitted again and written first."""
    from piper_train.hardware import load_hardware

    pricer = Pricer(data_dir)
    rows = {r["id"]: r for r in data["rows"]}
    hardware: dict[str, tuple[Any, Any]] = {}
    for name, family in data["families"].items():
        base = load_hardware(hardware_spec(data_dir, family["base"]))
        out = data_dir / family["calibrated"]
        if refit:
            row = rows[family["calibrate_on"]]
            factor = fit(pricer.figure(row, base)[0], row)
            text = json.dumps(calibrated_file(family["base"], base, factor, name, row, data["sources"][row["source"]]),
                              indent=1)
            out.write_text(text + "\n", encoding="utf-8")
        hardware[name] = (base, load_hardware(str(out)))
    results = []
    for row in data["rows"]:
        base, calibrated = hardware[row["family"]]
        uncal, _ = pricer.figure(row, base)
        cal, plan = pricer.figure(row, calibrated)
        results.append(Priced(row, float(row["published"]["value"]), uncal, cal,
                              row["id"] == data["families"][row["family"]]["calibrate_on"], plan.peak_bytes / 2**30,
                              plan.parts["dp_exposed"] / plan.step_seconds, calibrated.memory_gib))
    return results


METRIC = {"tflops_per_gpu": "TFLOP/s/GPU", "tokens_per_s_per_gpu": "tokens/s/GPU"}


def _layout(row: dict[str, Any]) -> str:
    parts = [f"tp{row['tp']}", f"pp{row['pp']}", f"dp{row['dp']}", f"ZeRO-{row['zero']}"]
    if row["pp"] > 1:
        parts.append(row["schedule"])
    if row["recompute"] == "all":
        parts.append("recompute")
    return " ".join(parts)


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.1f}"


def table(results: list[Priced], data: dict[str, Any]) -> str:
    """The Markdown table docs/published-results.md shows (one row per published run)."""
    head = ("| family | run | GPUs | layout | batch x seq (micro) | metric | published | uncalibrated | error "
            "| calibrated | error | DP exposed | GiB/dev |")
    lines = [head, "| " + " | ".join(["---"] * 13) + " |"]
    for p in results:
        r = p.row
        cal_err = "(fitted)" if p.calibration_row else f"{p.error_calibrated:+.1%}"
        lines.append(f"| {r['family']} | {r['model_name']} | {r['gpus']:,} | {_layout(r)} | "
                     f"{r['global_batch']:,} x {r['seq_len']:,} ({r['micro_batch']}) | {METRIC[r['published']['metric']]} | "
                     f"{_num(p.published)} | {_num(p.uncalibrated)} | {p.error_uncalibrated:+.1%} | {_num(p.calibrated)} | "
                     f"{cal_err} | {p.dp_share:.0%} | {p.peak_gib:.1f}{'' if p.peak_gib <= p.budget_gib else f' (> {p.budget_gib:g})'} |")
    return "\n".join(lines)


def factors(data: dict[str, Any], data_dir: Path) -> dict[str, tuple[float, float]]:
    """Per family: the fitted speed factor (the calibrated file's bf16 peak over the base's)
    and the flop efficiency it amounts to (the factor times the base's efficiency: above 1,
    no real efficiency can give the published figure under the planner's model)."""
    from piper_train.hardware import load_hardware

    out = {}
    for name, family in data["families"].items():
        base = load_hardware(hardware_spec(data_dir, family["base"]))
        cal = load_hardware(str(data_dir / family["calibrated"]))
        factor = cal.peak("bf16") / base.peak("bf16")
        out[name] = (factor, factor * base.planning("flop_efficiency"))
    return out


def summary(results: list[Priced], data: dict[str, Any], data_dir: Path) -> str:
    """Per family: the fitted factor and how many predicted rows are within 15%."""
    lines = []
    total = within = 0
    for name, (factor, efficiency) in factors(data, data_dir).items():
        family = data["families"][name]
        predicted = [p for p in results if p.row["family"] == name and not p.calibration_row]
        ok = [p for p in predicted if abs(p.error_calibrated) <= TOLERANCE]
        total, within = total + len(predicted), within + len(ok)
        lines.append(f"- {name}: speed factor {factor:.3f} fitted on {family['calibrate_on']} (a flop efficiency "
                     f"of {efficiency:.2f}); {len(ok)} of {len(predicted)} predicted rows within {TOLERANCE:.0%}")
    lines.append(f"- all families: {within} of {total} predicted rows within {TOLERANCE:.0%} after calibration")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the published rows (JSON)")
    parser.add_argument("--fit", action="store_true", help="refit and rewrite each family's calibrated hardware file")
    parser.add_argument("--json", action="store_true", help="print the priced rows as one JSON document")
    parser.add_argument("--update-doc", action="store_true",
                        help=f"also write the table into {DOC.name} between its markers")
    args = parser.parse_args(argv)
    data = load(args.data)
    results = price_all(data, args.data.parent, refit=args.fit)
    if args.json:
        print(json.dumps([{"id": p.row["id"], "family": p.row["family"], "metric": p.row["published"]["metric"],
                           "published": p.published, "uncalibrated": p.uncalibrated, "calibrated": p.calibrated,
                           "calibration_row": p.calibration_row, "peak_gib": p.peak_gib,
                           "dp_exposed_share": p.dp_share} for p in results], indent=1))
        return 0
    block = table(results, data) + "\n\n" + summary(results, data, args.data.parent)
    print(block)
    if args.update_doc:
        text = DOC.read_text(encoding="utf-8")
        head, rest = text.split(BEGIN)
        DOC.write_text(f"{head}{BEGIN}\n{block}\n{END}{rest.split(END)[1]}", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
