"""Commit manifests: which NVMe records make up each named job's last commit.

[Note: manifest format]
One file per committed job under
``<nvme dir>/manifests/``, named ``job-<sha256 of the job name, 24 hex>.commit``
(job names may hold any character). The file is msgpack
``{"crc": crc32(body), "body": bytes}`` whose body is a msgpack map::

    format     2 (format 1 files, from before records could span several
               extents, are still read)
    job        the job name
    owner_uid  uid that created the job (a restarted daemon keeps who may join)
    seq        1, 2, ... one more per commit of the job
    tag        the caller's tag of this commit
    created    unix time
    history    [[tag, seq, created], ...] the last HISTORY commits, newest last
    tensors    [[key, dtype, shape, nbytes, version, spans], ...]
               spans: [[offset, length], ...] the record's extents in order
               (format 1: [key, dtype, shape, nbytes, version, offset,
               extent_len], one extent)

Each tensor entry names a record in the data file (see [Note: record
format] and [Note: records in several extents] in ``tierd.backends.recordio``) whose header repeats key, job,
dtype, shape, nbytes and version, so a record that is not the one the
manifest means is caught at read time. Loading checks that each record's
spans add up to its length, lie inside the data file and overlap no other.

A commit writes the new manifest to ``<name>.tmp``, fsyncs it, renames it
over the old one and fsyncs the directory: a crash leaves the old or the new
manifest, never a mix. Only the latest commit of a job can be restored; the
records it names are never freed or overwritten until a newer manifest has
replaced it (see [Note: commits] in :mod:`tierd.server.commits`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgpack

from tierd.backends.extents import PAGE, Spans, align_up
from tierd.backends.nvme import Failpoints
from tierd.backends.recordio import RecordMeta, spans_len
from tierd.errors import IntegrityError, TierIOError
from tierd.protocol import DTYPES

FORMAT = 2
READS = (1, 2)
HISTORY = 100
SUFFIX = ".commit"
QUARANTINE = "quarantine"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommittedTensor:
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    version: int
    spans: Spans

    @property
    def offset(self) -> int:
        """Where the record starts (its header)."""
        return self.spans[0][0]

    @property
    def extent_len(self) -> int:
        """Bytes of the data file the record takes, all spans together."""
        return spans_len(self.spans)

    def entry(self) -> list:
        return [self.key, self.dtype, list(self.shape), self.nbytes, self.version,
                [list(sp) for sp in self.spans]]


@dataclass(frozen=True)
class Manifest:
    job: str
    owner_uid: int
    seq: int
    tag: str
    created: float
    history: tuple[tuple[str, int, float], ...]
    tensors: tuple[CommittedTensor, ...]

    def tags(self) -> list[str]:
        return [h[0] for h in self.history]

    def to_body(self) -> bytes:
        return msgpack.packb({
            "format": FORMAT, "job": self.job, "owner_uid": self.owner_uid, "seq": self.seq,
            "tag": self.tag, "created": self.created, "history": [list(h) for h in self.history],
            "tensors": [t.entry() for t in self.tensors]})

    @classmethod
    def from_body(cls, body: bytes) -> "Manifest":
        """Parse and check a manifest body; ValueError names what is wrong."""
        m = msgpack.unpackb(body)
        if type(m) is not dict:
            raise ValueError("the body is not a map")
        if m.get("format") not in READS:
            raise ValueError(f"manifest format {m.get('format')!r}, this daemon reads "
                             f"{' and '.join(map(str, READS))}")
        _want(m, "job", str)
        _want(m, "tag", str)
        for name in ("owner_uid", "seq"):
            _want(m, name, int)
        _want(m, "created", (int, float))
        history = tuple(_history(h) for h in _want(m, "history", list))
        tensors = tuple(_tensor(t, m["format"]) for t in _want(m, "tensors", list))
        return cls(m["job"], m["owner_uid"], m["seq"], m["tag"], m["created"], history, tensors)


def _want(m: dict, name: str, types):
    v = m.get(name)
    if not isinstance(v, types) or isinstance(v, bool):
        raise ValueError(f"field {name!r} is {type(v).__name__}, not {types}")
    return v


def _history(h) -> tuple[str, int, float]:
    if (type(h) is not list or len(h) != 3 or type(h[0]) is not str or type(h[1]) is not int
            or type(h[2]) not in (int, float)):
        raise ValueError(f"history entry {h!r:.80} is not [tag, seq, created]")
    return h[0], h[1], h[2]


def _tensor(t, form: int) -> "CommittedTensor":
    fields = 7 if form == 1 else 6
    if (type(t) is not list or len(t) != fields or type(t[0]) is not str or t[1] not in DTYPES
            or type(t[2]) is not list or not all(type(d) is int and d >= 0 for d in t[2])
            or not all(type(v) is int and v >= 0 for v in t[3:5])):
        raise ValueError(f"tensor entry {t!r:.80} is not [key, dtype, shape, nbytes, version, "
                         + ("offset, extent_len]" if form == 1 else "spans]"))
    spans = [t[5:7]] if form == 1 else t[5]
    if (type(spans) is not list or not spans
            or not all(type(sp) is list and len(sp) == 2 and all(type(v) is int for v in sp)
                       and sp[0] >= 0 and sp[1] > 0 for sp in spans)):
        raise ValueError(f"tensor entry {t!r:.80} has no list of [offset, length] extents")
    return CommittedTensor(t[0], t[1], tuple(t[2]), t[3], t[4],
                           tuple((a, b) for a, b in spans))


def next_manifest(previous: "Manifest | None", job: str, owner_uid: int, tag: str,
                  tensors: tuple[CommittedTensor, ...]) -> Manifest:
    seq = previous.seq + 1 if previous else 1
    now = time.time()
    history = (previous.history if previous else ()) + ((tag, seq, now),)
    return Manifest(job, owner_uid, seq, tag, now, history[-HISTORY:], tensors)


class ManifestStore:
    """The manifests directory of one NVMe dir."""

    def __init__(self, nvme_dir: Path, failpoints: Failpoints | None = None) -> None:
        self.directory = Path(nvme_dir) / "manifests"
        self.failpoints = failpoints or Failpoints()

    def path(self, job: str) -> Path:
        digest = hashlib.sha256(job.encode()).hexdigest()[:24]
        return self.directory / f"job-{digest}{SUFFIX}"

    def any(self) -> bool:
        return self.directory.is_dir() and any(self.directory.glob(f"*{SUFFIX}"))

    def write(self, manifest: Manifest) -> None:
        """Durably replace the job's manifest (blocking; run in a thread)."""
        body = manifest.to_body()
        data = msgpack.packb({"crc": zlib.crc32(body), "body": body})
        final = self.path(manifest.job)
        tmp = final.with_suffix(".tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.failpoints.check("manifest")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            self._sync_dir()
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise TierIOError(f"writing the commit manifest of job {manifest.job!r} to "
                              f"{final} failed: {exc.strerror}; the previous commit is "
                              f"untouched; free disk space in {self.directory}") from None

    def remove(self, job: str) -> None:
        path = self.path(job)
        if path.exists():
            path.unlink()
            self._sync_dir()

    def _sync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self, path: Path) -> Manifest:
        try:
            outer = msgpack.unpackb(path.read_bytes())
            body = outer["body"]
            if zlib.crc32(body) != outer["crc"]:
                raise ValueError("checksum mismatch")
            manifest = Manifest.from_body(body)
        except (ValueError, KeyError, TypeError, IndexError, msgpack.UnpackException) as exc:
            raise IntegrityError(f"commit manifest {path} is damaged ({exc}); move it out "
                                 f"of {self.directory} to start without that job") from None
        if path != self.path(manifest.job):
            raise IntegrityError(f"commit manifest {path} holds job {manifest.job!r}, whose "
                                 f"manifest belongs at {self.path(manifest.job)}; move it")
        return manifest

    def load_all(self, data_size: int | None = None) -> list[Manifest]:
        """Every job's manifest; removes leftover ``.tmp`` files of torn commits.

        A damaged manifest (unreadable, wrong structure, records outside the
        data file of ``data_size`` bytes or overlapping another job's) is
        moved aside (see :meth:`quarantine`) and the other jobs load.
        """
        if not self.directory.is_dir():
            return []
        for tmp in self.directory.glob("*.tmp"):
            tmp.unlink()
        good: list[Manifest] = []
        taken: list[tuple[int, int, str]] = []
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            try:
                m = self.load(path)
                if data_size is not None:
                    taken += _check_extents(m, data_size, taken)
            except IntegrityError as exc:
                self.quarantine(path, str(exc))
                continue
            good.append(m)
        return good

    def quarantine(self, path: Path, reason: str) -> None:
        """Move a manifest into ``manifests/quarantine/`` with a ``.reason``
        file beside it; its job is not restored, the file is kept to inspect."""
        aside = self.directory / QUARANTINE
        aside.mkdir(exist_ok=True)
        dest = aside / f"{path.name}.{time.strftime('%Y%m%dT%H%M%S')}"
        os.rename(path, dest)
        dest.with_name(dest.name + ".reason").write_text(reason + "\n")
        self._sync_dir()
        log.error("quarantined commit manifest %s as %s: %s", path, dest, reason)

    def quarantined(self) -> list[dict]:
        """The manifests moved aside, oldest first: ``file`` and ``reason``."""
        aside = self.directory / QUARANTINE
        if not aside.is_dir():
            return []
        out = []
        for p in sorted(aside.iterdir()):
            if p.suffix != ".reason":
                why = p.with_name(p.name + ".reason")
                out.append({"file": str(p),
                            "reason": why.read_text().strip() if why.exists() else "unknown"})
        return out

    def find(self, job: str) -> Manifest | None:
        path = self.path(job)
        return self.load(path) if path.exists() else None


