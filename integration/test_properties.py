"""Property tests across the passes: random small graphs x random directive programs.

Every combination must end in one of two ways: a named ``PiperError`` (the user's mistake,
said as such), or a program that compiles, verifies and simulates without deadlock, with a
finite makespan. Anything else (a ``KeyError``, an ``AssertionError``, a hang) is a bug.

Graphs are built without torch (``training_graph``, as ``synthetic_graph`` does): chains,
skips (a segment also reads an earlier segment's output) and branches (two segments read one
value, a later one joins them), cut into contiguous ``PP`` regions. Programs are library
schedules with random sizes (some invalid: uneven stages, too few microbatches), or written
by hand: ``Split`` (sometimes with a count that does not divide the batch), ``Place`` (with
random, sometimes gapped, devices), ``Replicate`` at a random ZeRO level, and an ``Order``
per device that is a random permutation of its compute (so sometimes a cycle, sometimes a
cross-rank deadlock). No processes: the CI budget is a few hundred cases in seconds;
``PIPER_HYPOTHESIS_EXAMPLES`` raises it (the nox session ``properties`` runs 2,000).
"""

from __future__ import annotations

import math
import os

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from piper_directives import Order, Place, Replicate, Split, Strategy, build_schedule
from piper_directives.training_graph import training_graph
from piper_ir import Graph, PiperError, Segment, SegmentRole, Tags, TensorMeta, Value, grad_name
from piper_memory import plan_memory
from piper_scheduler import compile_program, simulate, verify

ROWS, HIDDEN = 12, 4  # 12 rows split evenly into 1, 2, 3, 4 or 6 microbatches, not 5
EXAMPLES = int(os.environ.get("PIPER_HYPOTHESIS_EXAMPLES", "300"))
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb1p", "dualpipe", "dualpipev"]


@st.composite
def graphs(draw: st.DrawFn) -> tuple[Graph, int]:
    """A captured-like training graph and its region count."""
    count = draw(st.integers(1, 6))
    regions = draw(st.integers(1, count))
    cuts = sorted(draw(st.sets(st.integers(1, count - 1), min_size=regions - 1, max_size=regions - 1))) if regions > 1 else []
    region_of = [sum(k >= c for c in cuts) for k in range(count)]
    activation = TensorMeta((ROWS, HIDDEN), "float32", batch_dim=0, requires_grad=True)
    batch_meta = TensorMeta((ROWS, HIDDEN), "float32", batch_dim=0, requires_grad=False)
    weight = TensorMeta((HIDDEN, HIDDEN), "float32", None, True)
    bias = TensorMeta((HIDDEN,), "float32", None, True)
    inputs: list[list[str]] = []
    for k in range(count):
        earlier = ["input:0"] + [f"v:s{j}" for j in range(k)]
        # Mostly the previous output (a chain), sometimes an earlier one instead (a branch)
        # or as well (a skip).
        first = earlier[-1] if draw(st.booleans()) or k == 0 else draw(st.sampled_from(earlier))
        extra = draw(st.lists(st.sampled_from(earlier), max_size=2)) if k else []
        inputs.append(list(dict.fromkeys([first, *extra])))
    read = {v for ins in inputs for v in ins}
    last = f"v:s{count - 1}"
    # Every output reaches the loss: one nobody reads joins the last segment's inputs.
    for j in range(count - 1):
        if f"v:s{j}" not in read:
            inputs[-1].append(f"v:s{j}")
    segments = [
        Segment(f"s{k}", SegmentRole.STAGE, Tags((("PP", region_of[k]),)), tuple(inputs[k]), (f"v:s{k}",),
                ((f"layers.{k}.weight", weight), (f"layers.{k}.bias", bias)), source="property")
        for k in range(count)
    ]
    values = [Value("input:0", batch_meta), *(Value(f"v:s{k}", activation) for k in range(count)),
              Value("target:0", batch_meta)]
    segments.append(Segment("loss", SegmentRole.LOSS, Tags(), (last, "target:0"), (), (), None))
    values += [Value(grad_name(f"v:s{k}"), activation) for k in range(count)]
    return training_graph(segments, values, ["input:0"], ["target:0"]), regions


@st.composite
def library_programs(draw: st.DrawFn, regions: int) -> Strategy:
    name = draw(st.sampled_from(SCHEDULES))
    return build_schedule(name, draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 3, 4, 5, 6])),
                          stages=regions, dp=draw(st.integers(1, 2)), zero=draw(st.integers(0, 3)))


@st.composite
def hand_programs(draw: st.DrawFn, regions: int) -> Strategy:
    m = draw(st.sampled_from([1, 2, 3, 4, 5]))
    ranks = draw(st.integers(1, 3))
    dp = draw(st.integers(1, 2))
    gap = draw(st.integers(0, 1)) if draw(st.integers(0, 9)) == 0 else 0  # now and then a gap in the numbering
    if draw(st.booleans()):  # regions in order over the ranks, as pipelines do
        device_of = [r * ranks // regions + gap * (r > 0) for r in range(regions)]
    else:
        device_of = [draw(st.integers(0, ranks - 1)) + gap * (r > 0) for r in range(regions)]
    directives: list = [Split(m)]
    for r in range(regions):
        devices = [device_of[r] + j * (ranks + gap) for j in range(dp)]
        directives.append(Place({"PP": r}, devices))
        if dp > 1:
            directives.append(Replicate({"PP": r}, devices, zero=draw(st.integers(0, 3))))
    if draw(st.booleans()):
        for device in sorted(set(device_of)):
            slots = [{"PP": r, "PASS": p, "MB": mb}
                     for r in range(regions) if device_of[r] == device for p in ("F", "B") for mb in range(m)]
            directives.append(Order(draw(st.permutations(slots)), name=f"random.rank{device}"))
    return Strategy(directives)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Graph, Strategy | PiperError]:
    graph, regions = draw(graphs())
    try:
        program = draw(library_programs(regions) if draw(st.booleans()) else hand_programs(regions))
    except PiperError as err:  # refused while being built: a named error too
        return graph, err
    return graph, program


def _named(err: PiperError) -> None:
    event(f"refused: {type(err).__name__}: {str(err).split(chr(10))[0][:50]}")
    assert type(err) is not PiperError and str(err).strip(), f"an unnamed error: {err!r}"


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_a_program_is_refused_by_name_or_verifies_and_simulates(case) -> None:
    graph, strategy = case
    if isinstance(strategy, PiperError):
        _named(strategy)
        return
    try:
        program = compile_program(plan_memory(strategy.apply(graph)))
    except PiperError as err:
        _named(err)
        return
    verify(program)  # compile verifies already; a second look must agree
    timeline = simulate(program)
    assert math.isfinite(timeline.makespan) and timeline.makespan > 0
    assert all(busy > 0 for busy in timeline.busy), "a rank without work was compiled"
    event(f"ran: {program.world_size} ranks")
