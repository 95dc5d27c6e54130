"""The NVMe tier: one preallocated file, read and written with O_DIRECT.

Reads and writes go straight between the file and a pool segment's mapping
(both 4 KiB aligned), with no bounce buffer and no page cache. ``os.preadv``
and ``os.pwritev`` release the GIL, so the daemon runs them on a pool of
threads, a transfer split into chunks (see ``chunks``) to keep several
requests in the device queue.

Where the filesystem refuses O_DIRECT (some tmpfs, network filesystems) the
file is opened buffered instead, with a warning: correct, but it goes through
the page cache.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path

from tierd.backends.extents import ExtentAllocator, align_up
from tierd.errors import CapacityError, TierIOError

log = logging.getLogger(__name__)

DATA_FILE = "tierd-nvme.dat"
LOCK_FILE = "tierd.lock"
CHUNK = 8 << 20


def chunks(offset: int, nbytes: int, chunk: int = CHUNK):
    """(file offset, start in buffer, length) pieces of a transfer."""
    for start in range(0, nbytes, chunk):
        yield offset + start, start, min(chunk, nbytes - start)


class NvmeStore:
    """A preallocated data file under ``directory`` with an extent allocator.

    >>> store = NvmeStore(Path("/tmp/x"), 64 << 20)   # doctest: +SKIP
    >>> off = store.extents.alloc(4096)                 # doctest: +SKIP
    """

    def __init__(self, directory: Path, size: int) -> None:
        self.directory = Path(directory)
        self.size = align_up(size)
        self._lock_fd = self._lock()
        path = self.directory / DATA_FILE
        self.direct = True
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            self.fd = os.open(path, flags | os.O_DIRECT, 0o600)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            log.warning("%s refuses O_DIRECT; using buffered I/O (slower, uses page cache)",
                        self.directory)
            self.direct = False
            self.fd = os.open(path, flags, 0o600)
        try:
            os.posix_fallocate(self.fd, 0, self.size)
        except OSError as exc:
            os.close(self.fd)
            raise CapacityError(f"cannot preallocate {self.size} B of NVMe file {path}: "
                                f"{exc.strerror}; lower --nvme-size or free disk space") from None
        self.extents = ExtentAllocator(self.size)
        self.path = path

    def _lock(self) -> int:
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CapacityError(f"{self.directory} is in use by another tierd daemon; "
                                f"give each daemon its own --nvme directory") from None
        return fd

    def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from the file at ``offset`` (blocking; run in a thread)."""
        done = 0
        while done < len(buf):
            try:
                n = os.preadv(self.fd, [buf[done:]], offset + done)
            except OSError as exc:
                raise TierIOError(f"NVMe read of {len(buf)} B at {offset} in {self.path} "
                                  f"failed: {exc.strerror}") from None
            if n == 0:
                raise TierIOError(f"NVMe read at {offset + done} in {self.path}: "
                                  f"unexpected end of file")
            done += n

    def write_from(self, offset: int, buf: memoryview) -> None:
        """Write ``buf`` to the file at ``offset`` (blocking; run in a thread)."""
        done = 0
        while done < len(buf):
            try:
                n = os.pwritev(self.fd, [buf[done:]], offset + done)
            except OSError as exc:
                raise TierIOError(f"NVMe write of {len(buf)} B at {offset} in {self.path} "
                                  f"failed: {exc.strerror}") from None
            done += n

    def close(self) -> None:
        os.close(self.fd)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._lock_fd)
