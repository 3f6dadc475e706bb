"""The members of ``NodeKind``, ``EdgeKind`` and ``Phase`` as module constants, for loops
over every node, edge or instruction.

On Python 3.11 reading ``NodeKind.SEND`` runs the enum class's member descriptor: about
0.1 us, five times a module global's 0.02 us. Compile, ``verify`` and the memory estimate
test the kind of each instruction several times each: at 16,384 devices (392k instructions,
657k edges) the enum reads alone took about a second. These are the same objects
(``SEND is NodeKind.SEND``, ``PHASE_F is Phase.F``); code outside such loops keeps writing
``NodeKind.SEND``.
"""

from __future__ import annotations

from piper_ir import EdgeKind, NodeKind, Phase

COMPUTE = NodeKind.COMPUTE
OPTIMIZER = NodeKind.OPTIMIZER
SEND = NodeKind.SEND
RECV = NodeKind.RECV
MARKER = NodeKind.MARKER
GRAD_NORM = NodeKind.GRAD_NORM
TEMPORAL = EdgeKind.TEMPORAL
PHASE_F = Phase.F
PHASE_B = Phase.B
PHASE_BI = Phase.BI
PHASE_BW = Phase.BW
PHASE_OPT = Phase.OPT
