"""piper-semantics: the torch-side rules that single-device training (piper-directives) and
the runtime (piper-runtime) must apply identically, written once.

- ``piper_semantics.precision``: the mixed-precision recipe (``cast_forward``, the input and
  output casts, dtype names);
- ``piper_semantics.randomness``: random numbers as a function of (seed, segment,
  microbatch, step, shard) (``seeded``, and ``yielding`` for a forward that waits on another
  thread's).

Piper's equivalence with one device rests on both sides doing exactly this; the runtime may
not import piper-directives, so the rules live here, below both (torch and piper_ir only).
"""

from piper_semantics._version import __version__ as __version__
