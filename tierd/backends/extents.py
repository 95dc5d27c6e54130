"""Extent allocator over a range of bytes, with coalescing on free.

Used for pool segments and NVMe files alike. Every extent is aligned to
``align`` bytes (4 KiB by default), which is what O_DIRECT needs for both the
file offset and the memory address, so data moves between a pool slot and an
NVMe extent with no bounce buffer.

A pool slot must be one extent (clients map it as one tensor): :meth:`alloc`,
first fit. An NVMe record may lie in several (see [Note: records in
several extents] in :mod:`tierd.backends.recordio`): :meth:`alloc_spans`
places one whenever the free bytes suffice, whatever the fragmentation.
"""

from __future__ import annotations

import bisect

PAGE = 4096

#: Where a record lies: (start, length) extents, in the order of its bytes.
Spans = tuple[tuple[int, int], ...]


def align_up(n: int, align: int = PAGE) -> int:
    return (n + align - 1) // align * align


class ExtentAllocator:
    """Hands out aligned extents of ``[0, size)``.

    >>> a = ExtentAllocator(1 << 20)
    >>> off = a.alloc(10)          # rounded up to 4096
    >>> a.free(off); a.used
    0
    """

    def __init__(self, size: int, align: int = PAGE) -> None:
        if size <= 0 or size % align:
            raise ValueError(f"size {size} must be a positive multiple of {align}")
        self.size = size
        self.align = align
        self._starts: list[int] = [0]  # free extents, sorted by start
        self._lengths: dict[int, int] = {0: size}
        self._allocated: dict[int, int] = {}  # start -> length
        self.used = 0

    def extent_size(self, nbytes: int) -> int:
        return align_up(max(nbytes, 1), self.align)

    def largest_free(self) -> int:
        return max(self._lengths.values(), default=0)

    @property
    def free_bytes(self) -> int:
        return self.size - self.used

    def alloc(self, nbytes: int) -> int | None:
        """Start of a free extent of at least ``nbytes``, or None if none fits."""
        need = self.extent_size(nbytes)
        for i, start in enumerate(self._starts):
            if self._lengths[start] >= need:
                self._take(i, need)
                return start
        return None

    def alloc_spans(self, nbytes: int) -> Spans | None:
        """Extents holding ``nbytes`` together, in order; None only when fewer
        than ``extent_size(nbytes)`` bytes are free.

        One extent when one fits: the smallest that does (best fit keeps the
        large free extents whole for large records). Else the largest free
        extents, largest first, the last one cut to what is still needed: the
        fewest extents, so the fewest extra I/Os.

        >>> a = ExtentAllocator(4 * PAGE)
        >>> [a.alloc(PAGE) for _ in range(4)]; a.free(0); a.free(2 * PAGE)
        [0, 4096, 8192, 12288]
        >>> a.alloc(2 * PAGE) is None, a.alloc_spans(2 * PAGE)
        (True, ((0, 4096), (8192, 4096)))
        """
        need = self.extent_size(nbytes)
        if need > self.free_bytes:
            return None
        fits = [s for s in self._starts if self._lengths[s] >= need]
        if fits:
            start = min(fits, key=lambda s: self._lengths[s])   # the first of the smallest
            self._take(bisect.bisect_left(self._starts, start), need)
            return ((start, need),)
        spans = []
        for start in sorted(self._starts, key=lambda s: (-self._lengths[s], s)):
            length = min(self._lengths[start], need)
            self._take(bisect.bisect_left(self._starts, start), length)
            spans.append((start, length))
            need -= length
            if not need:
                return tuple(spans)
        raise AssertionError("free extents do not add up to free_bytes")   # invariant

    def _take(self, i: int, need: int) -> None:
        """Allocate the first ``need`` bytes of the ``i``-th free extent."""
        start = self._starts[i]
        length = self._lengths.pop(start)
        if length == need:
            del self._starts[i]
        else:
            self._starts[i] = start + need
            self._lengths[start + need] = length - need
        self._allocated[start] = need
        self.used += need

    def free_spans(self, spans: Spans) -> None:
        for start, _ in spans:
            self.free(start)

    def free(self, start: int) -> None:
        length = self._allocated.pop(start, None)
        if length is None:
            raise ValueError(f"extent at {start} is not allocated")
        self.used -= length
        i = bisect.bisect_left(self._starts, start)
        # Merge with the following free extent.
        if i < len(self._starts) and self._starts[i] == start + length:
            length += self._lengths.pop(self._starts.pop(i))
        # Merge with the preceding free extent.
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._lengths[prev] == start:
                self._lengths[prev] += length
                return
        self._starts.insert(i, start)
        self._lengths[start] = length

    def claim(self, start: int, nbytes: int) -> None:
        """Mark ``[start, start + nbytes)`` allocated, as after a restart when
        the extents come from commit manifests; ValueError if any part of it
        is outside the range or already allocated."""
        need = self.extent_size(nbytes)
        i = bisect.bisect_right(self._starts, start) - 1
        if start % self.align or i < 0:
            raise ValueError(f"extent {start}+{need} is not free in [0, {self.size})")
        free_start = self._starts[i]
        free_len = self._lengths[free_start]
        if start + need > free_start + free_len:
            raise ValueError(f"extent {start}+{need} is not free in [0, {self.size}) "
                             f"(overlaps another extent or runs past the end)")
        del self._lengths[free_start]
        del self._starts[i]
        if start > free_start:
            self._starts.insert(i, free_start)
            self._lengths[free_start] = start - free_start
            i += 1
        end, free_end = start + need, free_start + free_len
        if free_end > end:
            self._starts.insert(i, end)
            self._lengths[end] = free_end - end
        self._allocated[start] = need
        self.used += need

    def claim_spans(self, spans: Spans) -> None:
        """:meth:`claim` every extent of a record; all or none of them
        (ValueError names the first that is not free)."""
        done = []
        try:
            for start, length in spans:
                if length <= 0 or length % self.align:
                    raise ValueError(f"extent {start}+{length} is not a positive multiple "
                                     f"of {self.align} B")
                self.claim(start, length)
                done.append(start)
        except ValueError:
            for start in done:
                self.free(start)
            raise
