"""What one training step of a model costs, counted without its weights: ``--model hf:CONFIG``
planned for hardware this machine does not have (docs/planning.md).

A model of any size (Llama-3 405B) is built from its config under
torch's ``FakeTensorMode``: every parameter and activation is a tensor with a shape, a dtype
and no storage, so nothing is allocated and nothing is computed. (Not a plain
``torch.device("meta")``: transformers' mask code asks a tensor for its value, ``.item()``, to
detect packed sequences; it skips that question for fake tensors.)

Only a copy with *one* decoder layer is built and run, and a copy with none: a decoder's
layers are identical, so one layer's costs (the operators the first copy runs and the second
does not), multiplied by the config's layer count, are the stack's, and the zero-layer copy
gives the rest (embedding, final norm, LM head and loss). A model whose layers differ (a
MoE with dense first layers, alternating attention kinds) is priced as if all were the
first.
One forward and backward of one sequence of ``seq_len`` tokens is run under a dispatch mode
that records, for every aten operator,

- its FLOPs (torch's own formulas, ``torch.utils.flop_counter``: matrix products and
  attention; 0 for the rest) and the bytes it reads and writes (the sizes of its tensor
  arguments and results, none for a view: what a roofline charges a memory-bound
  operator, as eager PyTorch runs it, one kernel per operator, nothing fused);
- every operator is kept, views and the like at no FLOPs and no bytes: each is dispatched
  as a step runs it, and the planner charges each the hardware's ``op_overhead_us``;
- its phase: ``F`` (forward), ``BW`` (the backward's operators whose result became a
  parameter's gradient: the weight-gradient half of a split backward) or ``BI`` (the rest
  of the backward); the embedding's operators apart (they run on the first stage only);

and, with ``saved_tensors_hooks``, the bytes the forward keeps for the backward (activation
memory; parameters excluded, each storage once), and of them the bytes of tensors whose last
axis is the hidden size (the residual stream: norms' inputs and outputs, the column Linears'
inputs, the row Linears' outputs), which tensor parallelism leaves whole on every rank and
sequence parallelism cuts; the rest (attention heads, the MLP's intermediate) TP cuts. Costs scale linearly with the tokens of a
microbatch (attention's quadratic part is exact at ``seq_len`` and scales with the
sequences). Mixture-of-experts configs are refused: their routing picks each expert's tokens
from values fake tensors do not have, so the experts' FLOPs cannot be counted this way
(Mixtral's came out at a fifth of the routed top-2's). ``Census`` is plain data; the planner (``piper_train.tuning.planner``) turns it
into seconds with a hardware file.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import attrs
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from piper_train.flops import op_flops
from piper_train.hf import PREFIX, _transformers

PHASES = ("F", "BI", "BW")
#: Config keys that make a model a mixture of experts (refused: module doc).
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
Ops = tuple[tuple[float, float], ...]  # (FLOPs, bytes) of each operator


@attrs.frozen
class Part:
    """One layer, or the rest of the model, for one sequence: per phase the (FLOPs, bytes)
    of each operator; the bytes its forward keeps for the backward; its parameter count; the
    bytes of its outputs (what a pipeline stage boundary sends); and the part of
    ``saved_bytes`` whose tensors' last axis is the hidden size (module doc)."""

    ops: dict[str, Ops]
    saved_bytes: int
    params: int
    output_bytes: int = 0
    hidden_saved_bytes: int = 0

    def kept_per_rank(self, tp: int = 1, sp: bool = False) -> float:
        """What one rank of a ``tp``-way tensor-parallel group keeps of ``saved_bytes``: the
        cut part divided, the hidden-sized part whole, or divided too under sequence
        parallelism."""
        cut = self.saved_bytes - self.hidden_saved_bytes
        return (self.saved_bytes if sp else cut + tp * self.hidden_saved_bytes) / tp

    def flops(self, phase: str | None = None) -> float:
        phases = PHASES if phase is None else (phase,)
        return sum(f for p in phases for f, _ in self.ops.get(p, ()))


