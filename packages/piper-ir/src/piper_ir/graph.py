"""The global training DAG: segments, values, nodes and edges.

A ``Graph`` is an immutable value. Passes never edit one in place: they build a new graph
(``attrs.evolve``, or new tuples of nodes and edges). Cross-node invariants are checked by
``piper_ir.validate.validate``; field validators only check what one field can know alone.
"""

from __future__ import annotations

from enum import StrEnum
from functools import cached_property
from itertools import pairwise

import attrs

from piper_ir.tags import Phase, Tags


class NodeKind(StrEnum):
    """What a node (and, once compiled, an ``Instruction``) does: the runtime contract.

    A runtime executes a ``Program`` and nothing else; this is what it must do for each kind
    (the details, stage by stage, are in docs/ir-conventions.md; piper-runtime is one
    implementation, a second runtime implements the same list). ``value`` names a tensor for
    transfers and a ``Bucket`` id for the bucket kinds (``BUCKET_KINDS``).

    - ``COMPUTE`` phase ``F``: run the segment's code on its inputs for ``microbatch`` (batch
      chunk, local or received value), keeping what its backward needs; the loss segment's
      output, scaled by ``1 / (microbatches * replicas)`` exactly once, is what its backward
      differentiates. ``B``: backward of that forward, given the gradients ``grad:<output>``
      (contributions summed), yielding ``grad:<input>`` for each floating input that needs one
      and accumulating the parameters' gradients. ``BI``: only the input gradients, keeping
      the graph; ``BW``: then the parameter gradients on it. An instruction that names a
      ``communicator`` issues collectives inside (tensor/expert parallelism, ``Sharding``) on
      it, in one order on every member.
    - ``OPTIMIZER``: step the segment's optimizer on the gradients accumulated over the step,
      then drop them; where ``Bucket.optimizer_home`` is ``SHARDED`` only this replica's shard
      of the bucket (and its gradient shard) is stepped.
    - ``SEND`` / ``RECV``: move ``value`` of ``microbatch`` to / from ``peer`` on
      ``communicator``, ``meta`` giving the exact shape and dtype. Messages of one
      (communicator, sender, receiver) are matched in list order. A runtime may post receives
      ahead (at most ``ExecutionOptions.recv_lookahead`` beyond the one needed).
    - ``ALL_REDUCE``: sum the bucket's gradients over ``communicator``'s ranks in place of the
      local ones; where the bucket's optimizer state is sharded, sum its gradient *shard*
      instead (a member that does not hold ``value`` uses the bucket among its ``mirrors`` it
      holds).
    - ``REDUCE_SCATTER``: reduce the bucket's full gradients over the group, add this
      replica's shard into the gradient shard and drop the full gradients. Where
      ``Bucket.grads_home`` is ``SHARDED`` a runtime may start it early, inside the
      weight-gradient pass that completes the bucket (at most
      ``ExecutionOptions.reduce_scatters_in_flight`` running), in one order on every member.
    - ``ALL_GATHER``: gather the updated parameter shards into the full parameters (after the
      step, where parameters live full and optimizer state sharded).
    - ``MATERIALIZE`` / ``FREE``: where ``Bucket.params_home`` is ``SHARDED``, gather the
      bucket's full parameters for a chain of uses / drop them (the shard stays).
    - ``GRAD_NORM``: the global gradient norm, once per step, after every reduction and
      before every ``OPTIMIZER``: sum the squares of the gradient pieces this rank counts
      (``Graph.grad_norm`` / ``Program.grad_norm``: ``GradNorm.terms_of(rank)``, every
      gradient element of the model counted on exactly one rank), sum that one number over
      ``communicator`` (every rank), take the square root; with ``GradNorm.max_norm`` set,
      multiply every gradient the rank's optimizers step by ``min(1, max_norm / (norm +
      1e-6))`` (``torch.nn.utils.clip_grad_norm_``).
    - ``MARKER``: nothing (ordering only).
    - ``ALL_TO_ALL``, ``BROADCAST``: not produced by compile yet (expert parallelism's
      all-to-alls run inside ``COMPUTE``); a runtime rejects them at setup.

    Every instruction first waits for the events in its ``waits`` and, once issued, records
    ``record``; ranks issue a group's collectives in list order (``verify`` proved it).
    """

    COMPUTE = "compute"  # a segment's F / B / BI / BW, or the loss
    OPTIMIZER = "optimizer"  # the update of one segment's parameters
    SEND = "send"
    RECV = "recv"
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    MATERIALIZE = "materialize"
    FREE = "free"
    GRAD_NORM = "grad_norm"  # the global gradient norm (and clipping by it), every rank
    MARKER = "marker"


