"""The NVMe tier: one preallocated file, read and written with O_DIRECT.

Reads and writes go straight between the file and a pool segment's mapping
(both 4 KiB aligned), with no bounce buffer and no page cache. ``os.preadv``
and ``os.pwritev`` release the GIL, so the daemon runs them on a pool of
threads, a transfer split into pieces (see :mod:`tierd.backends.recordio`) to
keep several requests in the device queue.

The file is kept across restarts (never truncated): committed tensors live in
it, and the daemon rebuilds the allocator from the commit manifests. Each
tensor is a checksummed record (see [Note: record format] in
:mod:`tierd.backends.recordio`).

Where the filesystem refuses O_DIRECT (some tmpfs, network filesystems) the
file is opened buffered instead, with a warning: correct, but it goes through
the page cache.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

from tierd.backends import recordio
from tierd.backends.extents import ExtentAllocator, Spans, align_up
from tierd.backends.ownership import Ownership
from tierd.errors import CapacityError, IntegrityError, TierIOError

log = logging.getLogger(__name__)

DATA_FILE = "tierd-nvme.dat"
LOCK_FILE = "tierd.lock"


class Failpoints:
    """Injected I/O errors, for tests of what a failing disk does to commits.

    >>> fp = Failpoints(); fp.arm("sync", errno.EIO)   # the next fsync fails
    >>> store = NvmeStore(Path("/tmp/x"), 1 << 20, failpoints=fp)   # doctest: +SKIP

    Operations: ``write``, ``read``, ``sync`` (data file fsync), ``manifest``
    (writing a commit manifest), ``preallocate`` (the data file at start). ``after`` lets that many calls pass first.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[str, list[int]] = {}

    def arm(self, op: str, err: int, after: int = 0, times: int = 1) -> None:
        with self._lock:
            self._armed[op] = [err, after, times]

    def check(self, op: str) -> None:
        with self._lock:
            armed = self._armed.get(op)
            if armed is None:
                return
            if armed[1] > 0:
                armed[1] -= 1
                return
            armed[2] -= 1
            if armed[2] <= 0:
                del self._armed[op]
        raise OSError(armed[0], os.strerror(armed[0]))


def _keep_private(fd: int, path: Path) -> None:
    """Every job's bytes are in the data file: readable by the daemon's user
    only (0600; [Note: group access] in tierd.server.sockets). A file found
    wider (made by hand, copied) is narrowed."""
    mode = os.fstat(fd).st_mode & 0o777
    if mode & 0o077:
        os.fchmod(fd, 0o600)
        log.warning("NVMe file %s had mode %o, readable by other users; now 0600", path, mode)