@attrs.frozen
class Census:
    """One step's costs of a decoder LM per sequence of ``seq_len`` tokens (module doc):
    ``layer`` (one decoder layer; ``layers`` of them), ``embed`` (the token embedding: the
    first pipeline stage's), ``head`` (the final norm, LM head and loss: the last stage's),
    and the sizes tensor parallelism divides (hidden size, attention and KV heads)."""

    model: str
    seq_len: int
    layers: int
    layer: Part
    embed: Part
    head: Part
    hidden: int
    heads: int
    kv_heads: int
    dtype_bytes: int = 2
    tied: bool = False  # the head reads the embedding's weight: a pipeline's last stage holds it too

    @property
    def params(self) -> int:
        return self.layers * self.layer.params + self.embed.params + self.head.params

    def model_flops(self) -> float:
        """FLOPs of forward and backward of one sequence (no recomputation): the model FLOPs
        of MFU."""
        return self.layers * self.layer.flops() + self.embed.flops() + self.head.flops()

    def as_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


class _Recorder(TorchDispatchMode):
    """Records (FLOPs, bytes) per operator and its phase, ``F`` or ``B`` (module doc), and
    which operator produced each storage (to find, after the backward, the ones that made
    the parameters' gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "F"
        self.ops: list[tuple[str, float, float, bool]] = []  # (phase, FLOPs, bytes, the embedding's)
        self.made: dict[int, int] = {}  # storage -> the operator (index into ops) that wrote it last

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops = op_flops(func, args, kwargs, out) or 0.0
        made = _nbytes(out)
        # A view (t, view, expand) or an operator with no tensor result (prim.device) moves no data.
        moved = made + _nbytes((args, kwargs)) if made and not getattr(func, "is_view", False) else 0
        if getattr(func, "namespace", "") == "prim":  # fake tensors' own queries (prim.device): no step runs them
            return out
        index = len(self.ops)
        self.ops.append((self.phase, flops, float(moved), "embedding" in str(getattr(func, "_overloadpacket", ""))))
        read = {_storage_key(a) for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and _storage_key(t) not in read:  # views and in-place ops made nothing
                self.made[_storage_key(t)] = index
        return out

    def phases(self, grads: list[torch.Tensor]) -> dict[str, Ops]:
        """The operators per phase: ``F``, ``BW`` (those that made a parameter's gradient:
        the last to write a new storage that became one),
        ``BI`` (the rest of the backward); ``EF`` and ``EBW`` the embedding's."""
        weight_grads = {self.made.get(_storage_key(g)) for g in grads}
        out: dict[str, list[tuple[float, float]]] = {}
        for k, (phase, flops, moved, embedding) in enumerate(self.ops):
            if phase != "F":
                phase = "BW" if k in weight_grads else "BI"
            if embedding:
                phase = "E" + phase if phase != "BI" else "EBW"
            # every operator, views and the like at (0, 0): each is dispatched (and charged
            # the hardware's per-operator overhead) as the step runs it
            out.setdefault(phase, []).append((flops, moved))
        return {p: tuple(v) for p, v in out.items()}


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, tuple | list):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


def _storage_key(t: torch.Tensor) -> int:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage()).cdata


def _run(model: nn.Module, seq_len: int, hidden: int) -> tuple[dict[str, Ops], int, int, int]:
    """One forward and backward of one sequence (module doc): the ops per phase, the bytes
    saved for the backward, of them those of tensors whose last axis is ``hidden``, and the
    bytes of the logits."""
    weights = {_storage_key(p) for p in model.parameters()}
    saved: dict[int, int] = {}
    wide: set[int] = set()  # storages saved as a tensor of the hidden size

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in weights:
            saved[key] = max(saved.get(key, 0), t.untyped_storage().nbytes())
            if t.dim() >= 2 and t.shape[-1] == hidden:
                wide.add(key)
        return t

    recorder = _Recorder()
    tokens = torch.zeros((1, seq_len), dtype=torch.long)
    with recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=tokens, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))
        recorder.phase = "B"
        loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return recorder.phases(grads), sum(saved.values()), sum(saved[k] for k in wide), _nbytes(logits)