COMMUNICATION_KINDS = frozenset(
    {
        NodeKind.SEND,
        NodeKind.RECV,
        NodeKind.ALL_REDUCE,
        NodeKind.REDUCE_SCATTER,
        NodeKind.ALL_GATHER,
        NodeKind.ALL_TO_ALL,
        NodeKind.BROADCAST,
        NodeKind.GRAD_NORM,
    }
)


# Operations of a replicated segment's device group on one parameter bucket (``Node.value`` is
# the bucket id; docs/ir-conventions.md, section 7). Every member of the group runs them.
BUCKET_KINDS = frozenset(
    {NodeKind.ALL_REDUCE, NodeKind.REDUCE_SCATTER, NodeKind.ALL_GATHER, NodeKind.MATERIALIZE, NodeKind.FREE}
)
POINT_TO_POINT_KINDS = frozenset({NodeKind.SEND, NodeKind.RECV})
# The stream of the collectives that sum a tied parameter's gradient over the ranks holding
# it (``Tie``; their communicators are a traffic class of their own, ``tie``).
TIE_STREAM = "tie"
# Nodes that run a segment's code (its passes, its optimizer step): what ``Order`` orders.
COMPUTE_KINDS = frozenset({NodeKind.COMPUTE, NodeKind.OPTIMIZER})


class ShardKind(StrEnum):
    """How a ``Shard`` splits a segment over its group (``Sharding.kind``)."""

    TP = "tp"  # tensor parallelism: column/row-parallel Linear pairs, same data on every rank
    EP = "ep"  # expert parallelism: experts split over the group, tokens routed by all-to-all
    # context parallelism: each rank of a group holds a chunk of every sequence (dim 1) and the
    # same weights; data-parallel for the runtime, attention gathers keys/values over the group
    # (piper_directives.context_parallel, docs/context-parallel.md)
    CP = "cp"


class Residency(StrEnum):
    """Where one of a bucket's kinds of state lives between its uses (``Bucket``)."""

    FULL = "full"  # every replica holds the whole bucket
    SHARDED = "sharded"  # each replica holds its ``shard_numel`` range of the padded bucket


class EdgeKind(StrEnum):
    DATA = "data"  # a tensor flows from src to dst
    TEMPORAL = "temporal"  # ordering only


class SegmentRole(StrEnum):
    STAGE = "stage"  # an annotated region of the model
    LOSS = "loss"  # the loss function applied to the model output and the targets


@attrs.frozen
class TensorMeta:
    """Shape and dtype of a value; ``batch_dim`` is the dimension ``Split`` divides."""

    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: str
    batch_dim: int | None = None
    requires_grad: bool = False

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def nbytes(self) -> int:
        return self.numel() * _DTYPE_BYTES.get(self.dtype, 4)

    def split(self, parts: int) -> TensorMeta:
        """The meta of one of ``parts`` equal chunks along the batch dimension."""
        if self.batch_dim is None:
            return self
        shape = list(self.shape)
        shape[self.batch_dim] //= parts
        return attrs.evolve(self, shape=tuple(shape))


_DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


@attrs.frozen
class Value:
    """A tensor that flows between segments (or in from the batch)."""

    name: str
    meta: TensorMeta


@attrs.frozen
class CodeRef:
    """An opaque, versioned reference to a segment's captured code.

    Only torch-side packages decode it. ``format`` says which decoder applies; ``digest``
    identifies the code so a saved plan can be matched to the bundle that executes it.
    """

    format: str
    version: int
    digest: str