class NvmeStore:
    """A preallocated data file under ``directory`` with an extent allocator.

    >>> store = NvmeStore(Path("/tmp/x"), 64 << 20)   # doctest: +SKIP
    >>> off = store.extents.alloc(4096)                 # doctest: +SKIP
    """

    def __init__(self, directory: Path, size: int, failpoints: Failpoints | None = None,
                 owner: Ownership | None = None) -> None:
        self.directory = Path(directory)
        self.size = align_up(size)
        self.failpoints = failpoints or Failpoints()
        # The directory's ownership (given by a daemon that took it first, or
        # taken here), released with the store: [Note: ownership before
        # binding] in tierd.backends.ownership
        self._owner = owner or Ownership.take(
            self.directory / LOCK_FILE, f"--nvme {self.directory}",
            "give each daemon its own --nvme directory")
        path = self.directory / DATA_FILE
        try:
            self.fd, self.direct = self._open(path)
        except OSError as exc:
            self._owner.release()
            raise TierIOError(f"cannot open NVMe file {path}: {exc.strerror}") from None
        try:
            _keep_private(self.fd, path)
        except OSError as exc:
            os.close(self.fd)
            self._owner.release()
            raise TierIOError(f"NVMe file {path} is readable by other users and cannot be made "
                              f"0600 ({exc.strerror}); chmod 600 it as its owner") from None
        self.path = path
        self._preallocate()
        self.extents = ExtentAllocator(self.size)

    def _open(self, path: Path) -> tuple[int, bool]:
        """(fd, direct): O_DIRECT where the filesystem takes it."""
        self._created = not path.exists()
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        log.warning("%s refuses O_DIRECT; using buffered I/O (slower, uses page cache)",
                    self.directory)
        return os.open(path, flags, 0o600), False

    def _preallocate(self) -> None:
        """Reserve every block of the file now, so a full disk fails here and
        not in the middle of training. On failure the file is put back as it
        was (removed if this call created it, else cut back to its old size):
        a partial preallocation must not leave the disk full."""
        old_size = os.fstat(self.fd).st_size
        try:
            self.failpoints.check("preallocate")
            os.posix_fallocate(self.fd, 0, self.size)
        except OSError as exc:
            try:
                if self._created:
                    self.path.unlink(missing_ok=True)
                else:
                    os.ftruncate(self.fd, old_size)
            finally:
                os.close(self.fd)
                self._owner.release()
            raise CapacityError(f"cannot preallocate {self.size} B of NVMe file {self.path}: "
                                f"{exc.strerror}; lower --nvme-size or free disk space") from None

    # ------------------------------------------------------------ raw I/O
    def read_into(self, offset: int, bufs: list) -> None:
        """Fill ``bufs`` in order from the file at ``offset`` (blocking; run in
        a thread). A short file is an IntegrityError: the record was cut off."""
        total = sum(len(b) for b in bufs)
        try:
            self.failpoints.check("read")
            n = os.preadv(self.fd, bufs, offset)
            while n < total:   # rare: finish piecewise
                if n == 0 or (done := self._read_rest(bufs, offset, n)) == n:
                    raise IntegrityError(f"NVMe file {self.path} ends at {offset + n}, inside "
                                         f"a record of {total} B at {offset} (truncated)")
                n = done
        except OSError as exc:
            raise TierIOError(f"NVMe read of {total} B at {offset} in {self.path} "
                              f"failed: {exc.strerror}") from None

    def _read_rest(self, bufs: list, offset: int, done: int) -> int:
        skip = done
        for b in bufs:
            if skip >= len(b):
                skip -= len(b)
                continue
            got = os.preadv(self.fd, [memoryview(b)[skip:]], offset + done)
            return done + got
        return done

    def write_from(self, offset: int, bufs: list) -> None:
        """Write ``bufs`` in order to the file at ``offset`` (blocking; run in a thread)."""
        total = sum(len(b) for b in bufs)
        try:
            self.failpoints.check("write")
            done = os.pwritev(self.fd, bufs, offset)
            while done < total:
                skip = done
                for b in bufs:
                    if skip < len(b):
                        done += os.pwritev(self.fd, [memoryview(b)[skip:]], offset + done)
                        break
                    skip -= len(b)
        except OSError as exc:
            raise TierIOError(f"NVMe write of {total} B at {offset} in {self.path} "
                              f"failed: {exc.strerror}; the previous commit is untouched") from None

    def sync(self) -> None:
        """Make every completed write durable (fdatasync)."""
        try:
            self.failpoints.check("sync")
            os.fdatasync(self.fd)
        except OSError as exc:
            raise TierIOError(f"fsync of NVMe file {self.path} failed: {exc.strerror}; "
                              f"the previous commit is untouched") from None

    # ----------------------------------------------------------- records
    def sum_and_write(self, offset: int, piece) -> int:
        """Checksum one piece of a record's data, then write it; the checksum."""
        value = recordio.checksum(piece)
        self.write_from(offset, [piece])
        return value

    def read_and_sum(self, offset: int, bufs: list) -> int:
        """Read into ``bufs``; the checksum of the last one (the data piece)."""
        self.read_into(offset, bufs)
        return recordio.checksum(bufs[-1])

    def write_record(self, spans: Spans, meta: recordio.RecordMeta, data) -> None:
        """Checksum and write a whole record into ``spans``, the header last
        (one thread; the daemon spreads the pieces over its I/O and checksum
        threads instead)."""
        scatter = recordio.Scatter(spans)
        hlen, header = meta.header_len(), None
        try:
            sums = []
            for s, n in recordio.pieces_of(len(data)):
                sums.append(recordio.checksum(data[s:s + n]))
                for offset, bufs in scatter.runs(hlen + s, [data[s:s + n]]):
                    self.write_from(offset, bufs)
            header = recordio.encode_header(meta, sums)
            for offset, bufs in scatter.runs(0, [header]):
                self.write_from(offset, bufs)
        finally:
            scatter.release()   # before the header's mmap can close
            if header is not None:
                header.close()

    def read_record(self, spans: Spans, meta: recordio.RecordMeta, data) -> None:
        """Read a whole record from ``spans`` into ``data`` and verify it (IntegrityError)."""
        header = recordio.header_buffer(meta)
        scatter = recordio.Scatter(spans)
        try:
            got = []
            for i, (s, n) in enumerate(recordio.pieces_of(len(data))):
                piece = data[s:s + n]
                bufs, pos = ([header, piece], 0) if i == 0 else ([piece], len(header) + s)
                for offset, run in scatter.runs(pos, bufs):
                    self.read_into(offset, run)
                got.append(recordio.checksum(piece))
            algo, sums = recordio.parse_header(header, meta)
            recordio.verify_pieces(meta, algo, sums, got, data)
        finally:
            scatter.release()
            header.close()

    def close(self, remove: bool = True) -> None:
        """Close the file; ``remove`` deletes it (only when nothing is committed)."""
        os.close(self.fd)
        if remove:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        self._owner.release()
