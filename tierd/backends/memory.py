"""How much host memory this process may still use, and where that figure came from.

The pool is shared memory charged to the daemon's cgroup, so the figure is
the smaller of the machine's ``MemAvailable`` and the room left under the
process's cgroup memory limit (cgroup v2 ``memory.max`` of the process's
cgroup and its ancestors, else v1 ``memory.limit_in_bytes``): in a
Kubernetes pod with a 4 GiB limit on a 512 GiB node, 4 GiB less what the
pod uses. Every file is read under ``root`` so tests give a made-up
``/proc`` and ``/sys/fs/cgroup``.

[Note: memory without /proc/meminfo]
Under systemd's ``ProcSubset=pid`` (and some container sandboxes)
``/proc/meminfo`` is hidden. Answering "unknown, so unlimited" there let a
64 GiB pool be served on a 23 GB machine; the figure then comes from
``sysinfo(2)`` (free RAM plus buffers, without the page cache: lower than
MemAvailable, never higher), and its source says so.

>>> figure = host_memory()
>>> figure.available > 0 and bool(figure.source)
True
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

from tierd.config import format_size as _size

#: cgroup v1 writes "no limit" as the largest page-aligned long.
_V1_UNLIMITED = 1 << 60
_UNKNOWN = 1 << 62   # no figure at all (no /proc, no sysinfo): nothing to refuse on


@dataclass(frozen=True)
class CgroupLimit:
    """The tightest memory limit above this process: ``limit`` bytes at
    ``path``, of which ``used`` are in use (less inactive file cache)."""

    limit: int
    used: int
    path: Path
    version: int

    @property
    def room(self) -> int:
        return max(0, self.limit - self.used)


@dataclass(frozen=True)
class HostMemory:
    """``available`` bytes and ``source``, a sentence naming where they came from."""

    available: int
    source: str
    machine: int | None          # MemAvailable (or sysinfo's figure); None: unreadable
    cgroup: CgroupLimit | None   # None: no limit found


def host_memory(root: Path = Path("/")) -> HostMemory:
    """The memory this process may still use (see the module docstring)."""
    machine, machine_src = _machine(root)
    cgroup = cgroup_limit(root)
    if cgroup is not None and (machine is None or cgroup.room < machine):
        return HostMemory(cgroup.room, f"cgroup v{cgroup.version} limit {_size(cgroup.limit)} "
                          f"at {cgroup.path}, {_size(cgroup.used)} of it in use", machine, cgroup)
    if machine is None:
        return HostMemory(_UNKNOWN, "unknown (no /proc/meminfo, no sysinfo)", None, cgroup)
    extra = f" (below the cgroup limit {_size(cgroup.limit)} at {cgroup.path})" if cgroup else ""
    return HostMemory(machine, machine_src + extra, machine, cgroup)


def available_memory(root: Path = Path("/")) -> int:
    """Bytes of host memory this process may still use: :func:`host_memory`'s figure."""
    return host_memory(root).available


def _machine(root: Path) -> tuple[int | None, str]:
    meminfo = root / "proc" / "meminfo"
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, f"MemAvailable in {meminfo}"
    except OSError:
        pass
    free = _sysinfo_free()   # [Note: memory without /proc/meminfo]
    if free is None:
        return None, ""
    return free, (f"sysinfo() free RAM and buffers ({meminfo} is unreadable, e.g. under "
                  "systemd's ProcSubset=pid; the page cache is not counted)")


class _SysInfo(ctypes.Structure):
    _fields_ = [("uptime", ctypes.c_long), ("loads", ctypes.c_ulong * 3),
                ("totalram", ctypes.c_ulong), ("freeram", ctypes.c_ulong),
                ("sharedram", ctypes.c_ulong), ("bufferram", ctypes.c_ulong),
                ("totalswap", ctypes.c_ulong), ("freeswap", ctypes.c_ulong),
                ("procs", ctypes.c_ushort), ("totalhigh", ctypes.c_ulong),
                ("freehigh", ctypes.c_ulong), ("mem_unit", ctypes.c_uint),
                ("_pad", ctypes.c_char * 8)]


def _sysinfo_free() -> int | None:
    info = _SysInfo()
    try:
        if ctypes.CDLL(None, use_errno=True).sysinfo(ctypes.byref(info)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return (info.freeram + info.bufferram) * max(1, info.mem_unit)


def cgroup_limit(root: Path = Path("/")) -> CgroupLimit | None:
    """The tightest cgroup memory limit on this process (v2, else v1), or None."""
    try:
        lines = (root / "proc" / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    fs = root / "sys" / "fs" / "cgroup"
    for line in lines:
        ident, controllers, path = line.split(":", 2)
        if ident == "0" and controllers == "":
            found = _v2(fs, path)
            if found is not None:
                return found
    for line in lines:
        ident, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return _v1(fs / "memory", path)
    return None


def _v2(fs: Path, path: str) -> CgroupLimit | None:
    leaf = _inside(fs, path)
    best = None
    d = leaf
    while True:   # the process's cgroup and every ancestor up to the mount
        limit = _read_int(d / "memory.max")
        if limit is not None:
            used = _used(d / "memory.current", d / "memory.stat", "inactive_file")
            found = CgroupLimit(limit, used, d / "memory.max", 2)
            if best is None or found.room < best.room:
                best = found
        if d == fs:
            return best
        d = d.parent


def _v1(fs: Path, path: str) -> CgroupLimit | None:
    d = _inside(fs, path)
    limit = _read_int(d / "memory.limit_in_bytes")
    if limit is None or limit >= _V1_UNLIMITED:
        return None
    used = _used(d / "memory.usage_in_bytes", d / "memory.stat", "total_inactive_file")
    return CgroupLimit(limit, used, d / "memory.limit_in_bytes", 1)


def _inside(fs: Path, path: str) -> Path:
    """The cgroup's directory: ``path`` under the mount, or the mount itself
    where the path is the host's and only our own cgroup is mounted (a
    container without a cgroup namespace)."""
    d = fs / path.lstrip("/")
    return d if d.is_dir() else fs


def _read_int(path: Path) -> int | None:
    """The file's number; None when missing or ``max`` (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _used(current: Path, stat: Path, inactive_key: str) -> int:
    """Bytes in use, less the inactive file cache the kernel reclaims first."""
    used = _read_int(current) or 0
    try:
        for line in stat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key and value.strip().isdigit():
                return max(0, used - int(value))
    except OSError:
        pass
    return used
