"""Read and write torch.distributed.pipelining's schedule format (no torch needed).

torch writes a pipeline schedule as one CSV row per rank, each cell an *action*
(``schedules._Action``; ``_dump_csv`` / ``_load_csv``):

- ``2F0``: stage 2, forward of microbatch 0; ``B`` full backward, ``I`` backward to the
  inputs (Piper's ``BI``), ``W`` backward to the weights (``BW``);
- ``3SEND_F1``, ``3RECV_B0`` (``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``), ``1UNSHARD``,
  ``1RESHARD``, ``1REDUCE_GRAD``: communication and FSDP actions (``compute_comms`` format);
- ``(0F7;7B3)OVERLAP_F_B``: sub-actions run as one overlapped step (DualPipe's F&B);
- an empty cell: an idle step (torch pads its ``compute_only`` tables with them).

``strategy_from_torch_csv`` turns such a file into a Piper ``Strategy`` (Split + Place +
Order; the communication actions are dropped because Piper derives and orders all
communication itself), ``strategy_to_torch_csv`` writes a strategy's compute actions back.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Sequence
from math import gcd
from pathlib import Path

import attrs

from piper_directives.order import Order
from piper_directives.place import Place
from piper_directives.schedules import LOSS, Slot, rank_actions, strategy_from_slots
from piper_directives.strategy import Strategy
from piper_ir import ANY, MB, DirectiveError

#: torch's action letters for compute, and Piper's phase for each
COMPUTE = {"F": "F", "B": "B", "I": "BI", "W": "BW"}
#: every non-compute action type torch writes (``_ComputationType``)
OTHER = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")
OVERLAP = "OVERLAP_F_B"

_ACTION = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_GROUP = re.compile(r"\((.*)\)([A-Z_]+)")


@attrs.frozen
class TorchAction:
    """One cell of torch's schedule table: ``stage`` + ``kind`` (+ ``microbatch``), or a
    group of ``sub_actions`` (``kind == "OVERLAP_F_B"``, ``stage == -1`` as in torch)."""

    stage: int
    kind: str
    microbatch: int | None = None
    sub_actions: tuple[TorchAction, ...] = ()

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE or self.kind == OVERLAP

    def compute_parts(self) -> tuple[TorchAction, ...]:
        """The compute actions this cell runs: itself, or its compute sub-actions."""
        if self.sub_actions:
            return tuple(a for a in self.sub_actions if a.kind in COMPUTE)
        return (self,) if self.kind in COMPUTE else ()

    def __str__(self) -> str:
        if self.sub_actions:
            return "(" + ";".join(map(str, self.sub_actions)) + ")" + self.kind
        return f"{self.stage}{self.kind}{'' if self.microbatch is None else self.microbatch}"


def parse_action(text: str) -> TorchAction | None:
    """``"2F0"`` -> ``TorchAction(2, "F", 0)``; an empty cell -> ``None``."""
    text = text.strip()
    if not text:
        return None
    if text.startswith("("):
        group = _GROUP.fullmatch(text)
        if group is None or group.group(2) != OVERLAP:
            raise DirectiveError(f"torch schedule: bad action group {text!r}, expected e.g. (0F7;7B3){OVERLAP}")
        subs = [parse_action(part) for part in group.group(1).split(";")]
        return TorchAction(-1, OVERLAP, None, tuple(a for a in subs if a is not None))
    match = _ACTION.fullmatch(text)
    if match is None:
        raise DirectiveError(
            f"torch schedule: bad action {text!r}, expected [stage][type][microbatch] such as 2F0, 1I3, 0SEND_F1"
        )
    stage, kind, mb = match.groups()
    if kind in COMPUTE and not mb:
        raise DirectiveError(f"torch schedule: compute action {text!r} names no microbatch")
    return TorchAction(int(stage), kind, int(mb) if mb else None)


def read_torch_csv(source: str | Path) -> list[list[TorchAction | None]]:
    """Per rank (row), its actions; ``source`` is a path or the CSV text itself."""
    text = _text(source)
    return [[parse_action(cell) for cell in row] for row in csv.reader(io.StringIO(text))]


def write_torch_csv(rows: Sequence[Sequence[TorchAction | str | None]]) -> str:
    """The CSV text torch's ``_dump_csv`` writes for ``rows`` (``None`` -> an empty cell)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in rows:
        writer.writerow(["" if a is None else str(a) for a in row])
    return out.getvalue()


def _text(source: str | Path) -> str:
    if isinstance(source, Path):
        return source.read_text()
    if "\n" not in source and (source.endswith(".csv") or Path(source).is_file()):
        return Path(source).read_text()
    return source