@attrs.frozen
class Segment:
    """One annotated region of the model (or the loss), the unit of compute in the DAG."""

    id: str
    role: SegmentRole
    tags: Tags
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple[tuple[str, TensorMeta], ...] = ()
    code: CodeRef | None = None
    source: str | None = None  # where the user wrote the annotation, "file.py:42"
    recompute: bool = False
    """Drop this segment's activations after its forward and recompute them before its
    backward (``torch.utils.checkpoint`` in the user's code, or a recompute directive); only
    its inputs are kept between the two passes. The gradients are the same either way."""


@attrs.frozen
class Tie:
    """One logical parameter held by several segments (tied weights: ``wte.weight`` is
    ``lm_head.weight``, or one module called from several regions).

    ``name`` is the model's own name for it (the first in ``model.named_parameters()``:
    what single-device training, gradients and checkpoints call it); ``holders`` are the
    ``(segment id, qualified name in that segment's params)`` pairs that hold a copy, in
    segment order. Its gradient is the sum of every holder's gradient, and every copy
    takes the same update (docs/ir-conventions.md, section 1). ``uses`` says, per holder,
    where the user's code uses it ("module 'lm_head' at model.py:120"), for messages that
    must name every holder; empty when unknown.
    """

    name: str
    holders: tuple[tuple[str, str], ...] = attrs.field(converter=lambda hs: tuple(tuple(h) for h in hs))
    uses: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def describe(self) -> str:
        """Each holder with its use: ``'lm_head.weight' in s3 (module 'lm_head' at m.py:9); ...``."""
        uses = self.uses if len(self.uses) == len(self.holders) else ("",) * len(self.holders)
        return "; ".join(
            f"{qualname!r} in {seg}" + (f", used by {use}" if use else "")
            for (seg, qualname), use in zip(self.holders, uses, strict=True)
        )


@attrs.frozen
class Precision:
    """Which dtypes a training step computes in and keeps its master state in.

    ``compute``: the dtype parameters are cast to for the forward and backward passes (and
    floating batch inputs, and the values segments exchange); ``master``: the dtype of the
    parameters themselves, their gradients, the optimizer state and ZeRO shards. The loss is
    computed in ``master`` from outputs cast up.
    """

    compute: str
    master: str = "float32"


@attrs.frozen
class Replication:
    """How the replicas of one segment (a device group of several devices) stay in sync.

    ``zero``: 0 = gradients all-reduced once per step per bucket; 1 = optimizer state
    sharded; 2 = gradients also kept sharded between microbatches; 3 = parameters also
    sharded and materialized per use. ``bucket_bytes`` caps a gradient bucket.
    """

    segment: str
    devices: tuple[int, ...] = attrs.field(converter=tuple)
    zero: int = 0
    bucket_bytes: int = 25 * 2**20
    reduce_stream: str = "dp"
    gather_stream: str = "dp"
    origin: str | None = None


