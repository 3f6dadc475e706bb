"""Device descriptions for throughput figures: ``--hardware NAME|FILE``.

A hardware file is JSON (data: nothing in it runs): ``name``, ``description``, ``peak_tflops``
(dense peak per dtype: ``fp64``, ``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp8``; the ones a
part lacks are left out), ``memory_gib``, ``memory_tb_per_s`` and ``source`` (where the figures
come from); for planning (``piper tune/simulate --hardware``, docs/planning.md) also the
topology and what real kernels reach: ``devices_per_node``, ``intra_node_gb_per_s`` and
``inter_node_gb_per_s`` (per device and direction: NVLink or Infinity Fabric, and the NIC),
``intra_node_latency_us``, ``inter_node_latency_us``, and ``flop_efficiency``,
``memory_efficiency`` and ``link_efficiency`` (the shares of the peaks reached), and
``op_overhead_us`` (what each operator costs beyond its work, paid one after another: the
CPU's dispatch), and ``comm_overlap`` (the share, 0 to 1, of the data-parallel traffic that the
compute can hide: 1 where collectives run beside the kernels, as a GPU's do; 0 where they take
the cores that compute, as gloo's do on a CPU with a rank per core), and
``scatter_gather_factor`` (what a reduce-scatter or all-gather takes over the ring algorithm's
time, 1 for NCCL's ring; gloo's on a CPU take more); ``PLANNING`` gives those
a file leaves out. ``piper tune --calibrate`` writes a
file of this machine's measured figures (``piper_train.tuning.calibrate``). Piper ships files for common parts (``HARDWARE``: the H100, H200, A100, MI300X and
B200 datasheets' dense figures); a user writes their own for anything else, such as the
measured peak of a CPU. A run's MFU is its model FLOPs per second per device over
``peak(dtype)`` of the dtype it computes in (piper_train.flops).
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

import attrs

DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")
HARDWARE = ("a100", "b200", "h100", "h200", "mi300x")  # the files in piper_train/hardware/
#: What planning assumes for a field a hardware file leaves out (docs/planning.md says why).
PLANNING = {"devices_per_node": 8, "intra_node_latency_us": 5.0, "inter_node_latency_us": 10.0,
            "flop_efficiency": 0.6, "memory_efficiency": 0.7, "link_efficiency": 0.7, "op_overhead_us": 0.0,
            "comm_overlap": 1.0, "scatter_gather_factor": 1.0}
_COUNTS = ("devices_per_node",)
_SHARES = ("flop_efficiency", "memory_efficiency", "link_efficiency")
_AMOUNTS = ("memory_gib", "memory_tb_per_s", "intra_node_gb_per_s", "inter_node_gb_per_s", "intra_node_latency_us",
            "inter_node_latency_us", "op_overhead_us", "scatter_gather_factor")


@attrs.frozen
class Hardware:
    """One device: its dense peak TFLOP/s per dtype, memory and where the figures come from."""

    name: str
    peak_tflops: dict[str, float]
    description: str = ""
    memory_gib: float | None = None
    memory_tb_per_s: float | None = None
    source: str = ""
    devices_per_node: int | None = None
    intra_node_gb_per_s: float | None = None
    inter_node_gb_per_s: float | None = None
    intra_node_latency_us: float | None = None
    inter_node_latency_us: float | None = None
    flop_efficiency: float | None = None
    memory_efficiency: float | None = None
    link_efficiency: float | None = None
    op_overhead_us: float | None = None
    comm_overlap: float | None = None
    scatter_gather_factor: float | None = None

    def planning(self, name: str) -> float:
        """A planning field (module doc): the file's value, else ``PLANNING``'s; a
        ``ValueError`` names the file's missing field when there is no default."""
        value = getattr(self, name)
        if value is None:
            value = PLANNING.get(name)
        if value is None:
            raise ValueError(f"--hardware {self.name}: planning needs {name}, which the file does not give")
        return float(value)

    def peak(self, dtype: str) -> float | None:
        """Peak TFLOP/s in ``dtype`` (``"fp32"``, ``"bf16"``, ...), None if the file lacks it."""
        return self.peak_tflops.get(dtype)


def load_hardware(spec: str) -> Hardware:
    """``spec``: a shipped part's name (``HARDWARE``) or a path to a JSON hardware file. A
    ``ValueError`` names the file and what is wrong."""
    if spec in HARDWARE:
        text = resources.files("piper_train").joinpath("hardware", f"{spec}.json").read_text(encoding="utf-8")
        where = f"{spec} (shipped)"
    else:
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"--hardware {spec}: neither a shipped part ({', '.join(HARDWARE)}) nor a file")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, ValueError) as err:
            raise ValueError(f"--hardware {spec}: cannot read it: {err}") from None
        where = spec
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ValueError(f"--hardware {where}: not JSON: {err}") from None
    return parse_hardware(data, where)


def parse_hardware(data: object, where: str) -> Hardware:
    """A hardware file's JSON object (already read) as ``Hardware``; a ``ValueError`` names
    ``where`` and what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"--hardware {where}: expected a JSON object")
    known = {f.name for f in attrs.fields(Hardware)}
    if unknown := sorted(set(data) - known):
        raise ValueError(f"--hardware {where}: unknown key(s) {', '.join(unknown)}; expected {', '.join(sorted(known))}")
    peaks = data.get("peak_tflops")
    if not isinstance(data.get("name"), str) or not isinstance(peaks, dict) or not peaks:
        raise ValueError(f"--hardware {where}: needs a name and peak_tflops (TFLOP/s per dtype)")
    for dtype, value in peaks.items():
        if dtype not in DTYPES:
            raise ValueError(f"--hardware {where}: peak_tflops: unknown dtype {dtype!r}; expected {', '.join(DTYPES)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"--hardware {where}: peak_tflops.{dtype} must be a positive number, got {value!r}")
    for key in (*_COUNTS, *_SHARES, *_AMOUNTS):
        value = data.get(key)
        if value is None:
            continue
        number = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value) and value > 0
        if not number or (key in _COUNTS and not isinstance(value, int)) or (key in _SHARES and value > 1):
            what = "a positive integer" if key in _COUNTS else "a number in (0, 1]" if key in _SHARES else \
                "a positive number"
            raise ValueError(f"--hardware {where}: {key} must be {what}, got {value!r}")
    overlap = data.get("comm_overlap")
    if overlap is not None and (isinstance(overlap, bool) or not isinstance(overlap, int | float)
                                or not 0 <= overlap <= 1):
        raise ValueError(f"--hardware {where}: comm_overlap must be a number in [0, 1], got {overlap!r}")
    return Hardware(**{**data, "peak_tflops": {k: float(v) for k, v in peaks.items()}})
