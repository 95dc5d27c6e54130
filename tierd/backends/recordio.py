"""The on-NVMe record of one tensor: a header block, then the data, checksummed.

[Note: record format]
Every tensor written to the NVMe file is one record at
a 4 KiB aligned offset::

    header  (header_len bytes, a multiple of 4 KiB, zero padded)
        prefix  "<8sHBBIII": magic b"TIERDREC", format version, checksum
                algorithm id, flags (0), header_len, meta_len, meta checksum
        meta    msgpack [key, job, dtype, shape, nbytes, version, chunk, sums]
    data    (the pool slot's bytes, 4 KiB aligned length)

``sums`` holds one checksum per ``chunk`` bytes of data, so the pieces of a
large tensor are checksummed in parallel, beside their I/O (see [Note: checksums
beside the I/O, not in its way] in :mod:`tierd.server.transfers`). The header goes out last, after
every data piece: a record torn by a crash or a failed write has no header
that matches the catalog's, and reads as damaged. The algorithm is recorded
in the header: CRC-32C (the ``crc32c`` package, hardware accelerated) when
installed, else zlib's CRC-32; a record is verified with the algorithm it
names, on any machine that has it. Reading checks the magic, the version, every meta field against what
the catalog expects (so a stale or misplaced record is caught, not only a
flipped bit) and every piece's checksum; any mismatch is an IntegrityError
naming the key.

[Note: records in several extents]
A record's bytes (header, then data) may lie in several extents of the file,
its *spans*, in order: the header at the start of the first, the data
running on across the others. So a record is placed whenever the file has
the free bytes admission counted, however fragmented (an 8B model's 39 GiB
file once had 6.8 GB free and no single extent for a 2.1 GB record). The
alternative, packing (best fit, large records at the top) plus moving
records to coalesce free space when nothing fits, is no guarantee without
I/O: the move reads and rewrites gigabytes exactly when the pool is full
(through which pool memory?), in the middle of a spill, and may not move a
record that a reader or a commit's manifest names, so a file fragmented by
committed records stays stuck. Spans cost nothing when one extent fits
(the allocator gives one, best fit, and the record is exactly today's); when
not, one more page-aligned O_DIRECT call per span boundary inside a piece
(the fewest spans: the largest free extents first), and no data moves.
Only records that would otherwise have been refused pay that (figures:
``benchmarks/results/HISTORY.md``, "Figures behind the Notes"), and best fit
keeps the common case (a tensor rewritten at the size it had) in one extent.

The format of a record is unchanged: the spans are not in its header but in
the index that names it, the catalog while the daemon runs and the commit
manifest across a restart (see [Note: manifest format] in
:mod:`tierd.backends.manifest`), written
atomically as before. Checking is as strong as before: the header (written
last, at the start of the first span) must name the expected key, job,
dtype, shape, nbytes and version, and each piece's checksum covers the
data's bytes in record order, so a span that is missing, out of order or
pointing at other bytes fails a checksum like a flipped bit, and a torn
write leaves no matching header. A piece is still checksummed as one
buffer; only its I/O is cut at span boundaries (:class:`Scatter`).
"""

from __future__ import annotations

import bisect
import itertools
import mmap
import struct
import zlib
from dataclasses import dataclass

import msgpack

from tierd.backends.extents import PAGE, Spans, align_up
from tierd.errors import IntegrityError

try:
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - depends on the machine
    _crc32c = None

MAGIC = b"TIERDREC"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<8sHBBIII")
CHUNK = 8 << 20
MAX_DIMS = 16   # as tierd.protocol.MAX_DIMS

ALGO_CRC32C, ALGO_CRC32 = 1, 2
ALGO_NAMES = {ALGO_CRC32C: "crc32c", ALGO_CRC32: "crc32"}
DEFAULT_ALGO = ALGO_CRC32C if _crc32c is not None else ALGO_CRC32


def checksum(data, algo: int = DEFAULT_ALGO) -> int:
    """Checksum of a bytes-like object with the named algorithm (GIL released
    for large buffers by both implementations)."""
    if algo == ALGO_CRC32C:
        if _crc32c is None:
            raise IntegrityError("this record was checksummed with crc32c, which is not "
                                 "installed here; pip install crc32c to read it")
        return _crc32c.crc32c(data)
    if algo == ALGO_CRC32:
        return zlib.crc32(data)
    raise IntegrityError(f"unknown checksum algorithm id {algo}")


@dataclass(frozen=True)
class RecordMeta:
    """What a record says it holds; the catalog knows the same for each extent."""

    key: str
    job: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    version: int

    def header_len(self) -> int:
        """Bytes of header block before the data (a whole number of pages)."""
        pieces = len(pieces_of(align_up(max(self.nbytes, 1))))
        # Fixed fields, a 16-dim shape at most, the names and a uint32 per piece:
        # the length never depends on the shape, so the catalog can size a
        # record from its key, job and byte count alone.
        estimate = (PREFIX.size + 64 + 10 * MAX_DIMS + len(self.key.encode())
                    + len(self.job.encode()) + 5 * pieces)
        return align_up(estimate, PAGE)

    def record_len(self) -> int:
        """Bytes of the whole record on NVMe: header block plus aligned data."""
        return self.header_len() + align_up(max(self.nbytes, 1))


