"""NVMe records moved on the daemon's I/O threads (see [Note: record format] in
:mod:`tierd.backends.recordio`).

[Note: checksums beside the I/O, not in its way]
A record's pieces go to
two thread pools: the I/O threads only move bytes (``pwritev``/``preadv``),
the checksum threads only compute piece sums. A write sends every data piece
to the disk at once while the sums are computed beside it, and writes the
header (which holds the sums) last; a read checksums each piece as soon as
it has landed, while the I/O thread already reads the next. So the disk
always has every I/O thread's request in flight, and a record costs the
longer of its I/O and its checksums instead of their sum.

Measured with ``python -m tierd.bench.nvme`` on the 2-core development VM
shared with other work (load 10-14): with each piece summed in its I/O
thread right before its write, spills reached 55-89 % of the raw write from
the same pool pages, 82-102 % with the sum a no-op and 84-90 % with a sleep
as long as an unloaded sum (0.6 ms per 8 MiB) in its place. So it was not
the sum's nominal time but its reading of 8 MiB of pool memory on a shared
CPU, stretched to several ms under load (p90 6 ms), while the thread's slot
in the disk queue stood empty. With the sums on their own threads, back to
back against the old daemon: spill 75-88 % vs 66-75 % under that load,
91-98 % vs 90-96 % under a lighter one; fetches 95-105 % either way. What is
left is the sums' memory traffic itself, which no arrangement removes.

[Note: reads beside writes]
A spilling job's step reads the next units' state while the last units'
state is written back, and both go through one pool of I/O threads, which
takes calls in the order they were queued. A record is many pieces, so an
eviction that writes a few GB queued every piece of it at once, and a read
asked for a moment later waited behind all of them: reads and writes took
turns, each at its own bandwidth, instead of sharing the disk at its mixed
one. So each direction has a gate: at most ``io_threads - 1`` of its calls
are queued or running at a time, the rest wait in asyncio. Alone, a
direction still keeps all but one thread busy; with both at work the
threads interleave their calls, and a read never waits for more than the
calls already running.

[Note: the disk's busy time]
Bytes read a step say how much crossed the disk, not whether the disk was
the step's limit: a step slower than its reads at the disk's rate either
left the disk idle (reads asked for too late) or read slower than the probe
did. Each direction keeps a :class:`BusyClock`, the seconds during which at
least one of its records was in flight (the union of their spans, on the
loop's clock), in the daemon's stats as ``nvme_read_busy_s`` and
``nvme_write_busy_s``: bytes over busy seconds is the rate the disk gave,
step time less busy seconds is how long it idled.

The asyncio side only gathers the pieces. Nothing here touches the catalog.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tierd.backends import recordio
from tierd.backends.extents import Spans
from tierd.backends.nvme import NvmeStore


def checksum_threads(io_threads: int) -> int:
    """Threads for piece sums: one per two cores, at least one, at most as
    many as I/O threads (crc32c runs at ~14 GB/s a thread, so two keep up
    with a fast NVMe; more would only take cores from the clients)."""
    return max(1, min(io_threads, (os.cpu_count() or 2) // 2))


class BusyClock:
    """Seconds during which at least one call was in flight ([Note: the disk's
    busy time]); used on one event loop, so no lock.

    >>> clock = BusyClock()
    >>> with clock, clock:
    ...     pass
    >>> clock.seconds() >= 0
    True
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._in_flight = 0
        self._since = 0.0
        self._total = 0.0

    def __enter__(self) -> "BusyClock":
        if self._in_flight == 0:
            self._since = self._clock()
        self._in_flight += 1
        return self

    def __exit__(self, *exc) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._total += self._clock() - self._since

    def seconds(self) -> float:
        """Busy seconds so far, a span still open counted to now."""
        open_ = self._clock() - self._since if self._in_flight else 0.0
        return self._total + open_


