"""The copy stream: every pool <-> compute-device copy goes through here.

On CUDA, copies run on one dedicated side stream so they overlap the compute
stream; each copy records an event and the compute stream waits on that event
(never a device-wide synchronize). On CPU the same calls copy synchronously
and carry no event, so the client has one code path for both.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class InflightCopy:
    """A queued copy (or batch of copies) paired with its completion event.

    Holding this value keeps ``src`` and ``dst`` alive, so the caching
    allocator cannot hand their memory to someone else, and the pool lease on
    ``keys`` must not be released, until :meth:`done` says the copy finished.
    """

    dst: torch.Tensor | tuple[torch.Tensor, ...]
    src: torch.Tensor | tuple[torch.Tensor, ...]
    keys: tuple[str, ...]
    event: "torch.cuda.Event | None"

    def done(self) -> bool:
        """True once the bytes have landed (always true on CPU)."""
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
        """Block the host until the copy has landed (used before releasing a lease)."""
        if self.event is not None:
            self.event.synchronize()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CopyStream:
    """Queues copies between pool views and compute-device tensors.

    [Note: two copy streams]
    PCIe moves bytes both ways at once (98 GB/s together vs 55 GB/s one
    way on the H200 host), but one CUDA stream runs its copies in order, so
    a pool->device copy queued behind a device->pool one would wait for it.
    Copies in and copies out therefore get a stream each. A copy in of a key
    waits for the event of the last copy out into that key (``_written``), so
    a value written back by the optimizer is never read half-written.

    [Note: the update stream]
    The fused update of a bucket ([Note: fused update] in tierd.updates.fused)
    needs the bucket's state, copied in while backward runs. On the compute
    stream its kernels waited for that copy, and every backward kernel
    queued after them waited too: with the state streaming (GPT-2 1.3B, B=8,
    capped at 48 GB on the H200) the compute stream sat idle 0.18 s of a
    0.51 s step for copies in. So the update's kernels run on a third
    stream: it waits for the compute stream as it was when the bucket's last
    gradient arrived (so it reads final gradients) and for the bucket's copy
    in; backward goes on meanwhile. The compute stream waits for the update
    stream once, at the end of the updating backward (``join_updates``):
    nothing before reads what an update writes, since a parameter's gradient
    is final (its last read in backward is queued) before its update.
    Tensors the compute stream made that an update reads are recorded on the
    update stream; every entry waits for the compute stream first, so memory
    the update stream allocates is never reused while compute still reads it.

    Example:
        >>> import torch
        >>> cs = CopyStream(torch.device("cpu"))
        >>> dst = torch.empty(3)
        >>> c = cs.copy_in(dst, torch.ones(3), ("k",)); cs.wait(c); dst.tolist()
        [1.0, 1.0, 1.0]
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._in: torch.cuda.Stream | None = None
        self._out: torch.cuda.Stream | None = None
        self._update: torch.cuda.Stream | None = None
        self._written: dict[str, torch.cuda.Event] = {}
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        if device.type == "cuda":
            # The only streams tierd creates, see [Note: two copy streams].
            # Copies on their own streams overlap the kernels of the (user's)
            # current stream; ordering is expressed with per-copy events.
            self._in = torch.cuda.Stream(device=device)
            self._out = torch.cuda.Stream(device=device)
            self._update = torch.cuda.Stream(device=device)   # [Note: the update stream]

    @property
    def on_device(self) -> bool:
        return self._in is not None

    @property
    def streams(self) -> dict[str, torch.cuda.Stream | None]:
        """tierd's own streams by role (None each on the CPU)."""
        return {"copy_in": self._in, "copy_out": self._out, "update": self._update}

    def _after_writes(self, keys: tuple[str, ...]) -> None:
        for key in keys:
            event = self._written.get(key)
            if event is not None:
                if event.query():
                    del self._written[key]
                else:
                    self._in.wait_event(event)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor,
                keys: tuple[str, ...]) -> InflightCopy:
        """Queue ``dst.copy_(src)`` (pool view -> device tensor)."""
        return self.copy_in_many([(dst, src)], keys, after_compute=True)

    def copy_in_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                     keys: tuple[str, ...], *, after_compute: bool = False) -> InflightCopy:
        """Queue ``dst.copy_(src)`` for each (device dst, pool src) pair; one event.

        ``after_compute``: dst was allocated on the compute stream, whose queued
        kernels may still read its memory (a tensor freed earlier): start after
        them. Buffers allocated with :meth:`empty_for_copy_in` need no such wait.
        """
        self.h2d_bytes += sum(_nbytes(s) for _, s in pairs if s.device.type == "cpu")
        dsts = tuple(d for d, _ in pairs)
        srcs = tuple(s for _, s in pairs)
        if self._in is None:
            for d, s in pairs:
                d.copy_(s)
            return InflightCopy(dsts, srcs, keys, None)
        if after_compute:
            self._in.wait_stream(torch.cuda.current_stream(self.device))
        self._after_writes(keys)
        with torch.cuda.stream(self._in):
            for d, s in pairs:
                d.copy_(s, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._in)
        if after_compute:
            # dst's memory is written on our stream: keep it from being reused
            # for another tensor before that write is done.
            for d in dsts:
                d.record_stream(self._in)
        return InflightCopy(dsts, srcs, keys, event)

    def copy_in_new(self, srcs: list[torch.Tensor],
                    keys: tuple[str, ...]) -> tuple[list[torch.Tensor], InflightCopy]:
        """New device tensors filled from ``srcs`` (pool views), one event:
        :meth:`empty_for_copy_in` and :meth:`copy_in_many` in one entry to the
        copy-in stream (each entry costs the host more than a copy's launch,
        and a bucket's update queues several: [Note: small state stays on the
        device] in tierd.updates.fused)."""
        if self._in is None:
            dsts = [torch.empty(s.shape, dtype=s.dtype) for s in srcs]
            return dsts, self.copy_in_many(list(zip(dsts, srcs)), keys)
        self.h2d_bytes += sum(_nbytes(s) for s in srcs)
        self._after_writes(keys)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._in):
            dsts = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in srcs]
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._in)
        for d in dsts:   # (see empty_for_copy_in)
            d.record_stream(compute)
        return dsts, InflightCopy(tuple(dsts), tuple(srcs), keys, event)

    def allocate_for_copy_in(self, tensor: torch.Tensor, nbytes: int) -> None:
        """Give ``tensor``'s (empty) storage ``nbytes`` from the copy-in stream's
        memory, so the copy that fills it waits for no compute kernel; the
        compute stream is recorded as a user for when the storage is freed."""
        if self._in is None:
            tensor.untyped_storage().resize_(nbytes)
            return
        with torch.cuda.stream(self._in):
            tensor.untyped_storage().resize_(nbytes)
        tensor.record_stream(torch.cuda.current_stream(self.device))

    def empty_for_copy_in(self, like: torch.Tensor) -> torch.Tensor:
        """A device buffer shaped like ``like`` (fp32), allocated on the copy-in
        stream so filling it waits for nothing on the compute stream; the
        compute stream is recorded as a user, so its memory is not reused before
        the compute stream is done with it."""
        if self._in is None:
            return torch.empty(like.shape, dtype=like.dtype)
        with torch.cuda.stream(self._in):
            out = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        out.record_stream(torch.cuda.current_stream(self.device))
        return out

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor,
                 keys: tuple[str, ...]) -> InflightCopy:
        """Queue ``dst.copy_(src)`` (device tensor -> pool view) after the
        compute stream has produced ``src``."""
        return self.copy_out_many([(dst, src)], keys)

    def copy_out_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                      keys: tuple[str, ...]) -> InflightCopy:
        """Queue ``dst.copy_(src)`` for each (pool dst, device src) pair once the
        compute stream has produced the sources; one event for all."""
        self.d2h_bytes += sum(_nbytes(s) for _, s in pairs)
        dsts = tuple(d for d, _ in pairs)
        srcs = tuple(s for _, s in pairs)
        if self._out is None:
            for d, s in pairs:
                d.copy_(s)
            return InflightCopy(dsts, srcs, keys, None)
        self._out.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._out):
            for d, s in pairs:
                d.copy_(s, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._out)
        # src was made on the compute stream and is read on ours: keep its
        # memory from being reused until this stream's work is done.
        for s in srcs:
            s.record_stream(self._out)
        for key in keys:
            self._written[key] = event
        return InflightCopy(dsts, srcs, keys, event)

    def out_after_compute(self) -> "torch.cuda.Event":
        """An event after every copy out queued so far and every kernel the
        compute stream has queued (the host waits on it before it releases
        the pool views those read or wrote)."""
        self._out.wait_stream(torch.cuda.current_stream(self.device))
        event = torch.cuda.Event()
        event.record(self._out)
        return event

    def pending_writes(self, keys) -> tuple:
        """The events of copies out into ``keys`` that have not landed yet:
        the host waits on them before it reads those pool views (or copies
        from them: a pageable view is read by the host at once, whatever the
        stream waits for)."""
        if self._out is None:
            return ()
        return tuple(dict.fromkeys(e for e in (self._written.get(k) for k in keys)
                                   if e is not None and not e.query()))

    def wait(self, copy: InflightCopy) -> None:
        """Make the compute stream wait for ``copy`` (no host blocking)."""
        if copy.event is not None:
            torch.cuda.current_stream(self.device).wait_event(copy.event)

    @contextlib.contextmanager
    def updating(self, inputs: Iterable[torch.Tensor]) -> Iterator[None]:
        """Run the block's kernels on the update stream, after everything the
        compute stream has queued so far ([Note: the update stream]).
        ``inputs``: tensors the compute (or copy-in) stream allocated that the
        block reads; their memory is kept until the update stream is done."""
        if self._update is None:
            yield
            return
        self._update.wait_stream(torch.cuda.current_stream(self.device))
        for t in inputs:
            t.record_stream(self._update)
        with torch.cuda.stream(self._update):
            yield

    def record_update(self) -> InflightCopy:
        """The updates queued so far, as a hand-off the compute stream can
        :meth:`wait` for (no event on the CPU, where they ran already)."""
        if self._update is None:
            return InflightCopy((), (), (), None)
        event = torch.cuda.Event()
        event.record(self._update)
        return InflightCopy((), (), (), event)

    def join_updates(self) -> None:
        """The compute stream waits for every update queued (no host blocking)."""
        if self._update is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._update)

    def synchronize(self) -> None:
        """Block the host until every queued copy and update has landed."""
        if self._in is not None:
            self._update.synchronize()
            self._in.synchronize()
            self._out.synchronize()
            self._written.clear()