def strategy_from_torch_csv(
    source: str | Path,
    pp: int | None,
    microbatches: int | None,
    stages: int | None = None,
    *,
    tag: str = "PP",
) -> Strategy:
    """A Piper strategy running the compute actions of a torch schedule CSV.

    Row r is rank r (``pp`` rows; ``None`` takes the row count). Schedule stage s is placed
    on the rank whose row computes it; each compute cell becomes one ``Order`` slot (an
    ``OVERLAP_F_B`` cell one slot holding its sub-actions), send/receive and FSDP actions are
    ignored. ``stages`` is the number of annotated regions (default: the CSV's stage count;
    it must be a multiple of it, each schedule stage a contiguous group of regions).
    ``microbatches`` defaults to the largest microbatch index + 1.
    """
    rows = read_torch_csv(source)
    while rows and not rows[-1]:
        rows.pop()
    if pp is None:
        pp = len(rows)
    if len(rows) != pp:
        raise DirectiveError(f"torch schedule: {len(rows)} rows (one per rank), expected pp={pp}")
    stage_rank: dict[int, int] = {}
    rank_slots: list[list[Slot]] = []
    seen: dict[tuple[int, str, int], int] = {}
    for rank, row in enumerate(rows):
        slots = []
        for cell in row:
            if cell is None or not cell.is_compute:
                continue
            parts = cell.compute_parts()
            for a in parts:
                owner = stage_rank.setdefault(a.stage, rank)
                if owner != rank:
                    raise DirectiveError(
                        f"torch schedule: stage {a.stage} is computed on ranks {owner} and {rank} ({a} in row {rank}); "
                        "a stage must live on one rank"
                    )
                key = (a.stage, COMPUTE[a.kind], a.microbatch)
                if key in seen:
                    raise DirectiveError(f"torch schedule: action {a} appears twice (rows {seen[key]} and {rank})")
                seen[key] = rank
            if parts:
                slots.append(tuple((a.stage, COMPUTE[a.kind], a.microbatch) for a in parts))
        rank_slots.append(slots)
    if not stage_rank:
        raise DirectiveError("torch schedule: no compute actions")
    n_stages = max(stage_rank) + 1
    missing = sorted(set(range(n_stages)) - set(stage_rank))
    if missing:
        raise DirectiveError(f"torch schedule: stages {missing} are never computed (stages run 0..{n_stages - 1})")
    top = max(mb for _, _, mb in seen) + 1
    microbatches = top if microbatches is None else microbatches
    if top > microbatches:
        raise DirectiveError(f"torch schedule: microbatch {top - 1} appears, but microbatches={microbatches}")
    for s in range(n_stages):
        for mb in range(microbatches):
            if (s, "F", mb) not in seen:
                raise DirectiveError(f"torch schedule: no forward {s}F{mb}")
            if (s, "B", mb) not in seen and (s, "BI", mb) not in seen:
                raise DirectiveError(f"torch schedule: no backward {s}B{mb} (or {s}I{mb} and {s}W{mb})")
    regions = n_stages if stages is None else stages
    if regions < n_stages or regions % n_stages:
        raise DirectiveError(
            f"torch schedule: {n_stages} schedule stages cannot be cut from {regions} annotated regions "
            f"(need a multiple of {n_stages}; pass stages=)"
        )
    return strategy_from_slots("torch_csv", microbatches, regions, [stage_rank[s] for s in range(n_stages)], rank_slots, tag)


def strategy_to_torch_csv(
    strategy: Strategy, *, tag: str = "PP", regions_per_stage: int | None = None
) -> str:
    """The compute actions of ``strategy``'s ``Order``s as torch's ``compute_only`` CSV.

    One row per rank (the device its Orders' regions are placed on; several Orders of one
    rank are concatenated). A schedule stage is ``region // regions_per_stage``; by default
    the largest group size such that every slot names whole, aligned groups of regions (one
    per pass and microbatch), which is how the library's builders write stages.
    """
    # (region, microbatch) -> device; microbatch None: a Place for every microbatch. A region
    # placed per microbatch set (DualPipe's mirrored stages) shows up in two rows, which
    # torch's own loaders (and ``strategy_from_torch_csv``) refuse: there a stage has one rank.
    device: dict[tuple[int, object], int] = {}
    for d in strategy.directives:
        if isinstance(d, Place) and tag in d.filter.as_dict():
            keys = d.filter.as_dict()
            mbs = keys.get(MB, ANY)
            for mb in mbs if isinstance(mbs, tuple) else (None if mbs == ANY else mbs,):
                device[(int(keys[tag]), mb)] = d.devices[0]

    def placed(region: int, mb: object) -> int | None:
        return device.get((region, mb), device.get((region, None)))

    orders = [d for d in strategy.directives if isinstance(d, Order)]
    per = regions_per_stage or _regions_per_stage(orders, tag)
    ranks: dict[int, list[str]] = {}
    for order in orders:
        keys = [f.as_dict() for slot in order.slots for f in slot]
        regions = [(int(k[tag]), k.get(MB)) for k in keys if tag in k]
        if not regions:
            continue
        if any(placed(*r) is None for r in regions):
            raise DirectiveError(f"{order}: names {tag} regions that no Place directive places", directive=str(order))
        owners = {placed(*r) for r in regions}
        if len(owners) != 1:
            raise DirectiveError(
                f"{order}: orders regions on devices {sorted(owners)}; torch's format needs one Order per rank",
                directive=str(order),
            )
        cells = rank_actions(order, tag, regions_per_stage=per)
        ranks.setdefault(owners.pop(), []).extend(c + OVERLAP if c.startswith("(") else c for c in cells)
    if not ranks:
        raise DirectiveError("strategy has no Order over annotated regions: nothing to write")
    return write_torch_csv([ranks.get(r, []) for r in range(max(ranks) + 1)])


def _regions_per_stage(orders: Sequence[Order], tag: str) -> int:
    """The gcd of the aligned runs of consecutive regions one slot names per (pass, microbatch)."""
    per = 0
    for order in orders:
        for slot in order.slots:
            groups: dict[tuple[str, object], list[int]] = {}
            for f in slot:
                keys = f.as_dict()
                if tag in keys and keys.get("SEG") != LOSS:
                    groups.setdefault((str(keys.get("PASS")), keys.get("MB")), []).append(int(keys[tag]))
            for regions in groups.values():
                regions.sort()
                start = prev = regions[0]
                for r in [*regions[1:], None]:
                    if r is not None and r == prev + 1:
                        prev = r
                        continue
                    per = gcd(per, gcd(start, prev + 1 - start))
                    if r is not None:
                        start = prev = r
    return per or 1
