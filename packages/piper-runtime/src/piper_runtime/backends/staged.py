"""Host-staged communication for ranks that share a GPU (NCCL cannot connect them).

A ``StagedCommunicator`` carries device tensors over a host ``Communicator`` (gloo in the
CUDA backend): copy to host memory, run the host operation, copy back. The copy to the host
is synchronous, so it waits for the current stream's work on the tensor (the producer's
kernels); the copy back is queued on the stream of the thread that completes the operation
(the waiter's lane) and kept for it. Slower than NCCL and it blocks the issuing lane's host
thread like the CPU backend does, but it runs every strategy on a single GPU, which is what
it is for (``piper check --backend cuda`` on one GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from piper_runtime.backends.base import Communicator, Work, used_on_this_lane
from piper_runtime.backends.device import Device, DeviceEvent


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` (blocking: the current stream's work on ``t`` is done first)."""
    return t.detach().to("cpu", copy=True)


class _Done:
    def __init__(self, *keep: object) -> None:
        self.keep = keep  # host buffers a started send reads until it is waited for

    def wait(self) -> None:
        pass


class _SentFromHost:
    def __init__(self, work: Work, buffer: torch.Tensor) -> None:
        self.work, self.buffer = work, buffer

    def wait(self) -> None:
        self.work.wait()


class _ReceivedToDevice:
    def __init__(
        self, work: Work, buffer: torch.Tensor, into: torch.Tensor, device: Device | None, posted: DeviceEvent | None
    ) -> None:
        self.work, self.buffer, self.into, self.device, self.posted = work, buffer, into, device, posted

    def wait(self) -> None:
        self.work.wait()
        if self.device is not None:
            # The buffer was allocated on the posting lane's stream, whose earlier work may
            # still use that memory: the copy into it comes after that.
            self.device.current_stream().wait(self.posted)
        self.into.copy_(self.buffer)
        used_on_this_lane(self.into)


class StagedCommunicator:
    """A ``Communicator`` on device tensors over ``host``, a communicator on host tensors
    (``device``: where the tensors live, ``None`` for host tensors)."""

    def __init__(self, host: Communicator, device: Device | None = None) -> None:
        self.host = host
        self.device = device
        self.ranks = tuple(host.ranks)

    def send(self, tensor: torch.Tensor, peer: int) -> Work:
        buffer = _host(tensor)
        return _SentFromHost(self.host.send(buffer, peer), buffer)

    def recv(self, tensor: torch.Tensor, peer: int) -> Work:
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        posted = self.device.current_stream().record() if self.device is not None else None
        return _ReceivedToDevice(self.host.recv(buffer, peer), buffer, tensor, self.device, posted)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        buffer = _host(tensor)
        self.host.all_reduce(buffer)
        tensor.copy_(buffer)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        out = torch.empty(output.shape, dtype=output.dtype, device="cpu")
        self.host.reduce_scatter(out, _host(input))
        output.copy_(out)

    def start_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        self.reduce_scatter(output, input)  # complete when it returns
        return _Done()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        out = torch.empty(output.shape, dtype=output.dtype, device="cpu")
        self.host.all_gather(out, _host(input))
        output.copy_(out)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
    ) -> None:
        out = torch.empty(output.shape, dtype=output.dtype, device="cpu")
        self.host.all_to_all(out, _host(input), output_splits, input_splits)
        output.copy_(out)
