"""``tierd doctor``: what a node offers tierd, one line and one verdict per check.

Like ``ds_report`` / ``accelerate env``: the versions, which daemon socket a
job would use and why, the daemon's answer, the memlock limit, transparent
huge pages, O_DIRECT on the NVMe directory, available memory against the
cgroup limit, and (unless ``--daemon-only``) the torch/CUDA build and a test
that a pool segment can be page-locked. The daemon-only part never imports
torch, so it runs in well under two seconds.

Every check is a plain function returning :class:`Check`; ``root`` is where
``/proc`` and ``/sys`` are read (tests pass made-up ones).

>>> print(format_check(Check("memlock", OK, "unlimited")))
ok    memlock          unlimited
"""

from __future__ import annotations

import errno
import mmap
import os
import resource
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from tierd import __version__
from tierd.backends.memory import host_memory
from tierd.config import format_size

OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"
#: below this an attach pins little of the pool (the default 8 MiB is far below any pool)
MEMLOCK_LOW = 64 << 20


@dataclass(frozen=True)
class Check:
    """One line of the report: ``verdict`` is ok, warn, FAIL or info."""

    name: str
    verdict: str
    detail: str


def format_check(c: Check) -> str:
    return f"{c.verdict:<5} {c.name:<16} {c.detail}"


def check_version() -> Check:
    return Check("tierd", INFO, f"client {__version__}")


def check_socket(socket_path: str | None) -> tuple[Check, Path]:
    from tierd.client.embedded import resolve_socket
    choice = resolve_socket(socket_path)
    what = ("a job fails with DaemonUnavailable if no daemon answers there" if choice.explicit
            else "with no daemon there, attach starts a private one")
    return Check("socket", INFO, f"{choice.path} ({choice.why}; {what})"), choice.path


def check_daemon(path: Path) -> tuple[Check, dict | None]:
    """The daemon at ``path``: its version against ours, its pool, its NVMe I/O mode."""
    from tierd.client.connection import connect
    from tierd.errors import TierdError
    try:
        with connect(path) as c:
            stats = c.stats()
    except TierdError as exc:
        return Check("daemon", WARN, f"none answers: {exc}"), None
    version = stats.get("version", "unknown")
    detail = (f"tierd {version}, pool {format_size(stats['pool_bytes'])}, NVMe "
              f"{format_size(stats['nvme_bytes'])} "
              f"({'O_DIRECT' if stats['nvme_direct_io'] else 'buffered'})")
    if version != __version__:
        return Check("daemon", FAIL, f"{detail}; this client is {__version__}: upgrade both "
                                     "together"), stats
    return Check("daemon", OK, detail), stats


def check_memlock(pool: int | None) -> Check:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return Check("memlock", OK, "unlimited")
    text = f"{format_size(soft)} (RLIMIT_MEMLOCK)"
    fix = ("; jobs page-lock the pool segments they map: raise it (systemd LimitMEMLOCK="
           "infinity, `ulimit -l unlimited`, the container runtime's default ulimits)")
    if os.geteuid() == 0:
        return Check("memlock", OK, text + ", but root is not limited")
    if (pool is not None and soft < pool) or soft < MEMLOCK_LOW:
        return Check("memlock", WARN, text + (f" < the pool {format_size(pool)}" if pool else "")
                     + fix)
    return Check("memlock", OK, text)


def check_thp(root: Path = Path("/")) -> Check:
    base = root / "sys" / "kernel" / "mm" / "transparent_hugepage"
    found = {}
    for name in ("enabled", "shmem_enabled"):
        try:
            text = (base / name).read_text().split()
        except OSError:
            continue
        found[name] = next((w.strip("[]") for w in text if w.startswith("[")), " ".join(text))
    if not found:
        return Check("huge pages", INFO, f"{base} not readable (no THP report)")
    detail = ", ".join(f"{k} {v}" for k, v in found.items())
    if found.get("shmem_enabled") in ("always", "force"):
        return Check("huge pages", WARN, detail + "; the pool (shmem) is then backed by huge "
                     "pages, so freeing a slot frees no memory until its whole 2 MiB page is")
    return Check("huge pages", OK, detail)