@attrs.frozen
class Bucket:
    """Parameters of one segment flattened into one buffer, in ``params`` order.

    A bucket replicated over ``shards`` devices is padded to a multiple of ``shards``; replica
    ``j`` owns the range ``[j * shard_numel, (j + 1) * shard_numel)`` when it is sharded.

    ``devices``: the ranks that hold this bucket and reduce it among themselves, in replica
    order; empty means the whole group of the segment's ``Replication``. A segment that is
    also tensor- or expert-sharded (a ``Sharding`` with ``degree`` smaller than its group)
    holds different parameter shards on the ranks of one shard group, so each shard
    position gets its own buckets over the ranks that hold the same shard (numel counts the
    shard's elements).

    ``params_home``, ``grads_home``, ``optimizer_home``: where the bucket's parameters,
    its gradients between microbatches and its optimizer state live (``Residency``; filled by
    ``piper_memory.plan_memory`` from the ZeRO level, all ``FULL`` by default). A runtime
    reads these, never the ZeRO level: optimizer state ``SHARDED`` means the optimizer steps
    only the replica's shard (``REDUCE_SCATTER`` before it, ``ALL_GATHER`` after it while the
    parameters live full); gradients ``SHARDED`` means only the gradient shard outlives a
    microbatch's weight-gradient pass; parameters ``SHARDED`` means only the parameter shard
    lives between steps, the full bucket existing from a ``MATERIALIZE`` to its ``FREE``.

    ``mirrors``: the buckets of the same parameters, with the same layout, on the other
    microbatch groups of a mirrored segment (DualPipe) that ZeRO-2/3 shards per group. An
    ``ALL_REDUCE`` node on a bucket whose optimizer state is sharded sums the gradient *shard*
    over its devices: a member that does not hold ``value`` uses the bucket of ``value``'s
    mirrors that it holds (docs/ir-conventions.md, section 7).
    """

    id: str
    segment: str
    params: tuple[str, ...]
    numel: int
    shards: int = 1
    dtype: str = "float32"
    devices: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    mirrors: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    params_home: Residency = attrs.field(default=Residency.FULL, converter=Residency)
    grads_home: Residency = attrs.field(default=Residency.FULL, converter=Residency)
    optimizer_home: Residency = attrs.field(default=Residency.FULL, converter=Residency)

    def __attrs_post_init__(self) -> None:
        # Each level shards what the one before it shards: parameters only with gradients,
        # gradients only with optimizer state (the ZeRO ladder; a runtime relies on it).
        order = (self.optimizer_home, self.grads_home, self.params_home)
        if any(a is Residency.FULL and b is Residency.SHARDED for a, b in pairwise(order)):
            raise ValueError(
                f"bucket {self.id}: parameters {self.params_home}, gradients {self.grads_home}, optimizer "
                f"state {self.optimizer_home}; sharded parameters need sharded gradients, sharded "
                "gradients sharded optimizer state"
            )

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.shards)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.shards


@attrs.frozen
class ParamShard:
    """How one parameter of a tensor-parallel segment is cut across the ranks of its group.

    Dimension ``dim`` is viewed as ``groups`` equal blocks (for example q, k and v of a fused
    attention projection: ``groups=3``); each block is cut into ``degree`` equal contiguous
    pieces, and rank ``r`` of the group holds the ``r``-th piece of every block, concatenated
    in block order.

    ``experts``: the parameter holds experts (on ``dim``) of a tensor-parallel segment that is
    also expert-parallel; it is cut over the segment's expert-parallel group
    (``Sharding.expert_degree`` ranks) rather than over its tensor-parallel group.
    """

    name: str
    dim: int
    groups: int = 1
    experts: bool = False

    def pieces(self, size: int, degree: int, rank: int) -> tuple[tuple[int, int], ...]:
        """The ``(start, length)`` ranges of dimension ``dim`` (of ``size`` entries) that
        rank ``rank`` of ``degree`` holds, in the order they are concatenated."""
        if size % (self.groups * degree):
            raise ValueError(f"{self.name}: {size} entries do not cut into {self.groups} x {degree} pieces")
        block = size // self.groups
        piece = block // degree
        return tuple((g * block + rank * piece, piece) for g in range(self.groups))


