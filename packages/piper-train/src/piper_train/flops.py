"""Model FLOPs of a training step, and the throughput figures made of them (MFU).

``step_flops`` counts the floating-point operations of one forward and backward of the model
and its loss on a batch with torch's own formulas (``torch.utils.flop_counter``: matrix
products, convolutions and attention, the operations that dominate a step), on a copy of
the model on the meta device, so nothing is computed or allocated; a model that needs real
values (``.item()`` in its forward, as transformers' mask code does) is counted on a real
copy instead, at the cost of one step on one device. These are *model* FLOPs: recomputation,
communication and the optimizer are not in them, so MFU compares strategies fairly.

A step's FLOPs scale with its tokens (token-id inputs) or samples: ``Throughput.step`` scales
the example batch's count to the step's batch, exact for batches of the example's shape and
a close estimate for other lengths (attention's part grows with the square of the length).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import attrs
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from piper_train.hardware import Hardware


def step_flops(
    model: nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    loss_fn: Callable[..., torch.Tensor],
    *,
    real: bool = True,
) -> int | None:
    """FLOPs of forward, loss and backward of ``model`` on one batch (module doc); with
    ``real=False``, None for a model the meta device cannot run (rather than a real step)."""
    try:
        return _counted(model, inputs, targets, loss_fn, torch.device("meta"))
    except (RuntimeError, NotImplementedError):  # an operation that needs real values
        return _counted(model, inputs, targets, loss_fn, None) if real else None


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device, made without
    copying their data (a big model is not held twice)."""
    memo: dict[int, object] = {}
    for t in (*model.parameters(), *model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


class _Counting(TorchDispatchMode):
    """Sums the FLOPs of every operator torch's counter has a formula for
    (``torch.utils.flop_counter.flop_registry``). Not ``FlopCounterMode`` itself: its module
    tracker installs hooks on every module of the process, and the count runs on a thread
    beside the local runtime's ranks, whose backward those hooks would break."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.total += int(op_flops(func, args, kwargs, out) or 0)
        return out


def op_flops(func, args, kwargs, out) -> float | None:
    """FLOPs of one aten operator call by torch's formulas (``flop_registry``), None for an
    operator it has none for. The CPU's fused attention (``..._flash_attention_for_cpu`` and
    its backward, which torch's registry lacks) is counted with torch's attention formulas,
    as its CUDA kernels are."""
    from torch.utils import flop_counter

    packet = getattr(func, "_overloadpacket", None)
    formula = flop_counter.flop_registry.get(packet)
    if formula is not None:
        return float(formula(*args, **kwargs, out_val=out))
    name = str(packet)
    if name.endswith("_scaled_dot_product_flash_attention_for_cpu"):
        q, k, v = args[:3]
        return float(flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape))
    if name.endswith("_scaled_dot_product_flash_attention_for_cpu_backward"):
        grad, q, k, v = args[:4]
        return float(flop_counter.sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape))
    return None


def _counted(model, inputs, targets, loss_fn, device: torch.device | None) -> int:
    twin = _meta_copy(model) if device is not None else copy.deepcopy(model)
    if device is not None:
        inputs, targets = [t.to(device) for t in inputs], [t.to(device) for t in targets]
    # In eval mode: dropout draws nothing (and costs no FLOPs), so the count leaves torch's
    # global generator alone; it runs beside the local runtime's ranks, which draw from it.
    twin.eval()
    with _Counting() as counter:
        outputs = twin(*inputs)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        loss_fn(*outputs, *targets).backward()
    return counter.total


@attrs.frozen
class Throughput:
    """What turns a step's time into TFLOP/s per device and MFU: the example batch's FLOPs
    and size (tokens when the inputs are token ids, else samples), the devices the program
    runs on, and the peak TFLOP/s of one device in the dtype the step computes in (None
    without a hardware file, or a file that lacks that dtype)."""

    example_flops: int
    example_size: int
    devices: int
    peak_tflops: float | None = None

    @classmethod
    def of(cls, example_flops: int, example_size: int, devices: int, hardware: Hardware | None,
           dtype: str) -> Throughput:
        return cls(example_flops, example_size, devices, hardware.peak(dtype) if hardware else None)

    def step(self, size: int, seconds: float) -> tuple[float, float | None]:
        """TFLOP/s per device and MFU (None without a peak) of a step over ``size`` tokens or
        samples that took ``seconds``."""
        flops = self.example_flops * size / self.example_size
        tflops = flops / seconds / self.devices / 1e12 if seconds > 0 else 0.0
        return tflops, (tflops / self.peak_tflops if self.peak_tflops else None)