def hf_census(spec: str, seq_len: int, *, dtype: torch.dtype = torch.bfloat16) -> Census:
    """The ``Census`` of ``hf:PATH`` (a config.json or a model directory; weights, if any,
    are not read) at ``seq_len`` tokens per sequence, computing in ``dtype``. A ``ValueError``
    names the config when it is not a decoder LM this can count."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    transformers = _transformers()
    kind, values, config_file = _read(spec)
    experts = [k for k in MOE_KEYS if values.get(k)]
    if experts:
        # Routing decides each expert's tokens from the values, which fake tensors do not have: the
        # experts' FLOPs would be counted wrong (a fifth of Mixtral's), so they are not counted at all.
        raise ValueError(f"--model {spec}: a mixture-of-experts config ({experts[0]} = {values[experts[0]]}); "
                         "planning counts dense decoders only so far")
    base = hf_config(spec)
    layers = getattr(base, "num_hidden_layers", None)  # n_layer, num_layers, ...: the config maps its own name
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"--model {spec}: the config says no number of layers (num_hidden_layers); planning needs "
                         "a decoder of identical layers")
    hidden = int(base.hidden_size)
    parts = []
    for count in (0, 1):
        try:
            config = transformers.AutoConfig.for_model(kind, **values)
            config.num_hidden_layers = count
            config.use_cache = False
            with FakeTensorMode():
                model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=dtype)
                model.eval()  # dropout off, as piper_train.flops counts: it adds no FLOPs, and fused attention has none
                ops, saved, wide, logits = _run(model, seq_len, hidden)
        except (ValueError, RuntimeError, TypeError, NotImplementedError, IndexError) as err:
            raise ValueError(f"--model {spec}: cannot count it on fake tensors: {str(err).splitlines()[0]}") from None
        params = sum(p.numel() for p in model.parameters())
        parts.append((ops, saved, wide, logits, params, model))
    (ops0, saved0, wide0, logits0, params0, model0), (ops1, saved1, wide1, _, params1, _) = parts
    embed_params = sum(p.numel() for p in model0.get_input_embeddings().parameters())
    embed_ops = {"F": ops0.get("EF", ()), "BW": ops0.get("EBW", ())}
    layer_ops = {p: _inserted(ops0.get(p, ()), ops1.get(p, ()), spec) for p in PHASES}
    heads = int(base.num_attention_heads)
    token_bytes = hidden * torch.finfo(dtype).bits // 8
    return Census(
        model=spec, seq_len=seq_len, layers=layers,
        layer=Part(layer_ops, max(saved1 - saved0, 0), params1 - params0, token_bytes * seq_len,
                   min(max(wide1 - wide0, 0), max(saved1 - saved0, 0))),
        embed=Part(embed_ops, 0, embed_params, token_bytes * seq_len),
        head=Part({p: ops0.get(p, ()) for p in PHASES}, saved0, params0 - embed_params, logits0),
        hidden=hidden, heads=heads, kv_heads=int(getattr(base, "num_key_value_heads", None) or heads),
        dtype_bytes=torch.finfo(dtype).bits // 8,
        tied=_tied(model0),
    )


def _read(spec: str) -> tuple[str, dict[str, object], Path]:
    """``hf:PATH``'s model type, its other config values and the config file's path."""
    path = Path(spec[len(PREFIX):]).expanduser()
    config_file = path / "config.json" if path.is_dir() else path
    try:
        values = json.loads(config_file.read_text(encoding="utf-8"))
        kind = values.pop("model_type")
    except (OSError, ValueError, KeyError, AttributeError) as err:
        raise ValueError(f"--model {spec}: {config_file} is not a transformers config: {err}") from None
    return kind, values, config_file


def hf_config(spec: str) -> object:
    """``hf:PATH``'s transformers config (its sizes under their common names: ``hidden_size``,
    ``num_hidden_layers``, whatever the file calls them). A ``ValueError`` names the file."""
    kind, values, config_file = _read(spec)
    try:
        return _transformers().AutoConfig.for_model(kind, **values)
    except (ValueError, TypeError) as err:
        raise ValueError(f"--model {spec}: {config_file} is not a transformers config: {err}") from None


def _tied(model: nn.Module) -> bool:
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    return head is not None and getattr(head, "weight", None) is getattr(embed, "weight", False)


def _inserted(zero: Ops, one: Ops, spec: str) -> Ops:
    """The operators of ``one`` (the one-layer copy) that ``zero`` (no layer) lacks, as a
    multiset: the one-layer copy runs every operator of the other plus its layer's (the
    backward's order differs, gradients accumulating elsewhere; a phase's time is a sum, so
    order does not matter). A ``ValueError`` when ``zero`` is not contained in ``one``."""
    more, less = Counter(one), Counter(zero)
    if less - more:
        raise ValueError(f"--model {spec}: a copy with one layer does not run the operators of a copy without; "
                         "planning needs a decoder whose layers run one after another")
    return tuple(sorted((more - less).elements()))