@attrs.frozen
class Sharding:
    """A segment run SPMD on a sharded group (``Shard``).

    ``kind="tp"``: tensor parallelism; every rank of ``devices`` sees the same data and holds
    a shard of the parameters listed in ``params`` (the others are replicated and stay equal
    without communication). ``collectives`` counts the all-reduces one forward issues on the
    group's ``tp`` communicator (backward issues its own, in the same order on every member);
    0 for a segment with nothing to shard. ``kind="ep"``: expert parallelism; the ranks are
    data-parallel replicas (a ``Replication`` keeps the rest in sync), ``params`` are the
    expert parameters (cut on dimension 0) and ``collectives`` counts the expert calls, each
    issuing its all-to-alls on the group's ``ep`` communicator. ``kind="cp"``: context
    parallelism; the ranks are data-parallel replicas (a ``Replication`` sums their
    gradients) each holding a chunk of every sequence, ``params`` is empty and
    ``collectives`` counts the key/value gathers one forward issues on the group's ``cp``
    communicator (piper_directives.context_parallel).

    ``degree`` may be smaller than ``len(devices)``: the segment is then also data-parallel.
    ``devices`` is replica-major: consecutive runs of ``degree`` ranks are the shard groups
    (``group_of``; each has its own ``tp``/``ep`` communicator), and the ranks at one
    position of every run hold the same shard (``holders``) and reduce its gradients.

    ``plan``: the ``Shard``'s tensor-parallel plan by module path, ``(pattern, style)`` pairs
    (``"colwise"``/``"rowwise"``; ``*`` matches one path component); empty: the torch-side
    rewrite finds the Linears to cut itself.

    ``expert_degree`` (``kind="tp"``, 1 otherwise): tensor with expert parallelism. The
    expert-parallel groups are runs of ``expert_degree`` consecutive ranks of ``devices`` (a
    multiple of ``degree``: several tensor-parallel groups that are data-parallel replicas of
    each other); the expert parameters (``ParamShard.experts``) are cut over them, the tokens
    of each tensor-parallel group split among its ranks and routed with all-to-alls on the
    group's ``ep`` communicator (piper_directives.expert_code, docs/ir-conventions.md,
    section 9). The methods below take the ``degree`` of the cut they ask about (default: the
    tensor-parallel one); ``degree_of`` says which a parameter has.
    """

    segment: str
    devices: tuple[int, ...] = attrs.field(converter=tuple)
    kind: ShardKind = attrs.field(default=ShardKind.TP, converter=ShardKind)
    degree: int = 1
    params: tuple[ParamShard, ...] = attrs.field(default=(), converter=tuple)
    collectives: int = 0
    origin: str | None = None
    plan: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=lambda v: tuple(tuple(p) for p in v))
    #: ``kind="tp"`` only: the code between tensor-parallel regions runs on sequence shards
    #: (Megatron's sequence parallelism; piper_directives.shard_sequence)
    sequence_parallel: bool = False
    expert_degree: int = 1

    def degree_of(self, spec: ParamShard) -> int:
        """How many ways parameter ``spec`` is cut: over the expert-parallel group for the
        experts of a tensor- and expert-parallel segment, else over the shard group."""
        return self.expert_degree if spec.experts else self.degree

    def group_of(self, rank: int, degree: int | None = None) -> tuple[int, ...]:
        """The shard group of ``rank``: ``devices`` cut into consecutive runs of ``degree``
        ranks (default ``self.degree``; the whole of ``devices`` unless the segment is also
        data-parallel)."""
        d = degree or self.degree
        i = self.devices.index(rank) // d * d
        return self.devices[i : i + d]

    def groups(self, degree: int | None = None) -> tuple[tuple[int, ...], ...]:
        """Every shard group (runs of ``degree``, default ``self.degree``), in order."""
        d = degree or self.degree
        return tuple(self.devices[i : i + d] for i in range(0, len(self.devices), d))

    def position(self, rank: int, degree: int | None = None) -> int:
        """Which shard ``rank`` holds (its position in its run of ``degree``, default
        ``self.degree``)."""
        return self.devices.index(rank) % (degree or self.degree)

    def holders(self, position: int, degree: int | None = None) -> tuple[int, ...]:
        """The ranks holding shard ``position`` of a ``degree``-way cut (default
        ``self.degree``), one per data-parallel replica of the group, in order."""
        return self.devices[position :: degree or self.degree]

    def local_meta(self, name: str, meta: TensorMeta) -> TensorMeta:
        """The meta of one rank's shard of parameter ``name`` (``meta`` if it is not cut)."""
        spec = next((p for p in self.params if p.name == name), None)
        if spec is None:
            return meta
        shape = list(meta.shape)
        shape[spec.dim] //= self.degree_of(spec)
        return attrs.evolve(meta, shape=tuple(shape))


def _ranges(value: object) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in value)  # type: ignore[attr-defined]


