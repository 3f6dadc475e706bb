"""Hugging Face causal language models, unedited: ``--model hf:PATH`` (the ``piper-train[hf]`` extra).

``PATH`` is a ``config.json`` or a model directory holding one (as ``save_pretrained``
writes it), with or without weights. The model is built from the config by
``AutoModelForCausalLM`` with nothing fetched from the hub and no code from the directory run
(``trust_remote_code`` stays off); weights, when the directory has them, are read from its
safetensors files only (``use_safetensors``): data, never a pickle. Without weights the
model starts from its own initialisation under the run's seed.

The model keeps its class and parameter names (``model.layers.0.self_attn.q_proj.weight``):
only its ``forward`` is narrowed to ``forward(input_ids) -> logits`` (``use_cache`` off), by
a subclass made once per model class, so capture sees tensors in and a tensor out; on text
packed by ``--data`` (piper_train.text), to ``forward(input_ids, position_ids) -> logits``,
transformers masking attention per document where the position ids restart. fx cannot
trace these models; capture takes them through ``torch.export``. Their regions are the
entries of their layer list (``model.layers.*``, ``transformer.h.*``) unless ``--regions``
names others.

The loss is the causal-LM loss: cross-entropy of each position's logits against the next
token (inputs and targets are one token sequence shifted by one), averaged over the tokens.
Batches are random token sequences drawn per step from the seed (held-out ones from seeds no
step uses): enough to check a strategy against single-device training and to measure speed;
``--data`` trains on text instead (``piper_train.workload.load_text``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from piper_train.models import ModelSpec

PREFIX = "hf:"
SEQ_LEN = 32  # tokens per sample of the generated batches
BATCH = 8  # samples per generated batch
_LOGITS_CLASSES: dict[type, type] = {}
_PACKED_CLASSES: dict[type, type] = {}  # forward(input_ids, position_ids)


def is_hf(spec: str) -> bool:
    return spec.startswith(PREFIX)


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of every position's logits against its next token (targets equal to
    -100 are ignored, as in transformers). Logits are computed on in float32 at least (float64
    ones, as under ``piper check --precision fp64``, stay float64)."""
    wide = logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(wide, targets.reshape(-1), ignore_index=-100)


def _logits_forward(self: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return super(type(self), self).forward(input_ids=input_ids, use_cache=False).logits


def _packed_logits_forward(self: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    return super(type(self), self).forward(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


def logits_only(model: nn.Module, *, packed: bool = False) -> nn.Module:
    """``model`` with ``forward(input_ids) -> logits`` (module doc), or with ``packed``
    ``forward(input_ids, position_ids) -> logits`` (text packed by ``piper_train.text``, whose
    position ids restart at each document: transformers then masks attention block-diagonally);
    the same object, its parameters untouched."""
    classes = _PACKED_CLASSES if packed else _LOGITS_CLASSES
    base = type(model)
    if base in classes.values():
        return model
    if base not in classes:
        forward = _packed_logits_forward if packed else _logits_forward
        classes[base] = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})
    model.__class__ = classes[base]
    return model


def float64_ready(model: nn.Module) -> nn.Module:
    """``model`` able to run in float64: transformers' grouped-matmul experts take only 16- and
    32-bit floats, so a mixture-of-experts model switches to its batched-matmul experts (the
    same function, computed per token). Other models are returned as they are."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) == "grouped_mm" and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("batched_mm")
    return model


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError("--model hf:PATH needs the transformers package: pip install 'piper-train[hf]'") from None
    transformers.logging.set_verbosity_error()  # config warnings about token ids of tiny test vocabularies
    return transformers


def _config_and_weights(path: Path) -> tuple[Path, Path | None]:
    """The config file and the folder of weights (None without any) of ``path``."""
    if path.is_file():
        return path, None
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"--model hf:{path}: no config.json there (expected a config file or a model directory)")
    weights = any(path.glob("*.safetensors"))
    if not weights and (any(path.glob("*.bin")) or any(path.glob("*.pt"))):
        raise ValueError(f"--model hf:{path}: its weights are pickles (*.bin/*.pt), which Piper does not load; "
                         "convert them to safetensors (save_pretrained(..., safe_serialization=True))")
    return config, path if weights else None


def load_hf(spec: str, *, seed: int = 0, batch_size: int | None = None) -> ModelSpec:
    """The ``ModelSpec`` of ``hf:PATH`` (module doc); ``batch_size`` overrides ``BATCH``."""
    model, config = build_hf(spec, seed=seed)
    model = logits_only(model).train()
    vocab = int(config.vocab_size)
    size = batch_size or BATCH
    seq_len = min(SEQ_LEN, int(getattr(config, "max_position_embeddings", SEQ_LEN) or SEQ_LEN))

    def batches(step: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        generator = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63 - 1))
        tokens = torch.randint(0, vocab, (size, seq_len + 1), generator=generator)
        return (tokens[:, :-1],), (tokens[:, 1:],)

    inputs, targets = batches(0)
    return ModelSpec(spec, model, inputs, targets, causal_lm_loss, batches, layer_count(model), seed,
                     lambda k: batches(-2 - k))


def layer_count(model: nn.Module) -> int:
    """Entries of the model's largest ``ModuleList`` (its layers; the default regions)."""
    return max((len(m) for m in model.modules() if isinstance(m, nn.ModuleList)), default=1)


def build_hf(spec: str, *, seed: int = 0) -> tuple[nn.Module, Any]:
    """The model of ``hf:PATH`` as transformers builds it (module doc), and its config."""
    path = Path(spec[len(PREFIX):]).expanduser()
    if not path.exists():
        raise ValueError(f"--model {spec}: {path} does not exist")
    transformers = _transformers()
    config_file, weights = _config_and_weights(path)
    try:
        values = json.loads(config_file.read_text(encoding="utf-8"))
        kind = values.pop("model_type")
        config = transformers.AutoConfig.for_model(kind, **values)
    except (OSError, ValueError, KeyError) as err:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"--model {spec}: {config_file} is not a transformers config: {err}") from None
    config.use_cache = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            if weights is not None:
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    weights, config=config, local_files_only=True, use_safetensors=True, trust_remote_code=False,
                    dtype=torch.float32,
                )
            else:
                model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False,
                                                                      dtype=torch.float32)
        except ValueError as err:  # a model type transformers has no causal LM for, among others
            raise ValueError(f"--model {spec}: {err}") from None
    return model, config


def save_pretrained(spec: str, state: dict[str, torch.Tensor], out: Path) -> int:
    """Write ``state`` (a trained model's state_dict, as ``piper export`` reads it) as the
    Hugging Face folder ``out`` of model ``hf:PATH``: its config and safetensors weights, which
    ``AutoModelForCausalLM.from_pretrained(out)`` loads. Written to a temporary sibling and
    renamed, so a failure leaves no half folder. Returns the number of tensors loaded."""
    model = load_hf(spec).model
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"the checkpoint does not hold the weights of {spec}: {str(err).splitlines()[0]}") from None
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return len(state)
