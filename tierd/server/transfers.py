"""NVMe records moved on the daemon's I/O threads (see the Note on record format).

A record's pieces are checksummed and moved in parallel; the asyncio side only
gathers them. Nothing here touches the catalog.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from tierd.backends import recordio
from tierd.backends.nvme import NvmeStore


class RecordTransfers:
    """Writes and reads whole records between pool memory and the NVMe file."""

    def __init__(self, nvme: NvmeStore, executor: ThreadPoolExecutor) -> None:
        self.nvme = nvme
        self.executor = executor

    async def _pieces(self, calls) -> list:
        """Run blocking calls on the I/O threads; all finish before any error
        is raised, so no thread still uses a buffer the caller releases."""
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(
            *(loop.run_in_executor(self.executor, fn, *args) for fn, *args in calls),
            return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def write(self, offset: int, meta: recordio.RecordMeta, data) -> None:
        """Checksum every piece and write all but the first in the I/O threads;
        then the first piece and the header (which holds the sums) in one pwritev."""
        pieces = recordio.pieces_of(len(data))
        base = offset + meta.header_len()
        sums = await self._pieces(
            (recordio.checksum, data[s:s + n]) if i == 0 else
            (self.nvme.sum_and_write, base + s, data[s:s + n])
            for i, (s, n) in enumerate(pieces))
        header = recordio.encode_header(meta, sums)
        try:
            n = pieces[0][1]
            await self._pieces([(self.nvme.write_from, offset, [header, data[:n]])])
        finally:
            header.close()

    async def read(self, offset: int, meta: recordio.RecordMeta, data) -> None:
        """Read the header and every piece in the I/O threads, checksumming
        each as it lands, then check them against the header."""
        header = recordio.header_buffer(meta)
        try:
            base = offset + len(header)
            got = await self._pieces(
                (self.nvme.read_and_sum, offset, [header, data[s:s + n]]) if i == 0 else
                (self.nvme.read_and_sum, base + s, [data[s:s + n]])
                for i, (s, n) in enumerate(recordio.pieces_of(len(data))))
            algo, sums = recordio.parse_header(header, meta)
            recordio.verify_pieces(meta, algo, sums, got, data)
        finally:
            header.close()