def check_direct_io(nvme: Path | None) -> Check:
    """Whether ``nvme`` (or its nearest existing parent) takes an aligned O_DIRECT write."""
    if nvme is None:
        return Check("NVMe O_DIRECT", INFO, "no NVMe directory given (--nvme, $TIERD_NVME or "
                                            "`nvme` in the config file)")
    where = nvme
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        fd, name = tempfile.mkstemp(prefix=".tierd-doctor-", dir=where)
    except OSError as exc:
        return Check("NVMe O_DIRECT", FAIL, f"{where}: cannot create a file ({exc.strerror})")
    os.close(fd)
    buf = mmap.mmap(-1, 4096)   # page-aligned, as O_DIRECT needs
    try:
        fd = os.open(name, os.O_WRONLY | os.O_DIRECT)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            return Check("NVMe O_DIRECT", FAIL, f"{where}: {exc.strerror}")
        return Check("NVMe O_DIRECT", WARN, f"{where} refuses O_DIRECT: the daemon falls back "
                     "to buffered I/O (slower, fills the page cache); use a local ext4/xfs")
    finally:
        buf.close()
        os.unlink(name)
    return Check("NVMe O_DIRECT", OK, f"{where} takes aligned O_DIRECT writes")


def check_memory(pool: int | None, root: Path = Path("/")) -> Check:
    mem = host_memory(root)
    detail = f"{format_size(mem.available)} available ({mem.source})"
    if pool is not None and pool > mem.available:
        return Check("memory", WARN, f"{detail}; the daemon's pool {format_size(pool)} is "
                                     "larger: its jobs may be OOM-killed")
    return Check("memory", OK, detail)


def check_torch() -> list[Check]:
    """torch's build and the GPU, and a pool-like segment page-locked with CUDA."""
    try:
        import torch
    except ImportError as exc:
        return [Check("torch", FAIL, f"not importable: {exc}")]
    cuda = torch.version.cuda
    out = [Check("torch", INFO, f"{torch.__version__}, built with "
                                + (f"CUDA {cuda}" if cuda else "no CUDA (CPU only)"))]
    if not torch.cuda.is_available():
        return out + [Check("CUDA", INFO if not cuda else WARN,
                            "no CUDA device: jobs compute on the CPU"),
                      Check("pool pinning", INFO, "skipped: no CUDA device")]
    out.append(Check("CUDA", OK, f"{torch.cuda.device_count()} device(s), "
                                 f"{torch.cuda.get_device_name(0)}"))
    return out + [check_pinning(torch)]


def check_pinning(torch, nbytes: int = 2 << 20) -> Check:
    """Page-lock a shared-memory segment as jobs do with the pool's
    (``cudaHostRegister``, see tierd.client.copy_stream.register_pool)."""
    fd = os.memfd_create("tierd-doctor", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        seg = mmap.mmap(fd, nbytes)
        view = torch.frombuffer(seg, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostRegister(view.data_ptr(), nbytes, 0))
        if err == 0:
            cudart.cudaHostUnregister(view.data_ptr())
        else:
            getattr(cudart, "cudaGetLastError", lambda: None)()
        del view
        seg.close()
    finally:
        os.close(fd)
    if err:
        return Check("pool pinning", FAIL, f"cudaHostRegister of a {format_size(nbytes)} "
                     f"shared-memory segment failed (CUDA error {err}): pool copies would run "
                     "pageable, ~7x slower; check the memlock limit")
    return Check("pool pinning", OK, f"cudaHostRegister of a {format_size(nbytes)} "
                                     "shared-memory segment works")


def report(socket_path: str | None, nvme: Path | None, *, daemon_only: bool,
           root: Path = Path("/")) -> list[Check]:
    """Every check, in the order printed."""
    sock_check, path = check_socket(socket_path)
    daemon, stats = check_daemon(path)
    pool = stats["pool_bytes"] if stats else None
    checks: list[Check] = [check_version(), sock_check, daemon, check_memlock(pool),
                           check_thp(root), check_direct_io(nvme), check_memory(pool, root)]
    if not daemon_only:
        checks += check_torch()
    return checks


def as_json(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]
