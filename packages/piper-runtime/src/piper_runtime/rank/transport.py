"""``SEND`` / ``RECV``: point-to-point transfers on the plan's communicators.

Sends are asynchronous: a send starts at its instruction and is waited for at the end of
the step (the tensor is kept alive until then). Receives are posted ahead: before each
instruction, the receives of the next ``ExecutionOptions.recv_lookahead`` ``RECV``
instructions (``Program.execution``) are posted into buffers of the instruction's ``meta``,
so data is already moving when the compute that needs it comes up; a ``RECV`` instruction
then only waits for its buffer. Receives from one peer on one communicator are posted in
plan order, which the verifier proved is the order the peer sends in. The memory estimate
reads the same option, so it counts the buffers this posts.
"""

from __future__ import annotations

import torch

from piper_ir import Instruction, NodeKind, Program, RankPlan, is_grad
from piper_runtime.rank.comms import Communicators
from piper_runtime.rank.state import StepState


class Transport:
    """The point-to-point instructions of one rank (module doc)."""

    def __init__(self, program: Program, plan: RankPlan, comms: Communicators, device: torch.device) -> None:
        self.instructions = plan.instructions
        self.comms = comms
        self.device = device
        self.lookahead = program.execution.recv_lookahead
        self.recv_positions = [k for k, ins in enumerate(plan.instructions) if ins.kind is NodeKind.RECV]

    def send(self, ins: Instruction, st: StepState) -> None:
        t = st.get(ins.value, ins.microbatch).detach().contiguous()
        if ins.meta is not None and tuple(t.shape) != st.shape(ins):
            raise ValueError(f"{ins.value} has shape {tuple(t.shape)}, the plan sends {st.shape(ins)}")
        work = self.comms[ins.communicator].send(t, ins.peer)
        st.sends.append((work, t))

    def post_recvs(self, position: int, st: StepState) -> None:
        """Post every receive up to instruction ``position``, and the next ``lookahead``."""
        recvs = self.recv_positions
        upto = st.posted_upto
        if upto >= len(recvs) or (upto >= st.consumed + self.lookahead and recvs[upto] > position):
            return  # nothing to post (counts only grow: a stale look posts at a later call)
        with st.lock:
            while st.posted_upto < len(recvs) and (
                st.posted_upto < st.consumed + self.lookahead or recvs[st.posted_upto] <= position
            ):
                ins = self.instructions[recvs[st.posted_upto]]
                meta = ins.meta
                t = torch.empty(st.shape(ins), dtype=getattr(torch, meta.dtype), device=self.device)
                st.posted[ins.id] = (self.comms[ins.communicator].recv(t, ins.peer), t)
                st.posted_upto += 1

    def recv(self, ins: Instruction, st: StepState) -> None:
        work, t = st.posted.pop(ins.id)
        work.wait()
        key = (ins.value, ins.microbatch)
        with st.lock:
            st.consumed += 1
            if is_grad(ins.value):
                st.add_grad(ins.value, ins.microbatch, t)
                if st.values[key] is t:
                    st.received.add(key)
            else:
                st.values[key] = t
                st.received.add(key)

    def finish(self, st: StepState) -> None:
        """Wait for the step's sends."""
        for work, _tensor in st.sends:
            work.wait()
