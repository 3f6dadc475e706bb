"""Plan for hardware that is not here: every strategy's step time, throughput, MFU, bubble
and memory per device from a model's ``Census`` and a hardware file, in closed form
(docs/planning.md).

Nothing is compiled or run: all data-parallel replicas are alike and so are a pipeline's
ranks up to their layers, so one candidate is priced from the slowest pipeline rank:

- **compute**: that rank's layers (and the embedding on the first stage, the head and loss
  on the last) per microbatch, each phase (``F``, ``BI``, ``BW``) by the hardware's roofline
  (``piper_scheduler.analytic.Roofline``) over the census's operators, the microbatch's
  sequences times each operator's cost, divided by the tensor-parallel degree (or the
  context-parallel one: each rank computes its chunk of every sequence); a recomputed
  layer runs its forward again in its backward;
- **tensor parallelism** (Megatron's): two all-reduces of the layer's activation per layer in
  the forward and two in the backward, over the node's link (TP stays inside a node); the
  embedding and the head are cut by vocabulary (``piper_directives.shard_vocab``), the
  embedding's rows summed by one all-reduce in the forward. With
  **sequence parallelism** each all-reduce becomes a reduce-scatter and an all-gather of the
  same tensor: the same bytes and time under ring algorithms, so the step is TP's;
- **context parallelism** (Piper's all-gather form): per layer the forward all-gathers the
  keys and values of the whole sequences over the ``cp`` ranks and the backward
  reduce-scatters their gradients (``2 x kv_heads x d_head x seq_len`` elements per
  sequence each way), over the link the group spans (adjacent devices: the node's while it
  fits); the ``cp`` ranks are data-parallel replicas for the gradient reduction and ZeRO
  (over ``dp x cp`` ranks);
- **pipeline**: ``piper_scheduler.analytic.pipeline_step`` (the schedule's bubble in closed
  form, checked against the simulator) with one boundary transfer per hop;
- **data parallelism / ZeRO**: the rank's gradients reduced over the ``dp`` replicas
  (all-reduce; reduce-scatter with ZeRO 1-3), over NVLink when the replicas share a node,
  else the network; what the last microbatch's backward cannot hide is added. ZeRO 1-2 then
  all-gather the updated parameter shards after the optimizer, as Piper's runtime does: the
  step's last work, which nothing hides (on a ring the reduce-scatter and all-gather are the
  all-reduce's two halves, so where the reduction was exposed whole the step is ZeRO 0's).
  ZeRO-3 gathers every layer's parameters for each microbatch's forward and backward instead,
  hidden behind compute up to the rank's busy time; the compute hides only the hardware's
  ``comm_overlap`` share of its time (0 on a CPU whose collectives take the cores that
  compute: all exposed); a reduce-scatter and an all-gather cost the hardware's
  ``scatter_gather_factor`` times the ring's time (``Link``: gloo's are not the ring's);
- **optimizer**: AdamW's read and write of the rank's parameter shard at memory bandwidth.

Memory per device follows piper-memory's categories (``piper_memory.estimate``): fp32
parameters, gradients and optimizer state (``OPTIMIZER_STATE_FACTOR``) of the rank's layers,
each divided by ``dp`` from the ZeRO level that shards it (optimizer state from 1, gradients
from 2, parameters from 3), the parameters divided by ``tp`` (the embedding and head by
vocabulary; a head tied to the embedding holds it on the last stage too), twice for DualPipe's mirrored stages; plus activations: the census's saved bytes per layer
(per rank: under TP the cut part divided by ``tp`` and the hidden-sized part whole,
``Part.kept_per_rank``; under SP all of it divided; under CP divided by ``cp`` plus the
gathered keys and values of the whole sequences, which each rank keeps) times the microbatches a
schedule holds at once on its first rank (GPipe ``M``; 1F1B and ZB-H1 ``min(M, pp)``;
interleaved 1F1B Megatron's warm-up, ``(2(pp-1) + pp + 1)/2`` rank-microbatches; DualPipe(V)
``pp + 1``), or with recomputation each layer's input and one layer's working set.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import attrs

from piper_memory import OPTIMIZER_STATE_FACTOR
from piper_scheduler import CHUNKS, Link, Roofline, Topology, pipeline_step
from piper_train.hardware import Hardware
from piper_train.tuning.space import Candidate, balanced_bounds

if TYPE_CHECKING:
    from piper_train.tuning.census import Census, Part

FP32 = 4  # bytes of a master weight, a gradient and each optimizer moment (bf16 training)
SCHEDULES = tuple(CHUNKS)


@attrs.frozen
class Plan:
    """One candidate priced (module doc). ``reason`` says why it cannot run or fit ("" when
    it fits)."""

    candidate: Candidate
    step_seconds: float
    tokens_per_second: float
    tflops_per_device: float
    mfu: float | None
    bubble: float
    peak_bytes: int
    reason: str = ""
    # seconds: the pipeline, the exposed data-parallel traffic and the optimizer (which add up to the step);
    # one tensor-parallel collective pair per layer (and the context-parallel gathers of one layer, one
    # direction); the slowest rank's F, BI, BW per microbatch; one hop;
    # and, in bytes, the model state (weights, gradients, optimizer) of the rank with the peak memory
    parts: dict[str, float] = attrs.field(factory=dict)

    @property
    def fits(self) -> bool:
        return not self.reason

    def as_dict(self) -> dict[str, object]:
        return {"strategy": self.candidate.label, **self.candidate.as_dict(), "step_seconds": self.step_seconds,
                "tokens_per_second": self.tokens_per_second, "tflops_per_device": self.tflops_per_device,
                "mfu": self.mfu, "bubble": self.bubble, "peak_bytes": self.peak_bytes, "fits": self.fits,
                "reason": self.reason, "parts": dict(self.parts)}


@attrs.frozen
class Setting:
    """What is planned: the model's census, the hardware, the devices, the global batch in
    sequences, the dtype computed in and the optimizer; ``budget_bytes`` per device (default:
    the hardware's memory)."""

    census: Census
    hardware: Hardware
    devices: int
    batch: int
    dtype: str = "bf16"
    optimizer: str = "adamw"
    budget_bytes: int | None = None

    @property
    def budget(self) -> int:
        if self.budget_bytes is not None:
            return self.budget_bytes
        if self.hardware.memory_gib is None:
            raise ValueError(f"--hardware {self.hardware.name}: planning needs memory_gib (or --memory-budget-mb)")
        return int(self.hardware.memory_gib * 2**30)


class Planner:
    """Prices candidates for one ``Setting`` (module doc); the roofline of each (sequences
    per microbatch, tp) is computed once."""

    def __init__(self, setting: Setting) -> None:
        hw = setting.hardware
        peak = hw.peak(setting.dtype)
        if peak is None or hw.memory_tb_per_s is None:
            raise ValueError(f"--hardware {hw.name}: planning needs peak_tflops.{setting.dtype} and memory_tb_per_s")
        if hw.intra_node_gb_per_s is None or hw.inter_node_gb_per_s is None:
            raise ValueError(f"--hardware {hw.name}: planning needs intra_node_gb_per_s and inter_node_gb_per_s")
        self.setting = setting
        self.peak = peak * 1e12
        self.roofline = Roofline(self.peak, hw.memory_tb_per_s * 1e12, hw.planning("flop_efficiency"),
                                 hw.planning("memory_efficiency"), hw.planning("op_overhead_us") * 1e-6)
        self.comm_overlap = hw.planning("comm_overlap")
        share, factor = hw.planning("link_efficiency"), hw.planning("scatter_gather_factor")
        self.topology = Topology(
            int(hw.planning("devices_per_node")),
            Link(hw.intra_node_gb_per_s * 1e9 * share, hw.planning("intra_node_latency_us") * 1e-6, factor),
            Link(hw.inter_node_gb_per_s * 1e9 * share, hw.planning("inter_node_latency_us") * 1e-6, factor),
        )
        self._times: dict[tuple[int, int, int], dict[str, float]] = {}
        self._bounds: dict[int, tuple[int, ...] | None] = {}

    # -- compute --------------------------------------------------------------------------
    def phase_times(self, part_index: int, sequences: int, tp: int) -> dict[str, float]:
        """Seconds of F, BI, BW of the census's layer (0), embedding (1) or head (2) on a
        microbatch of ``sequences`` sequences, divided ``tp`` ways."""
        key = (part_index, sequences, tp)
        out = self._times.get(key)
        if out is None:
            part = self._part(part_index)
            scale = sequences / tp
            out = {p: self.roofline.seconds((f * scale, b * scale) for f, b in part.ops.get(p, ()))
                   for p in ("F", "BI", "BW")}
            self._times[key] = out
        return out

    def model_seconds(self, sequences: int) -> float:
        """F + BI + BW of the whole model (every layer, the embedding and the head) on one
        rank for one microbatch of ``sequences`` sequences: the compute of a one-rank,
        one-microbatch step, which ``tuning.calibrate.fit_step`` fits the hardware to."""
        layer, embed, head = (sum(self.phase_times(k, sequences, 1).values()) for k in range(3))
        return self.setting.census.layers * layer + embed + head

    def _part(self, index: int) -> Part:
        c = self.setting.census
        return (c.layer, c.embed, c.head)[index]

    def bounds(self, chunks: int, tp: int = 1) -> tuple[int, ...] | None:
        """The layers of each of ``chunks`` pipeline stages: contiguous, balanced by compute
        with the embedding on the first layer and the head on the last, each as ``tp`` ranks
        compute it (the layers, embedding and head are all cut ``tp`` ways: the embedding and
        head by vocabulary, as ``piper_directives.shard_vocab`` cuts them)."""
        key = (chunks, tp)
        if key not in self._bounds:
            c = self.setting.census
            layer, embed, head = (sum(self.phase_times(k, 1, tp).values()) for k in range(3))
            weights = [layer] * c.layers
            weights[0] += embed
            weights[-1] += head
            self._bounds[key] = balanced_bounds(weights, chunks)
        return self._bounds[key]

    # -- one candidate ----------------------------------------------------------------------
    def price(self, cand: Candidate) -> Plan:
        s, c = self.setting, self.setting.census
        tp, pp, dp, m, cp = cand.tp, cand.pp, cand.dp, cand.microbatches, cand.cp
        problem = self._refusal(cand)
        if problem:
            return _refused(cand, problem)
        sequences = s.batch // (dp * m)
        v = CHUNKS[cand.schedule]
        bounds = self.bounds(pp * v, tp)
        if bounds is None:
            return _refused(cand, f"{c.layers} layers cannot fill {pp * v} pipeline stages")
        stage_layers = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
        ranks = [self._rank_stages(cand.schedule, pp, r) for r in range(pp)]
        # tp cuts each operator (the embedding and head by vocabulary), cp each sequence
        layer_t = self.phase_times(0, sequences, tp * cp)
        embed_t = dict(self.phase_times(1, sequences, tp * cp))
        head_t = self.phase_times(2, sequences, tp * cp)
        act = c.hidden * c.seq_len * sequences * c.dtype_bytes  # one layer's output, the whole microbatch
        tp_link = self.topology.link(tp)
        # per layer and direction (attention, MLP); SP: a reduce-scatter and an all-gather instead
        tp_comm = 2 * (tp_link.reduce_scatter(act, tp) + tp_link.all_gather(act, tp) if cand.sp
                       else tp_link.all_reduce(act, tp))
        embed_t["F"] += tp_link.all_reduce(act, tp)  # the vocabulary-parallel embedding's rows summed
        # per layer and direction: the keys' and values' all-gather (forward) or reduce-scatter (backward)
        cp_comm = 2 * self.topology.link(cp).all_gather(self._kv_bytes() * sequences, cp)
        tp_comm += cp_comm

        def rank_cost(stages: Iterable[int], weight: float = 1.0) -> dict[str, float]:
            cost = {"F": 0.0, "BI": 0.0, "BW": 0.0}
            for k in stages:
                n = stage_layers[k]
                cost["F"] += weight * n * (layer_t["F"] + tp_comm)
                cost["BI"] += weight * n * (layer_t["BI"] + tp_comm + (layer_t["F"] + tp_comm if cand.recompute else 0))
                cost["BW"] += weight * n * layer_t["BW"]
                for extra, here in ((embed_t, k == 0), (head_t, k == len(stage_layers) - 1)):
                    if here:
                        for p in cost:
                            cost[p] += weight * extra[p]
            return cost

        costs = [rank_cost(stages, 0.5 if cand.schedule == "dualpipe" else 1.0) for stages in ranks]
        slowest = max(costs, key=lambda x: sum(x.values()))
        hop_link = self.topology.link(pp, tp * dp * cp) if pp > 1 else self.topology.intra
        hop = hop_link.p2p(act / (tp * cp))
        step, bubble = pipeline_step(cand.schedule, pp, m, slowest["F"], slowest["BI"], slowest["BW"], hop)
        # Data parallelism, optimizer, memory: per rank, from its parameters.
        params = [sum(self._stage_params(k, stage_layers, tp) for k in stages) for stages in ranks]  # DualPipe: 2 stages
        replicas = dp * cp  # context-parallel ranks reduce their gradients as replicas do
        dp_link = self.topology.link(replicas, tp)
        busy = m * sum(slowest.values())
        nbytes = max(params) * FP32
        grad_sync = dp_link.all_reduce(nbytes, replicas)
        gathers = after_optimizer = 0.0
        if cand.zero >= 1:  # the gradients reduce-scattered: each replica updates its shard
            grad_sync = dp_link.reduce_scatter(nbytes, replicas)
        if cand.zero in (1, 2):  # the updated shards gathered after the optimizer: the step's last work
            after_optimizer = dp_link.all_gather(nbytes, replicas)
        if cand.zero >= 3:  # each microbatch's forward and backward gather the rank's parameters
            gathers = 2 * m * dp_link.all_gather(nbytes, replicas)
        last = slowest["BI"] + slowest["BW"]  # the last backward, which the gradient reduction overlaps
        overlap = self.comm_overlap  # of the compute, what may hide traffic (none where both take the cores)
        exposed = (max(grad_sync - overlap * last, 0.0) + max(gathers - overlap * (busy - last), 0.0)
                   + after_optimizer)
        shard = max(params) / (replicas if cand.zero >= 1 else 1)
        optimizer = self.roofline.seconds([(0.0, shard * FP32 * 7.0)])  # read p, g, m, v; write p, m, v
        total = step + exposed + optimizer
        peak, state = max(self._memory(cand, stages, p, stage_layers, sequences)
                          for stages, p in zip(ranks, params, strict=True))
        tokens = s.batch * c.seq_len
        flops = s.batch * c.model_flops()
        tflops = flops / total / s.devices / 1e12
        reason = "" if peak <= s.budget else \
            f"needs {peak / 2**30:.1f} GiB per device, over the {s.budget / 2**30:.1f} GiB budget"
        return Plan(cand, total, tokens / total, tflops, tflops * 1e12 / self.peak, bubble, int(peak), reason,
                    {"pipeline": step, "dp_exposed": exposed, "optimizer": optimizer,
                     "tp_comm_per_layer": tp_comm - cp_comm, "cp_comm_per_layer": cp_comm,
                     "F": slowest["F"], "BI": slowest["BI"], "BW": slowest["BW"], "hop": hop,
                     "state_bytes": state})

    def _refusal(self, cand: Candidate) -> str:
        s, c = self.setting, self.setting.census
        tp, pp, dp, m = cand.tp, cand.pp, cand.dp, cand.microbatches
        if cand.devices != s.devices:
            return f"uses {cand.devices} devices, not {s.devices}"
        if cand.ep > 1:
            return "expert parallelism is not planned analytically"
        if cand.sp and tp < 2:
            return "sequence parallelism needs tp >= 2"
        if cand.cp > 1 and tp > 1:
            return "context parallelism with tensor parallelism is not supported"
        if c.seq_len % cand.cp:
            return f"cp={cand.cp} does not divide the sequence of {c.seq_len} tokens"
        if cand.cp > 1 and cand.recompute:
            return "a recomputed region cannot issue context-parallel gathers"
        if c.heads % tp or c.hidden % tp:
            return f"tp={tp} does not divide the {c.heads} attention heads and hidden size {c.hidden}"
        if tp > self.topology.per_node:
            return f"tp={tp} spans nodes of {self.topology.per_node} devices (tensor parallelism stays in a node)"
        if s.batch % (dp * m):
            return f"the batch of {s.batch} sequences does not divide into dp={dp} x {m} microbatches"
        if cand.zero and dp < 2:
            return "ZeRO needs dp >= 2"
        sched = cand.schedule
        if sched == "zb1p" and m < pp:
            return "zb1p needs microbatches >= pp"
        if sched == "dualpipev" and m < 2 * pp:
            return "dualpipev needs microbatches >= 2 x pp"
        if sched == "dualpipe" and (pp % 2 or m % 2 or m < 2 * pp):
            return "dualpipe needs an even pp and an even microbatch count >= 2 x pp"
        if sched == "interleaved_1f1b" and pp > 1 and m % max(1, m // pp):
            return "interleaved_1f1b needs microbatches divisible by their rounds"
        return ""

    @staticmethod
    def _rank_stages(schedule: str, pp: int, r: int) -> tuple[int, ...]:
        if schedule == "interleaved_1f1b":
            return tuple(r + k * pp for k in range(CHUNKS[schedule]))
        if schedule == "dualpipev":
            return (r, 2 * pp - 1 - r)
        if schedule == "dualpipe":
            return (r, pp - 1 - r)  # each microbatch runs one of the two (weight 0.5 each)
        return (r,)

    def _kv_bytes(self) -> float:
        """The keys and values of one layer for one whole sequence."""
        c = self.setting.census
        return 2 * c.kv_heads * (c.hidden // c.heads) * c.seq_len * c.dtype_bytes

    def _stage_params(self, k: int, stage_layers: Sequence[int], tp: int) -> float:
        c = self.setting.census
        out = stage_layers[k] * c.layer.params / tp
        if k == 0:
            out += c.embed.params / tp  # cut by vocabulary
        if k == len(stage_layers) - 1:
            out += (c.head.params + (c.embed.params if c.tied and k > 0 else 0)) / tp  # a tied weight: held here too
        return out

    def _memory(self, cand: Candidate, stages: Sequence[int], params: float, stage_layers: Sequence[int],
                sequences: int) -> tuple[float, float]:
        """A rank's peak bytes and the model state's part of them (module doc)."""
        s, c = self.setting, self.setting.census
        dp, zero, cp = cand.dp * cand.cp, cand.zero, cand.cp  # ZeRO shards over the dp x cp replicas
        state = OPTIMIZER_STATE_FACTOR.get(s.optimizer, 2) * FP32
        per_param = (FP32 / (dp if zero >= 3 else 1) + FP32 / (dp if zero >= 2 else 1)
                     + state / (dp if zero >= 1 else 1))
        model = params * per_param
        layers = sum(stage_layers[k] for k in stages)
        if cand.schedule == "dualpipe":
            layers //= 2
        # one layer's activations on one rank for one sequence (module doc)
        kept = c.layer.kept_per_rank(cand.tp, cand.sp) / cp + self._kv_bytes() * (cp - 1) / cp
        if cand.recompute:
            per_mb = layers * c.layer.output_bytes * sequences / (cand.tp if cand.sp else 1)
            working = kept * sequences
        else:
            per_mb = layers * kept * sequences
            working = 0.0
        if any(k == len(stage_layers) - 1 for k in stages):
            per_mb += c.head.saved_bytes * sequences / (cp * cand.tp)  # the logits' vocabulary slice
        return model + _in_flight(cand.schedule, cand.pp, cand.microbatches) * per_mb + working, model


def _in_flight(schedule: str, pp: int, m: int) -> float:
    """Microbatches whose activations the first rank holds at once, in units of all its
    layers' (module doc)."""
    if schedule == "gpipe":
        return m
    if schedule == "interleaved_1f1b" and pp > 1:
        v = CHUNKS[schedule]
        return min(m * v, 2 * (pp - 1) + (v - 1) * pp + 1) / v
    if schedule in ("dualpipe", "dualpipev"):
        return min(m, pp + 1)
    return min(m, pp)


def _refused(cand: Candidate, reason: str) -> Plan:
    return Plan(cand, math.inf, 0.0, 0.0, None, 0.0, 0, reason)


def candidates(devices: int, *, schedules: Sequence[str] = SCHEDULES, microbatches: Sequence[int],
               zeros: Sequence[int] = (0, 1, 2, 3), tps: Sequence[int] | None = None, pps: Sequence[int] | None = None,
               recompute: Sequence[bool] = (False, True), sp: Sequence[bool] = (False,),
               cps: Sequence[int] = (1,)) -> list[Candidate]:
    """Every (schedule, pp, dp, tp, ZeRO, microbatches, recompute) for ``devices`` devices,
    each tp > 1 with the sequence-parallel choices ``sp``, and with each context-parallel
    degree of ``cps`` > 1 the (schedule, pp, dp, ZeRO, microbatches) of the rest (no tp, no
    recomputation: the library refuses both with cp)."""
    out = []
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    shapes = [(tp, 1) for tp in (divisors if tps is None else tps)] if 1 in cps else []
    shapes += [(1, cp) for cp in sorted(set(cps) - {1}) if devices % cp == 0]
    for tp, cp in shapes:
        for pp in divisors if pps is None else pps:
            if devices % (tp * pp * cp):
                continue
            dp = devices // (tp * pp * cp)
            for zero in zeros:
                if zero and dp < 2:
                    continue
                for schedule in schedules:
                    for m in microbatches:
                        if pp == 1 and schedule != "1f1b" or pp > 1 and m < pp and schedule != "gpipe":
                            continue  # one rank: every schedule is the same step; fewer microbatches than ranks
                        for r in recompute if cp == 1 else (False,):
                            for q in sorted(set(sp)) if tp > 1 else (False,):
                                out.append(Candidate(schedule, pp, m, dp, tp, 1, zero, None, r, q, cp))
    return out


def rank(plans: Iterable[Plan]) -> list[Plan]:
    """Fitting plans fastest first (then less memory), then the rest by memory."""
    return sorted(plans, key=lambda p: (not p.fits, p.step_seconds if p.fits else p.peak_bytes or math.inf,
                                        p.peak_bytes, p.candidate.label))
