"""``Program.precision``: stage segments compute in a low dtype on fp32 master weights.

The recipe is ``piper_semantics.precision`` (single-device training runs the same one); the
names the runtime uses are re-exported here. A stage segment's forward runs its module on
cast copies of its parameters and buffers (``cast_forward``); floating batch inputs are cast
once, on the driver, where the batch is read (``compute_inputs``); values between segments
already are in the compute dtype (capture recorded them so), and the loss module casts the
model's outputs up itself (``piper_directives.capturing.LossModule``).
"""

from __future__ import annotations

from piper_semantics.precision import cast_forward, compute_inputs
from piper_semantics.precision import torch_dtype as dtype_of

__all__ = ["cast_forward", "compute_inputs", "dtype_of"]