def _check_extents(m: Manifest, data_size: int,
                   taken: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """The manifest's record extents, or IntegrityError when a record's spans
    do not add up to its length, or one lies outside the data file or
    overlaps another (of this job or one loaded before)."""
    for t in m.tensors:
        want = align_up(RecordMeta(t.key, m.job, t.dtype, t.shape, t.nbytes,
                                   t.version).record_len())
        if t.extent_len != want or any(a % PAGE or n % PAGE for a, n in t.spans):
            raise IntegrityError(
                f"commit manifest of job {m.job!r} puts {t.key!r} in extents {t.spans[:4]} "
                f"of {t.extent_len} B, not page-aligned extents of its record's {want} B")
    mine = sorted((a, a + n, t.key) for t in m.tensors for a, n in t.spans)
    for start, end, key in mine:
        if end > data_size:
            raise IntegrityError(
                f"commit manifest of job {m.job!r} puts {key!r} at [{start}, {end}), outside "
                f"the {data_size} B data file; if --nvme-size shrank, restart with the old size")
    everything = sorted(taken + [(a, b, m.job) for a, b, _ in mine])
    for (a0, a1, j0), (b0, b1, j1) in zip(everything, everything[1:]):
        if b0 < a1 and m.job in (j0, j1):
            raise IntegrityError(f"commit manifest of job {m.job!r} names records overlapping "
                                 f"those of job {j0 if j1 == m.job else j1!r} at {b0}")
    return [(a, b, m.job) for a, b, _ in mine]
