"""``tierd export`` / ``tierd import``: a job's committed tensors as safetensors.

Export reads a job's last commit straight from the NVMe directory (daemon
running or not): the manifest names the records, and every record is checked
(header and checksums) before its bytes go out, so an export never carries
damaged data. If a newer commit replaces the one being read meanwhile, a
record may be reused, fails its check, and the export stops: run it again.

[Note: streamed export, library-checked]
The ``safetensors`` library writes a file from tensors that are all in
memory at once; a job's commit can be larger than the host's memory, so
export streams: it writes the format's header (8-byte little-endian length,
JSON ``{name: {"dtype", "shape", "data_offsets"}}`` padded to 8 bytes) and
then each record's verified bytes, one tensor in memory at a time. The
written file is then opened with ``safetensors.safe_open`` (which checks the
header, dtypes, and that the offsets cover the file exactly) before it
replaces ``out``: a file the library would not read never lands. Import reads
through ``safe_open`` only.

Both show a progress bar (tqdm, on a terminal, once a transfer has taken
more than :data:`PROGRESS_DELAY` seconds).

>>> export_job(Path("/mnt/nvme/tierd"), "run1", Path("model.safetensors"))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from tierd.backends import recordio
from tierd.backends.extents import align_up
from tierd.backends.manifest import CommittedTensor, ManifestStore
from tierd.backends.nvme import DATA_FILE
from tierd.errors import TierdError
from tierd.server.records import ITEMSIZE

ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
             "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
             "bool": "BOOL", "complex64": "C64", "float8_e4m3fn": "F8_E4M3",
             "float8_e5m2": "F8_E5M2"}
FROM_ST = {v: k for k, v in ST_DTYPES.items()}
#: Seconds before a progress bar appears: short transfers print nothing extra.
PROGRESS_DELAY = 1.0


def progress(total: int, what: str) -> tqdm:
    """A byte progress bar on stderr; silent when stderr is not a terminal."""
    return tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024,
                delay=PROGRESS_DELAY, disable=None, leave=False)


def read_committed(fd: int, job: str, t: CommittedTensor) -> bytes:
    """The verified bytes of one committed tensor from an open data file."""
    meta = recordio.RecordMeta(t.key, job, t.dtype, t.shape, t.nbytes, t.version)
    hlen, dlen = meta.header_len(), align_up(max(t.nbytes, 1))
    # The record's spans in order (see [Note: records in several
    # extents] in tierd.backends.recordio).
    raw = b"".join(os.pread(fd, n, off) for off, n in t.spans)[:hlen + dlen]
    if len(raw) < hlen + dlen:
        raise TierdError(f"{t.key}: the data file ends inside its record (truncated)")
    data = memoryview(raw)[hlen:]
    algo, sums = recordio.parse_header(raw[:hlen], meta)
    got = [recordio.checksum(data[s:s + n]) for s, n in recordio.pieces_of(dlen)]
    recordio.verify_pieces(meta, algo, sums, got, data)
    return bytes(data[:t.nbytes])


def _header(job: str, manifest, tensors: list[CommittedTensor], prefix: str) -> bytes:
    header: dict = {"__metadata__": {"tierd_job": job, "tierd_tag": manifest.tag,
                                     "tierd_seq": str(manifest.seq)}}
    offset = 0
    for t in tensors:
        header[t.key[len(prefix):]] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                                       "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def export_job(nvme_dir: Path, job: str, out: Path, tag: str | None = None,
               prefix: str = "") -> tuple[int, int]:
    """Write the job's last commit (keys under ``prefix``, which is stripped)
    to a safetensors file; returns (tensors, bytes)."""
    manifest = ManifestStore(nvme_dir).find(job)
    if manifest is None:
        raise TierdError(f"job {job!r} has no commit in {nvme_dir}; commit it first "
                         f"(tierd.commit(model, opt, step), or client.commit(tag)) or "
                         f"check --nvme")
    if tag is not None and tag != manifest.tag:
        raise TierdError(f"job {job!r}: only its last commit {manifest.tag!r} can be exported "
                         f"(the records of {tag!r} are gone); omit --tag or pass that one")
    tensors = [t for t in manifest.tensors if t.key.startswith(prefix) and t.key != prefix]
    if not tensors:
        near = sorted({t.key.rsplit("/", 1)[0] + "/" for t in manifest.tensors})[:5]
        raise TierdError(f"job {job!r}: no key of commit {manifest.tag!r} starts with "
                         f"{prefix!r}; its keys are under {', '.join(near)}")
    bad = [t.key for t in tensors if t.dtype not in ST_DTYPES]
    if bad:
        raise TierdError(f"safetensors has no dtype for {bad[:5]}; export with a --prefix "
                         f"that leaves them out")
    nbytes = sum(t.nbytes for t in tensors)
    fd = os.open(Path(nvme_dir) / DATA_FILE, os.O_RDONLY)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with open(tmp, "wb") as f, progress(nbytes, f"export {job}") as bar:
            f.write(_header(job, manifest, tensors, prefix))
            for t in tensors:
                f.write(read_committed(fd, job, t))
                bar.update(t.nbytes)
        names = safetensors_index(tmp)      # [Note: streamed export, library-checked]
        if len(names) != len(tensors):
            raise TierdError(f"{out}: wrote {len(tensors)} tensors but the file holds "
                             f"{len(names)}; two keys differ only by --prefix")
        os.replace(tmp, out)
    except OSError as exc:
        raise TierdError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
        tmp.unlink(missing_ok=True)
    return len(tensors), nbytes


def safetensors_index(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (tierd dtype, shape)}`` of a safetensors file, checked by the
    safetensors library; a file that is not one is a TierdError (one line)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            index = {name: (s.get_dtype(), tuple(s.get_shape())) for name, s in slices.items()}
    except SafetensorError as exc:
        raise TierdError(f"{path} is not a valid safetensors file: {exc}") from None
    except OSError as exc:
        raise TierdError(f"cannot read {path}: {exc.strerror or exc}") from None
    unknown = {name: dt for name, (dt, _) in index.items() if dt not in FROM_ST}
    if unknown:
        name, dt = next(iter(unknown.items()))
        raise TierdError(f"{path}: tensor {name!r} has dtype {dt}, which tierd does not "
                         f"store; known: {', '.join(FROM_ST)}")
    return {name: (FROM_ST[dt], shape) for name, (dt, shape) in index.items()}


def import_file(socket_path, job: str, path: Path, tag: str, prefix: str = "") -> dict:
    """Put every tensor of a safetensors file into ``job`` (keys ``prefix +
    name``) and commit them as ``tag``; returns the commit summary. The whole
    file is checked before the first tensor goes in."""
    index = safetensors_index(path)
    from tierd.client.connection import connect

    nbytes = sum(_nbytes(dtype, shape) for dtype, shape in index.values())
    with connect(socket_path, job=job) as c, progress(nbytes, f"import {path.name}") as bar:
        with safe_open(str(path), framework="pt") as f:
            for name, (dtype, shape) in index.items():
                c.put(prefix + name, f.get_tensor(name))
                bar.update(_nbytes(dtype, shape))
        return c.commit(tag)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape, start=ITEMSIZE[dtype])
