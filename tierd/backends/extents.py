"""First-fit extent allocator over a range of bytes, with coalescing on free.

Used for pool segments and NVMe files alike. Every extent is aligned to
``align`` bytes (4 KiB by default), which is what O_DIRECT needs for both the
file offset and the memory address, so data moves between a pool slot and an
NVMe extent with no bounce buffer.
"""

from __future__ import annotations

import bisect

PAGE = 4096


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

    def alloc(self, nbytes: int) -> int | None:
        """Start of a free extent of at least ``nbytes``, or None if none fits."""
        need = self.extent_size(nbytes)
        for i, start in enumerate(self._starts):
            length = self._lengths[start]
            if length < need:
                continue
            del self._lengths[start]
            if length == need:
                del self._starts[i]
            else:
                self._starts[i] = start + need
                self._lengths[start + need] = length - need
            self._allocated[start] = need
            self.used += need
            return start
        return None

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