def pieces_of(length: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """(start, length) pieces of a record's data, each checksummed on its own."""
    return [(s, min(chunk, length - s)) for s in range(0, length, chunk)]


def encode_header(meta: RecordMeta, sums: list[int], algo: int = DEFAULT_ALGO) -> mmap.mmap:
    """The header block, in page-aligned memory as O_DIRECT needs."""
    body = msgpack.packb([meta.key, meta.job, meta.dtype, list(meta.shape), meta.nbytes,
                          meta.version, CHUNK, sums])
    length = meta.header_len()
    if PREFIX.size + len(body) > length:
        raise ValueError(f"record header of {meta.key!r} does not fit in {length} B")
    buf = mmap.mmap(-1, length)
    buf[:PREFIX.size] = PREFIX.pack(MAGIC, FORMAT_VERSION, algo, 0, length, len(body),
                                    checksum(body, algo))
    buf[PREFIX.size:PREFIX.size + len(body)] = body
    return buf


def header_buffer(meta: RecordMeta) -> mmap.mmap:
    return mmap.mmap(-1, meta.header_len())


def parse_header(buf, expect: RecordMeta) -> tuple[int, list[int]]:
    """(algorithm, piece checksums) of a header that matches ``expect``;
    IntegrityError naming the key otherwise."""
    key = expect.key

    def bad(why: str) -> IntegrityError:
        return IntegrityError(f"NVMe record of key {key!r} (job {expect.job!r}, version "
                              f"{expect.version}) is damaged: {why}; the tensor cannot be "
                              f"read back: restore it from a commit or an export, or delete it")

    magic, version, algo, _flags, length, meta_len, meta_sum = PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise bad(f"bad magic {bytes(magic)!r} (torn, zeroed or overwritten)")
    if version != FORMAT_VERSION:
        raise bad(f"record format {version}, this daemon reads {FORMAT_VERSION}")
    if length != expect.header_len() or PREFIX.size + meta_len > length:
        raise bad(f"header length {length} / meta length {meta_len} out of range")
    body = bytes(buf[PREFIX.size:PREFIX.size + meta_len])
    if checksum(body, algo) != meta_sum:
        raise bad("header checksum mismatch")
    try:
        k, job, dtype, shape, nbytes, ver, chunk, sums = msgpack.unpackb(body)
    except Exception:  # garbage that passed the checksum: treat as damage
        raise bad("header does not decode") from None
    got = RecordMeta(k, job, dtype, tuple(shape), nbytes, ver)
    if got != expect:
        raise bad(f"header says {got}, expected {expect}")
    if chunk != CHUNK or len(sums) != len(pieces_of(align_up(max(nbytes, 1)))):
        raise bad(f"piece size {chunk} / {len(sums)} checksums do not fit {nbytes} B")
    return algo, sums


def verify_pieces(expect: RecordMeta, algo: int, sums: list[int], got: list[int],
                  data) -> None:
    """Compare the piece checksums computed while reading (with the default
    algorithm) to the header's; recompute with the header's algorithm if it differs."""
    pieces = pieces_of(len(data))
    if algo != DEFAULT_ALGO:
        got = [checksum(data[s:s + n], algo) for s, n in pieces]
    for i, (want, have) in enumerate(zip(sums, got)):
        if want != have:
            s, n = pieces[i]
            raise IntegrityError(
                f"NVMe record of key {expect.key!r} (job {expect.job!r}, version "
                f"{expect.version}) is damaged: checksum mismatch in bytes {s}-{s + n} "
                f"({ALGO_NAMES.get(algo, algo)} {have:#010x}, header says {want:#010x}); "
                f"restore it from a commit or an export, or delete it")


class Scatter:
    """The file I/Os that move a record's bytes, given its spans (see the Note
    on records in several extents): :meth:`runs` cuts consecutive buffers at
    span boundaries; :meth:`release` lets go of every view it cut, so the
    buffers can be closed or unmapped.

    >>> sc = Scatter(((8192, 4096), (0, 8192)))
    >>> [(off, [len(b) for b in bufs]) for off, bufs in sc.runs(0, [bytearray(4096) * 3])]
    [(8192, [4096]), (0, [8192])]
    >>> sc.release()
    """

    def __init__(self, spans: Spans) -> None:
        self.spans = spans
        self._ends = list(itertools.accumulate(length for _, length in spans))
        self._views: list[memoryview] = []

    def runs(self, pos: int, bufs: list) -> list[tuple[int, list[memoryview]]]:
        """(file offset, buffers) for one ``preadv``/``pwritev`` each, moving
        ``bufs`` (consecutive record bytes from record position ``pos``)."""
        end = pos + sum(len(b) for b in bufs)
        if pos < 0 or end > (self._ends[-1] if self._ends else 0):
            raise ValueError(f"record bytes [{pos}, {end}) run past its spans "
                             f"({self._ends[-1] if self._ends else 0} B)")
        out: list[tuple[int, list[memoryview]]] = []
        i = bisect.bisect_right(self._ends, pos)
        j, inside = 0, 0            # the buffer at ``pos`` and how far into it
        at = pos
        while at < end:
            start, length = self.spans[i]
            run_end = min(end, self._ends[i])
            run, offset = [], start + at - (self._ends[i] - length)
            while at < run_end:
                n = min(len(bufs[j]) - inside, run_end - at)
                if n:
                    run.append(self._cut(bufs[j], inside, inside + n))
                at, inside = at + n, inside + n
                if inside == len(bufs[j]):
                    j, inside = j + 1, 0
            out.append((offset, run))
            i += 1
        return out

    def _cut(self, buf, a: int, b: int) -> memoryview:
        whole = memoryview(buf)
        self._views.append(whole)
        view = whole[a:b]
        self._views.append(view)
        return view

    def release(self) -> None:
        """Release the cut views; one a thread still uses (a transfer cancelled
        at shutdown) goes when the thread lets it go."""
        for v in reversed(self._views):
            try:
                v.release()
            except BufferError:
                pass
        self._views.clear()


def spans_len(spans: Spans) -> int:
    return sum(length for _, length in spans)