class RecordTransfers:
    """Writes and reads whole records between pool memory and the NVMe file.

    >>> rt = RecordTransfers(store, io_pool, sum_pool)          # doctest: +SKIP
    >>> await rt.write(offset, meta, view)                      # doctest: +SKIP
    """

    def __init__(self, nvme: NvmeStore, executor: ThreadPoolExecutor,
                 checksums: ThreadPoolExecutor) -> None:
        self.nvme = nvme
        self.executor = executor
        self.checksums = checksums
        # [Note: reads beside writes]; the executor's size is its thread count
        self._depth = max(1, executor._max_workers - 1)
        self._gates: tuple[asyncio.AbstractEventLoop, dict[bool, asyncio.Semaphore]] | None = None
        self.busy = {False: BusyClock(), True: BusyClock()}   # by write; [Note: the disk's busy time]

    def busy_seconds(self) -> dict[str, float]:
        """The disk's busy seconds each way, for the daemon's stats."""
        return {"nvme_read_busy_s": round(self.busy[False].seconds(), 3),
                "nvme_write_busy_s": round(self.busy[True].seconds(), 3)}

    async def _all(self, aws) -> list:
        """Await every one; all finish before any error is raised, so no
        thread still uses a buffer the caller releases."""
        results = await asyncio.gather(*aws, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def _io(self, write: bool, fn, *args):
        """``fn(*args)`` on an I/O thread once its direction's gate lets it
        ([Note: reads beside writes]; gates belong to the running loop)."""
        loop = asyncio.get_running_loop()
        if self._gates is None or self._gates[0] is not loop:
            self._gates = (loop, {w: asyncio.Semaphore(self._depth) for w in (False, True)})
        async with self._gates[1][write]:
            return await loop.run_in_executor(self.executor, fn, *args)

    def _sum(self, data) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self.checksums, recordio.checksum, data)

    async def write(self, spans: Spans, meta: recordio.RecordMeta, data) -> None:
        """Write every data piece into ``spans`` and checksum it beside the
        write, then the header with the sums: a record torn before its header
        is written has no valid header, so it is never read as whole."""
        pieces = recordio.pieces_of(len(data))
        hlen = meta.header_len()
        views = [data[s:s + n] for s, n in pieces]
        scatter = recordio.Scatter(spans)
        header = None
        try:
            with self.busy[True]:
                writes = [self._io(True, self.nvme.write_from, offset, bufs)
                          for (s, _), v in zip(pieces, views)
                          for offset, bufs in scatter.runs(hlen + s, [v])]
                sums = await self._all([*writes, *(self._sum(v) for v in views)])
                header = recordio.encode_header(meta, sums[len(writes):])
                await self._all([self._io(True, self.nvme.write_from, offset, bufs)
                                 for offset, bufs in scatter.runs(0, [header])])
        finally:
            scatter.release()
            _release(views)
            if header is not None:
                header.close()

    async def _read_piece(self, runs: list, piece) -> int:
        """Read one piece (on I/O threads, one call per run of its spans),
        then sum it on a checksum thread, so the I/O threads move on."""
        await self._all([self._io(False, self.nvme.read_into, offset, bufs)
                         for offset, bufs in runs])
        return await self._sum(piece)

    async def read(self, spans: Spans, meta: recordio.RecordMeta, data) -> None:
        """Read the header and every piece from ``spans``, checksumming each
        as it lands, then check them against the header (IntegrityError
        naming the key)."""
        header = recordio.header_buffer(meta)
        pieces = recordio.pieces_of(len(data))
        views = [data[s:s + n] for s, n in pieces]
        scatter = recordio.Scatter(spans)
        try:
            hlen = len(header)
            with self.busy[False]:
                got = await self._all(
                    self._read_piece(scatter.runs(0, [header, v]) if i == 0 else
                                     scatter.runs(hlen + s, [v]), v)
                    for i, ((s, _), v) in enumerate(zip(pieces, views)))
            algo, sums = recordio.parse_header(header, meta)
            recordio.verify_pieces(meta, algo, sums, got, data)
        finally:
            scatter.release()
            _release(views)
            header.close()


def _release(views: list[memoryview]) -> None:
    """Let go of piece views now: asyncio's futures may keep them in reference
    cycles until the next garbage collection, and a pool segment cannot be
    unmapped while a view of it lives. A transfer cancelled at shutdown may
    leave a thread still inside a call on a view: that one goes when the
    thread lets it go, and the cancellation is what the caller sees."""
    for v in views:
        try:
            v.release()
        except BufferError:
            pass