@attrs.frozen
class NormTerm:
    """A piece of gradient that rank ``rank`` counts in the global gradient norm (``GradNorm``).

    Either ``param``: the whole gradient of that parameter of ``segment`` as the rank holds it
    when its optimizer steps (a tensor- or expert-parallel rank's shard of it), or ``bucket``:
    the elements ``ranges`` (``[start, stop)`` pairs, relative to the shard's first element)
    of the rank's gradient *shard* of that bucket (a bucket whose optimizer state is
    ``SHARDED``).
    """

    rank: int
    segment: str
    param: str | None = None
    bucket: str | None = None
    ranges: tuple[tuple[int, int], ...] = attrs.field(default=(), converter=_ranges)

    def __attrs_post_init__(self) -> None:
        if (self.param is None) == (self.bucket is None):
            raise ValueError(f"a norm term names a parameter or a bucket, not {self.param!r} and {self.bucket!r}")
        if any(not 0 <= a < b for a, b in self.ranges):
            raise ValueError(f"norm term of {self.bucket}: bad ranges {list(self.ranges)}")


@attrs.frozen
class GradNorm:
    """The global gradient norm of a step and clipping by it (the ``GRAD_NORM`` node).

    ``terms``: which gradient pieces each rank counts, so that every element of the
    single-device model's gradient is counted exactly once over the world (replicas after
    their reduction, mirrors after their sum, and the copies of a parameter that tensor
    parallelism replicates count once; ``piper_memory.add_grad_norm`` derives them).
    ``max_norm``: clip the gradients to this total 2-norm (``None``: measure only).
    """

    max_norm: float | None = None
    terms: tuple[NormTerm, ...] = attrs.field(default=(), converter=tuple)

    def terms_of(self, rank: int) -> tuple[NormTerm, ...]:
        return tuple(t for t in self.terms if t.rank == rank)


@attrs.frozen
class Node:
    """One operation of the training step.

    ``devices`` is the device group the node runs on (the SPMD replicas of one region); it is
    empty until ``Place``. For ``SEND``/``RECV`` nodes ``peers[i]`` is the partner of
    ``devices[i]``.
    """

    id: str
    kind: NodeKind
    segment: str | None = None
    phase: Phase | None = None
    microbatch: int | None = None
    tags: Tags = Tags()
    devices: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    stream: str = "compute"
    value: str | None = None
    peers: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    origin: str | None = None  # the directive that created or last placed this node

    def __str__(self) -> str:
        bits = [self.id, self.kind.value]
        if self.phase:
            bits.append(self.phase.value)
        if self.microbatch is not None:
            bits.append(f"mb={self.microbatch}")
        if self.value:
            bits.append(f"value={self.value}")
        if self.devices:
            bits.append(f"devices={list(self.devices)}")
        if self.peers:
            bits.append(f"peers={list(self.peers)}")
        bits.append(f"stream={self.stream}")
        return " ".join(bits)


@attrs.frozen
class Edge:
    src: str
    dst: str
    kind: EdgeKind = EdgeKind.DATA
    value: str | None = None
    origin: str | None = None  # the directive that added a temporal edge

    def __str__(self) -> str:
        label = f"[{self.value}]" if self.value else ""
        return f"{self.src} -{self.kind.value}{label}-> {self.dst}"