def register_pool(client, device: torch.device) -> None:
    """Page-lock every pool segment the client maps, now and later, once each.

    Registered (pinned) memory copies at full PCIe speed and lets
    ``non_blocking`` copies be truly asynchronous; unregistered shared memory
    is pageable, and copies from it run at a fraction of that speed (H200
    figures: ``benchmarks/results/HISTORY.md``, "Pinned and pageable copies").
    Does nothing unless ``device`` is CUDA.
    """
    if device.type != "cuda":
        return
    cudart = torch.cuda.cudart()
    # segments may be mapped on a helper thread ([Note: pipelined puts] in
    # tierd.client.connection), whose current device is not the caller's:
    # register them for this one (no context made on another GPU)
    index = device.index if device.index is not None else torch.cuda.current_device()

    def register(segment_id: int, view: torch.Tensor) -> None:
        # Several attaches (and activation tiering) may share one client and
        # so one mapping: register it once. A repeated cudaHostRegister fails
        # with cudaErrorHostMemoryAlreadyRegistered, and the runtime keeps that
        # as its last error, which the next kernel launch then raises.
        span = (view.data_ptr(), view.numel())
        if span in _REGISTERED:
            return
        with torch.cuda.device(index):
            err = cudart.cudaHostRegister(view.data_ptr(), view.numel(), 0)
        if int(err) != 0:
            # out of page-lockable memory: the segment still works, pageable
            # (about 7x slower copies); clear the error so no kernel reports it
            clear = getattr(cudart, "cudaGetLastError", None)
            if clear is not None:
                clear()
            warnings.warn(f"cudaHostRegister of pool segment {segment_id} ({view.numel()} B) "
                          f"failed with CUDA error {int(err)}; its copies run pageable. "
                          "The host may be short of memory: give the daemon a smaller pool",
                          RuntimeWarning, stacklevel=2)
            return
        _REGISTERED.add(span)

    def unregister(segment_id: int, view: torch.Tensor) -> None:
        # before the mapping goes: a later mapping at the same address must
        # not inherit this registration (its pages would be the old ones)
        span = (view.data_ptr(), view.numel())
        if span in _REGISTERED:
            _REGISTERED.discard(span)
            # no copy may still be reading it (a client collected unclosed
            # was not settled first)
            torch.cuda.synchronize(device)
            cudart.cudaHostUnregister(view.data_ptr())

    client.on_segment_mapped(register, unregister)


#: (address, bytes) of the pool mappings this process has page-locked.
_REGISTERED: set[tuple[int, int]] = set()
