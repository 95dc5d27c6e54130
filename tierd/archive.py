"""``tierd export`` / ``tierd import``: a job's committed tensors as safetensors.

Export reads a job's last commit straight from the NVMe directory (daemon
running or not): the manifest names the records, and every record is checked
(header and checksums) before its bytes go out, so an export never carries
damaged data. If a newer commit replaces the one being read meanwhile, a
record may be reused, fails its check, and the export stops: run it again.

The safetensors format: an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
padded with spaces to a multiple of 8 bytes, then the tensors' raw bytes.

>>> export_job(Path("/mnt/nvme/tierd"), "run1", Path("model.safetensors"))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from tierd.backends import recordio
from tierd.backends.extents import align_up
from tierd.backends.manifest import CommittedTensor, ManifestStore
from tierd.backends.nvme import DATA_FILE
from tierd.errors import TierdError

ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
             "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
             "bool": "BOOL", "complex64": "C64", "float8_e4m3fn": "F8_E4M3",
             "float8_e5m2": "F8_E5M2"}
FROM_ST = {v: k for k, v in ST_DTYPES.items()}


def read_committed(fd: int, job: str, t: CommittedTensor) -> bytes:
    """The verified bytes of one committed tensor from an open data file."""
    meta = recordio.RecordMeta(t.key, job, t.dtype, t.shape, t.nbytes, t.version)
    hlen, dlen = meta.header_len(), align_up(max(t.nbytes, 1))
    raw = os.pread(fd, hlen + dlen, t.offset)
    if len(raw) < hlen + dlen:
        raise TierdError(f"{t.key}: the data file ends inside its record (truncated)")
    data = memoryview(raw)[hlen:]
    algo, sums = recordio.parse_header(raw[:hlen], meta)
    got = [recordio.checksum(data[s:s + n]) for s, n in recordio.pieces_of(dlen)]
    recordio.verify_pieces(meta, algo, sums, got, data)
    return bytes(data[:t.nbytes])


def export_job(nvme_dir: Path, job: str, out: Path, tag: str | None = None,
               prefix: str = "") -> tuple[int, int]:
    """Write the job's last commit (keys under ``prefix``, which is stripped)
    to a safetensors file; returns (tensors, bytes)."""
    manifest = ManifestStore(nvme_dir).find(job)
    if manifest is None:
        raise TierdError(f"job {job!r} has no commit in {nvme_dir}; commit it first "
                         f"(client.commit(tag)) or check --nvme")
    if tag is not None and tag != manifest.tag:
        raise TierdError(f"job {job!r}: only its last commit {manifest.tag!r} can be exported "
                         f"(the records of {tag!r} are gone); omit --tag or pass that one")
    tensors = [t for t in manifest.tensors if t.key.startswith(prefix) and t.key != prefix]
    bad = [t.key for t in tensors if t.dtype not in ST_DTYPES]
    if bad:
        raise TierdError(f"safetensors has no dtype for {bad[:5]}; export with a --prefix "
                         f"that leaves them out")
    header: dict = {"__metadata__": {"tierd_job": job, "tierd_tag": manifest.tag,
                                     "tierd_seq": str(manifest.seq)}}
    offset = 0
    for t in tensors:
        header[t.key[len(prefix):]] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                                       "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    fd = os.open(Path(nvme_dir) / DATA_FILE, os.O_RDONLY)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for t in tensors:
                f.write(read_committed(fd, job, t))
        os.replace(tmp, out)
    finally:
        os.close(fd)
        tmp.unlink(missing_ok=True)
    return len(tensors), offset


def read_safetensors(path: Path):
    """Yield (name, dtype name, shape, bytes) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise TierdError(f"{path}: header of {n} B is not a safetensors header")
        header = json.loads(f.read(n))
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in FROM_ST:
                raise TierdError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which "
                                 f"tierd does not store; known: {', '.join(FROM_ST)}")
            begin, end = info["data_offsets"]
            f.seek(base + begin)
            yield name, FROM_ST[info["dtype"]], tuple(info["shape"]), f.read(end - begin)


def import_file(socket_path, job: str, path: Path, tag: str, prefix: str = "") -> dict:
    """Put every tensor of a safetensors file into ``job`` (keys ``prefix +
    name``) and commit them as ``tag``; returns the commit summary."""
    import torch

    import tierd
    from tierd.client.control import TORCH_DTYPES

    with tierd.connect(socket_path, job=job) as c:
        for name, dtype, shape, data in read_safetensors(path):
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
                torch.empty(0, dtype=torch.uint8)
            c.put(prefix + name, t.view(TORCH_DTYPES[dtype]).view(shape))
        return c.commit(tag)
