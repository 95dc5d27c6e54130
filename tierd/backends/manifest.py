"""Commit manifests: which NVMe records make up each named job's last commit.

[Note: manifest format] One file per committed job under
``<nvme dir>/manifests/``, named ``job-<sha256 of the job name, 24 hex>.commit``
(job names may hold any character). The file is msgpack
``{"crc": crc32(body), "body": bytes}`` whose body is a msgpack map::

    format     1
    job        the job name
    owner_uid  uid that created the job (a restarted daemon keeps who may join)
    seq        1, 2, ... one more per commit of the job
    tag        the caller's tag of this commit
    created    unix time
    history    [[tag, seq, created], ...] the last HISTORY commits, newest last
    tensors    [[key, dtype, shape, nbytes, version, offset, extent_len], ...]

Each tensor entry names a record in the data file (see the Note on record
format) whose header repeats key, job, dtype, shape, nbytes and version, so a
record that is not the one the manifest means is caught at read time.

A commit writes the new manifest to ``<name>.tmp``, fsyncs it, renames it
over the old one and fsyncs the directory: a crash leaves the old or the new
manifest, never a mix. Only the latest commit of a job can be restored; the
records it names are never freed or overwritten until a newer manifest has
replaced it (see the Note on commits in :mod:`tierd.server.commits`).
"""

from __future__ import annotations

import hashlib
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgpack

from tierd.backends.nvme import Failpoints
from tierd.errors import IntegrityError, TierIOError

FORMAT = 1
HISTORY = 100
SUFFIX = ".commit"


@dataclass(frozen=True)
class CommittedTensor:
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    version: int
    offset: int
    extent_len: int


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
            "tensors": [[t.key, t.dtype, list(t.shape), t.nbytes, t.version, t.offset,
                         t.extent_len] for t in self.tensors]})

    @classmethod
    def from_body(cls, body: bytes) -> "Manifest":
        m = msgpack.unpackb(body)
        if m.get("format") != FORMAT:
            raise ValueError(f"manifest format {m.get('format')!r}, this daemon reads {FORMAT}")
        return cls(m["job"], m["owner_uid"], m["seq"], m["tag"], m["created"],
                   tuple((h[0], h[1], h[2]) for h in m["history"]),
                   tuple(CommittedTensor(t[0], t[1], tuple(t[2]), t[3], t[4], t[5], t[6])
                         for t in m["tensors"]))


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

    def load_all(self) -> list[Manifest]:
        """Every job's manifest; removes leftover ``.tmp`` files of torn commits."""
        if not self.directory.is_dir():
            return []
        for tmp in self.directory.glob("*.tmp"):
            tmp.unlink()
        return [self.load(p) for p in sorted(self.directory.glob(f"*{SUFFIX}"))]

    def find(self, job: str) -> Manifest | None:
        path = self.path(job)
        return self.load(path) if path.exists() else None