@attrs.frozen(eq=True)
class Graph:
    """The global training DAG of one step.

    ``inputs`` and ``targets`` name the values that come from the batch; ``microbatches`` is 1
    until ``Split``. ``ties`` lists the parameters held by several segments; ``precision`` the
    compute and master dtypes when a step runs in a precision of its own (``--precision``).
    """

    segments: tuple[Segment, ...] = attrs.field(converter=tuple)
    values: tuple[Value, ...] = attrs.field(converter=tuple)
    nodes: tuple[Node, ...] = attrs.field(converter=tuple)
    edges: tuple[Edge, ...] = attrs.field(converter=tuple)
    inputs: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    targets: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    microbatches: int = 1
    world_size: int = 0  # number of devices, known after Place
    replication: tuple[Replication, ...] = attrs.field(default=(), converter=tuple)
    buckets: tuple[Bucket, ...] = attrs.field(default=(), converter=tuple)
    sharding: tuple[Sharding, ...] = attrs.field(default=(), converter=tuple)
    ties: tuple[Tie, ...] = attrs.field(default=(), converter=tuple)
    precision: Precision | None = None  # None: every segment runs in its parameters' own dtypes
    grad_norm: GradNorm | None = None  # what the GRAD_NORM node counts (``add_grad_norm``)

    @cached_property
    def node_by_id(self) -> dict[str, Node]:
        return {n.id: n for n in self.nodes}

    @cached_property
    def segment_by_id(self) -> dict[str, Segment]:
        return {s.id: s for s in self.segments}

    @cached_property
    def value_by_name(self) -> dict[str, Value]:
        return {v.name: v for v in self.values}

    @cached_property
    def successors(self) -> dict[str, list[Edge]]:
        """Node id -> the edges leaving it, in edge order: every node, then any other id an
        edge starts at. Made when asked for, in one pass over the edges."""
        out: dict[str, list[Edge]] = {n.id: [] for n in self.nodes}
        for e in self.edges:
            out_of = out.get(e.src)
            if out_of is None:  # an edge from an unknown node
                out[e.src] = [e]
            else:
                out_of.append(e)
        return out

    @cached_property
    def predecessors(self) -> dict[str, list[Edge]]:
        """Node id -> the edges entering it, in edge order: every node, then any other id an
        edge ends at. Made when asked for, in one pass over the edges (the passes of
        ``Strategy.apply`` and ``compile_program`` walk ``predecessor_positions`` instead)."""
        out: dict[str, list[Edge]] = {n.id: [] for n in self.nodes}
        for e in self.edges:
            into = out.get(e.dst)
            if into is None:  # an edge to an unknown node
                out[e.dst] = [e]
            else:
                into.append(e)
        return out

    @cached_property
    def successor_positions(self) -> list[list[int]] | None:
        """Per node, in graph order, the positions in ``nodes`` of the ends of the edges
        leaving it, in edge order (``successors`` by number); None when two nodes share an
        id or an edge names an unknown node. The passes over the whole graph (the cycle
        check, ``rank_orders``, ``compile_program``) count and walk in lists by position
        instead of tables keyed by id: at 392k nodes such a table outgrows the CPU's caches,
        a list of positions much less."""
        return self._adjacency()[0]

    @cached_property
    def predecessor_positions(self) -> list[list[int]] | None:
        """Per node, in graph order, the positions in ``nodes`` of the starts of the edges
        entering it, in edge order (``predecessors`` by number); None where
        ``successor_positions`` is."""
        return self._adjacency()[1]

    @cached_property
    def node_position(self) -> dict[str, int]:
        """Node id -> its position in ``nodes`` (the last one, for an id used twice)."""
        return {n.id: i for i, n in enumerate(self.nodes)}

    def _adjacency(self) -> tuple[list[list[int]] | None, list[list[int]] | None]:
        """``successor_positions`` and ``predecessor_positions`` in one pass over the edges,
        both cached: the passes that walk a graph need them together, and one pass over a
        million edges misses the CPU's caches half as often as two. (``predecessors`` and
        ``successors``, lists of the edges keyed by id, are made when asked for: no pass of
        ``Strategy.apply`` then ``compile_program`` needs them.)"""
        nodes = self.nodes
        position = self.node_position
        succ_p: list[list[int]] | None = None
        pred_p: list[list[int]] | None = None
        if len(position) == len(nodes):
            succ_p, pred_p = [[] for _ in nodes], [[] for _ in nodes]
            at = position.get
            for e in self.edges:
                i, j = at(e.src), at(e.dst)
                if i is None or j is None:
                    succ_p = pred_p = None
                    break
                succ_p[i].append(j)
                pred_p[j].append(i)
        # the frozen class's slots, as cached_property sets them
        object.__setattr__(self, "successor_positions", succ_p)
        object.__setattr__(self, "predecessor_positions", pred_p)
        return succ_p, pred_p

    def node(self, node_id: str) -> Node:
        return self.node_by_id[node_id]

    def stage_segments(self) -> list[Segment]:
        return [s for s in self.segments if s.role is SegmentRole.STAGE]

    def loss_segment(self) -> Segment:
        for s in self.segments:
            if s.role is SegmentRole.LOSS:
                return s
        raise KeyError("graph has no loss segment")
