"""The copy stream: every pool <-> compute-device copy goes through here.

On CUDA, copies run on one dedicated side stream so they overlap the compute
stream; each copy records an event and the compute stream waits on that event
(never a device-wide synchronize). On CPU the same calls copy synchronously
and carry no event, so the client has one code path for both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class InflightCopy:
    """A queued copy paired with its completion event.

    Holding this value keeps ``src`` and ``dst`` alive, so the caching
    allocator cannot hand their memory to someone else, and the pool lease on
    ``keys`` must not be released, until :meth:`done` says the copy finished.
    """

    dst: torch.Tensor
    src: torch.Tensor
    keys: tuple[str, ...]
    event: "torch.cuda.Event | None"

    def done(self) -> bool:
        """True once the bytes have landed (always true on CPU)."""
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
        """Block the host until the copy has landed (used before releasing a lease)."""
        if self.event is not None:
            self.event.synchronize()


class CopyStream:
    """Queues copies between pool views and compute-device tensors.

    Example:
        >>> import torch
        >>> cs = CopyStream(torch.device("cpu"))
        >>> dst = torch.empty(3)
        >>> c = cs.copy_in(dst, torch.ones(3), ("k",)); cs.wait(c); dst.tolist()
        [1.0, 1.0, 1.0]
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            # The only stream tierd creates. Copies on their own stream overlap
            # the kernels of the (user's) current stream; ordering between the
            # two is expressed with events recorded per copy (see `wait`).
            self._stream = torch.cuda.Stream(device=device)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor,
                keys: tuple[str, ...]) -> InflightCopy:
        """Queue ``dst.copy_(src)`` (pool view -> device tensor)."""
        if self._stream is None:
            dst.copy_(src)
            return InflightCopy(dst, src, keys, None)
        compute = torch.cuda.current_stream(self.device)
        # dst was allocated on the compute stream: its memory may still be read
        # by kernels queued there for a tensor freed earlier. Start after them.
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        # dst's memory is written on our stream: keep it from being reused
        # for another tensor before that write is done.
        dst.record_stream(self._stream)
        return InflightCopy(dst, src, keys, event)

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor,
                 keys: tuple[str, ...]) -> InflightCopy:
        """Queue ``dst.copy_(src)`` (device tensor -> pool view) after the
        compute stream has produced ``src``."""
        if self._stream is None:
            dst.copy_(src)
            return InflightCopy(dst, src, keys, None)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        # src was made on the compute stream and is read on ours: keep its
        # memory from being reused until this stream's work is done.
        src.record_stream(self._stream)
        return InflightCopy(dst, src, keys, event)

    def wait(self, copy: InflightCopy) -> None:
        """Make the compute stream wait for ``copy`` (no host blocking)."""
        if copy.event is not None:
            torch.cuda.current_stream(self.device).wait_event(copy.event)


def register_pool(client, device: torch.device) -> None:
    """Page-lock every pool segment the client maps, now and later, once each.

    Registered (pinned) memory copies at full PCIe speed and lets
    ``non_blocking`` copies be truly asynchronous; unregistered shared memory
    is pageable (7 GB/s instead of 55 GB/s on the H200 host, see DESIGN.md).
    Does nothing unless ``device`` is CUDA.
    """
    if device.type != "cuda":
        return
    cudart = torch.cuda.cudart()

    def register(segment_id: int, view: torch.Tensor) -> None:
        err = cudart.cudaHostRegister(view.data_ptr(), view.numel(), 0)
        # 712 = cudaErrorHostMemoryAlreadyRegistered: another attach in this
        # process shares the client and registered it first; that is fine.
        if int(err) not in (0, 712):
            raise RuntimeError(
                f"cudaHostRegister of pool segment {segment_id} "
                f"({view.numel()} B) failed with CUDA error {int(err)}")

    client.on_segment_mapped(register)
