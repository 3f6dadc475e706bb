"""Point-to-point instructions (``piper_runtime.rank.transport``) on a recording communicator, no
Ray and no process group: receives are posted ``Program.execution.recv_lookahead`` ahead,
a receive hands its buffer over as the value, sends keep their tensor until the step ends."""

from __future__ import annotations

import pytest
import torch

from piper_ir import ExecutionOptions, Instruction, NodeKind, Phase, Program, RankPlan
from piper_runtime.rank.state import StepState
from piper_runtime.rank.transport import Transport
from piper_runtime.testing import compute, tensor_meta

M = 4
META = tensor_meta(2, 3)


class _Work:
    def __init__(self, log: list[str], what: str) -> None:
        self.log, self.what = log, what

    def wait(self) -> None:
        self.log.append(f"wait {self.what}")


class _Recorder:
    """A communicator that only records; a receive fills its buffer with the microbatch."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def send(self, tensor: torch.Tensor, peer: int) -> _Work:
        self.log.append(f"send {tensor.flatten()[0].item():g}->{peer}")
        return _Work(self.log, "send")

    def recv(self, tensor: torch.Tensor, peer: int) -> _Work:
        self.log.append(f"recv<-{peer}")
        tensor.fill_(float(len([e for e in self.log if e.startswith("recv")])))
        return _Work(self.log, "recv")


def _recv(mb: int) -> Instruction:
    return Instruction(
        f"recv.v:h.mb{mb}", NodeKind.RECV, stream="pp", microbatch=mb, value="v:h", peer=1,
        communicator="pp.fwd", meta=META,
    )


def _program(lookahead: int) -> Program:
    instructions = [ins for mb in range(M) for ins in (_recv(mb), compute("s1", Phase.F, mb))]
    return Program(
        world_size=2, ranks=(RankPlan(0, instructions), RankPlan(1, ())), communicators=(), segments=(),
        values=(), inputs=(), targets=(), microbatches=M, execution=ExecutionOptions(recv_lookahead=lookahead),
    )


@pytest.mark.parametrize("lookahead", [0, 1, 2, 5])
def test_receives_are_posted_as_far_ahead_as_the_program_says(lookahead: int) -> None:
    program = _program(lookahead)
    comm = _Recorder()
    transport = Transport(program, program.plan(0), {"pp.fwd": comm}, torch.device("cpu"))
    st = StepState({}, keep_grads=False)
    for k, ins in enumerate(program.plan(0).instructions):
        transport.post_recvs(k, st)
        needed = (k + 2) // 2  # the receives at or before position k
        assert st.posted_upto == min(M, max(needed, st.consumed + lookahead))
        if ins.kind is NodeKind.RECV:
            transport.recv(ins, st)
            assert st.values[(ins.value, ins.microbatch)].flatten()[0].item() == ins.microbatch + 1
    assert st.consumed == M and not st.posted


def test_a_send_checks_its_shape_and_is_waited_for_at_the_end() -> None:
    program = _program(2)
    comm = _Recorder()
    transport = Transport(program, program.plan(0), {"pp.fwd": comm}, torch.device("cpu"))
    st = StepState({}, keep_grads=False)
    send = Instruction("send.v:h.mb0", NodeKind.SEND, stream="pp", microbatch=0, value="v:h", peer=1,
                       communicator="pp.fwd", meta=META)
    st.values[("v:h", 0)] = torch.full((2, 3), 7.0)
    transport.send(send, st)
    assert comm.log == ["send 7->1"] and len(st.sends) == 1
    transport.finish(st)
    assert comm.log == ["send 7->1", "wait send"]
    st.values[("v:h", 0)] = torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"v:h has shape \(3, 2\), the plan sends \(2, 3\)"):
        transport.send(send, st)
