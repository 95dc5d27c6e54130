"""The wire protocol: every message is a frozen dataclass, encoded here only.

Two channels connect a client to the daemon (see docs/architecture.md):

* the **control socket** (``<socket>.ctl``, a Unix stream socket): one per
  client session. The daemon reads the peer's pid and uid from the kernel
  (``SO_PEERCRED``), hands out a session token, and passes the memfd of each
  pool segment the session may map (``SCM_RIGHTS``). Its EOF ends the session
  on both sides: the daemon reclaims what the session held, the client learns
  that the daemon is gone.
* the **request socket** (ZeroMQ ROUTER at ``ipc://<socket>``): batched
  requests. The client's ZeroMQ routing id is its session token, so the
  daemon knows who sent a frame without trusting its content.

Frames are msgpack maps ``{"v": VERSION, "id": n, "op": name, "body": {...}}``;
replies are ``{"v", "id", "ok": true, "body"}`` or ``{"v", "id", "ok": false,
"error": [code, message]}``. Nothing is ever unpickled; every field is checked
for type and range before it reaches the daemon's logic, and tensor bytes
never travel in frames (they live in the shared pool).
"""

from __future__ import annotations

import dataclasses
import re
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from tierd.errors import ProtocolError

VERSION = 5   # 2: reserve's ``zero``; 3: demote; 4: a segment's ``populated``; 5: use_plan, use_at
MAX_FRAME_BYTES = 16 << 20
MAX_KEYS_PER_REQUEST = 1 << 16
MAX_KEY_LENGTH = 1024
MAX_DIMS = 16
MAX_TAG_LENGTH = 256
MAX_JOB_LENGTH = 128
# The kernel passes at most SCM_MAX_FD (253) descriptors in one message.
MAX_SEGMENTS_PER_MESSAGE = 253
# Job names the daemon gives sessions' own jobs; a client may not name one.
RESERVED_JOB_PREFIXES = ("pid-", "session-")
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=/-]*")

# dtype names on the wire; the client maps them to torch dtypes.
DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16",
          "int8", "uint8", "bool", "complex64", "complex128",
          "float8_e4m3fn", "float8_e5m2")


@dataclass(frozen=True)
class TensorSpec:
    """What a writer declares before it gets a slot: key, dtype, shape, size."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Placement:
    """Where a tensor's bytes are in the pool: segment id and byte offset."""

    key: str
    segment: int
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    version: int


# --------------------------------------------------------------- requests
@dataclass(frozen=True)
class Reserve:
    """Allocate pool slots for new versions of these keys (writer fills them);
    with ``zero`` the slots read zeros already (the writer may just publish)."""

    op: ClassVar[str] = "reserve"
    specs: tuple[TensorSpec, ...]
    zero: bool = False


@dataclass(frozen=True)
class Publish:
    """The reserved slots of these keys are filled: make them the readable version."""

    op: ClassVar[str] = "publish"
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Abort:
    """Give up reserved slots without publishing them."""

    op: ClassVar[str] = "abort"
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Lease:
    """Pin these keys in the pool (swapping in from NVMe as needed) and say where.

    A write lease is exclusive; releasing it with ``written`` makes the bytes
    the key's new version.
    """

    op: ClassVar[str] = "lease"
    keys: tuple[str, ...]
    write: bool = False


@dataclass(frozen=True)
class Release:
    op: ClassVar[str] = "release"
    keys: tuple[str, ...]
    written: bool = False


@dataclass(frozen=True)
class Prefetch:
    """Bring these keys into the pool in the background; the reply does not wait."""

    op: ClassVar[str] = "prefetch"
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Evict:
    """Write these keys to NVMe and free their pool slots; replies when done."""

    op: ClassVar[str] = "evict"
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Demote:
    """These keys are used again only after the job's others: when the pool
    needs room they leave first, the last demoted first ([Note: eviction by
    next use] in tierd.server.eviction)."""

    op: ClassVar[str] = "demote"
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Delete:
    op: ClassVar[str] = "delete"
    keys: tuple[str, ...]


@dataclass(frozen=True)
class DropJob:
    """Delete every tensor of the caller's job."""

    op: ClassVar[str] = "drop_job"


@dataclass(frozen=True)
class Keys:
    op: ClassVar[str] = "keys"
    prefix: str = ""


@dataclass(frozen=True)
class Stats:
    op: ClassVar[str] = "stats"


@dataclass(frozen=True)
class Commit:
    """Make every tensor of the caller's (named) job durable as one version
    tagged ``tag``; replies when the manifest is on disk."""

    op: ClassVar[str] = "commit"
    tag: str


@dataclass(frozen=True)
class Commits:
    """Tags of the caller's job's commits, oldest first (the last is restorable)."""

    op: ClassVar[str] = "commits"


@dataclass(frozen=True)
class ReportDevice:
    """The caller keeps ``resident_bytes`` of its job's tensors on its GPU
    between steps (placement); ``stats`` shows the sum per job."""

    op: ClassVar[str] = "report_device"
    resident_bytes: int


@dataclass(frozen=True)
class Expect:
    """The caller's job will store tensors of these byte sizes soon (a training
    job's first gradients and optimizer state): the daemon makes pool
    segments for them ahead ([Note: growth told ahead] in tierd.backends.hostpool)."""

    op: ClassVar[str] = "expect"
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class UsePlan:
    """The keys the caller's job uses at each position of a step of plan
    ``name`` (one per attached model), in order (a step repeats them);
    positions are then told by :class:`UseAt` ([Note: the job's access plan]
    in tierd.server.readahead). An empty plan forgets the one of that name."""

    op: ClassVar[str] = "use_plan"
    name: str
    positions: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class UseAt:
    """The caller's job uses position ``at`` of plan ``name`` now (counted
    from the plan's start across steps: step * len(plan) + index)."""

    op: ClassVar[str] = "use_at"
    name: str
    at: int


REQUESTS = {cls.op: cls for cls in (Reserve, Publish, Abort, Lease, Release, Prefetch,
                                    Evict, Demote, Delete, DropJob, Keys, Stats, Commit,
                                    Commits, ReportDevice, Expect, UsePlan, UseAt)}
Request = (Reserve | Publish | Abort | Lease | Release | Prefetch | Evict | Demote | Delete
           | DropJob | Keys | Stats | Commit | Commits | ReportDevice | Expect | UsePlan
           | UseAt)


# ----------------------------------------------------------------- replies
@dataclass(frozen=True)
class Placed:
    placements: tuple[Placement, ...]


@dataclass(frozen=True)
class Done:
    pass


@dataclass(frozen=True)
class KeyList:
    keys: tuple[str, ...]


@dataclass(frozen=True)
class StatsReply:
    stats: dict[str, Any]


@dataclass(frozen=True)
class Committed:
    """What a commit made durable: tag, seq, tensors, bytes, written_bytes."""

    info: dict[str, Any]


@dataclass(frozen=True)
class TagList:
    tags: tuple[str, ...]


Reply = Placed | Done | KeyList | StatsReply | Committed | TagList
_REPLIES = {"placed": Placed, "done": Done, "keylist": KeyList, "stats": StatsReply,
            "committed": Committed, "tags": TagList}
_REPLY_NAMES = {cls: name for name, cls in _REPLIES.items()}


# ------------------------------------------------------------- validation
def _fail(what: str) -> ProtocolError:
    return ProtocolError(f"malformed frame: {what}")


def _int(v: Any, name: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _fail(f"{name} must be an int in [{lo}, {hi}], got {v!r:.80}")
    return v


def _key(v: Any) -> str:
    if type(v) is not str or not 0 < len(v) <= MAX_KEY_LENGTH:
        raise _fail(f"a key must be a non-empty str of at most {MAX_KEY_LENGTH} "
                    f"characters, got {v!r:.80}")
    return v


def _list(v: Any, name: str) -> list:
    if type(v) is not list or len(v) > MAX_KEYS_PER_REQUEST:
        raise _fail(f"{name} must be a list of at most {MAX_KEYS_PER_REQUEST} items")
    return v


def _keys(v: Any) -> tuple[str, ...]:
    return tuple(_key(k) for k in _list(v, "keys"))


def _bool(v: Any, name: str) -> bool:
    if type(v) is not bool:
        raise _fail(f"{name} must be a bool, got {v!r:.80}")
    return v


def _dtype(v: Any) -> str:
    if v not in DTYPES:
        raise _fail(f"unknown dtype {v!r:.80}; known: {', '.join(DTYPES)}")
    return v


def _shape(v: Any) -> tuple[int, ...]:
    if type(v) is not list or len(v) > MAX_DIMS:
        raise _fail(f"shape must be a list of at most {MAX_DIMS} ints")
    return tuple(_int(d, "shape dim") for d in v)


def _spec(v: Any) -> TensorSpec:
    if type(v) is not list or len(v) != 4:
        raise _fail("a tensor spec is [key, dtype, shape, nbytes]")
    return TensorSpec(_key(v[0]), _dtype(v[1]), _shape(v[2]), _int(v[3], "nbytes"))


def _placement(v: Any) -> Placement:
    if type(v) is not list or len(v) != 7:
        raise _fail("a placement is [key, segment, offset, nbytes, dtype, shape, version]")
    return Placement(_key(v[0]), _int(v[1], "segment"), _int(v[2], "offset"),
                     _int(v[3], "nbytes"), _dtype(v[4]), _shape(v[5]), _int(v[6], "version"))


def _body(cls: type, body: dict) -> Any:
    match cls.op:
        case "reserve":
            return Reserve(tuple(_spec(s) for s in _list(body.get("specs"), "specs")),
                           _bool(body.get("zero", False), "zero"))
        case "lease":
            return Lease(_keys(body.get("keys")), _bool(body.get("write", False), "write"))
        case "release":
            return Release(_keys(body.get("keys")), _bool(body.get("written", False), "written"))
        case "keys":
            prefix = body.get("prefix", "")
            if type(prefix) is not str or len(prefix) > MAX_KEY_LENGTH:
                raise _fail("prefix must be a str")
            return Keys(prefix)
        case "stats":
            return Stats()
        case "drop_job":
            return DropJob()
        case "commits":
            return Commits()
        case "report_device":
            return ReportDevice(_int(body.get("resident_bytes"), "resident_bytes"))
        case "expect":
            return Expect(tuple(_int(n, "size") for n in _list(body.get("sizes"), "sizes")))
        case "use_plan":
            positions = tuple(_keys(keys) for keys in _list(body.get("positions"), "positions"))
            if sum(len(keys) for keys in positions) > MAX_KEYS_PER_REQUEST:
                raise _fail(f"a plan of more than {MAX_KEYS_PER_REQUEST} keys")
            return UsePlan(_key(body.get("name")), positions)
        case "use_at":
            return UseAt(_key(body.get("name")), _int(body.get("at"), "at"))
        case "commit":
            tag = body.get("tag")
            if type(tag) is not str or not 0 < len(tag) <= MAX_TAG_LENGTH:
                raise _fail(f"tag must be a non-empty str of at most {MAX_TAG_LENGTH} "
                            f"characters, got {tag!r:.80}")
            return Commit(tag)
        case _:
            return cls(_keys(body.get("keys")))


# ----------------------------------------------------------------- encode
def _to_wire(value: Any) -> Any:
    if isinstance(value, (TensorSpec, Placement)):
        return [_to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, tuple):
        return [_to_wire(v) for v in value]
    return value


def _fields(msg: Any) -> dict:
    return {f.name: _to_wire(getattr(msg, f.name)) for f in dataclasses.fields(msg)}


def encode_request(req_id: int, req: Request) -> bytes:
    """The frame of a request; ProtocolError (nothing sent) when it is larger
    than the daemon accepts, which would drop the connection instead."""
    frame = msgpack.packb({"v": VERSION, "id": req_id, "op": req.op, "body": _fields(req)})
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"a {req.op} request of {len(frame)} B exceeds the daemon's limit "
                            f"of {MAX_FRAME_BYTES} B per frame; split it into smaller batches")
    return frame


def encode_reply(req_id: int, reply: Reply) -> bytes:
    body = _fields(reply)
    return msgpack.packb({"v": VERSION, "id": req_id, "ok": True,
                          "kind": _REPLY_NAMES[type(reply)], "body": body})


def encode_error(req_id: int, code: str, message: str) -> bytes:
    return msgpack.packb({"v": VERSION, "id": req_id, "ok": False, "error": [code, message]})


# ----------------------------------------------------------------- decode
def _unpack(frame: bytes) -> dict:
    if len(frame) > MAX_FRAME_BYTES:
        raise _fail(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types for garbage input
        raise _fail(f"not msgpack ({type(exc).__name__})") from None
    if type(msg) is not dict:
        raise _fail("a frame must be a msgpack map")
    if msg.get("v") != VERSION:
        raise ProtocolError(f"protocol version {msg.get('v')!r:.20} is not supported "
                            f"(this side speaks {VERSION}); upgrade client and daemon together")
    return msg


def request_id(frame: bytes) -> int:
    """The request id of a frame, or 0 when even that cannot be read."""
    try:
        msg = msgpack.unpackb(frame[:MAX_FRAME_BYTES], raw=False)
        rid = msg.get("id") if type(msg) is dict else None
        return rid if type(rid) is int and 0 <= rid < 1 << 63 else 0
    except Exception:  # garbage frame: the error reply goes to id 0
        return 0


def decode_request(frame: bytes) -> tuple[int, Request]:
    msg = _unpack(frame)
    req_id = _int(msg.get("id"), "id", 0, (1 << 63) - 1)
    op = msg.get("op")
    cls = REQUESTS.get(op) if type(op) is str else None
    if cls is None:
        raise _fail(f"unknown op {msg.get('op')!r:.40}; known: {', '.join(REQUESTS)}")
    body = msg.get("body", {})
    if type(body) is not dict:
        raise _fail("body must be a map")
    return req_id, _body(cls, body)


def decode_reply(frame: bytes) -> tuple[int, Reply | tuple[str, str]]:
    """Returns (id, reply) or (id, (error code, message))."""
    msg = _unpack(frame)
    req_id = _int(msg.get("id"), "id", 0, (1 << 63) - 1)
    if msg.get("ok") is False:
        err = msg.get("error")
        if type(err) is not list or len(err) != 2 or not all(type(e) is str for e in err):
            raise _fail("error must be [code, message]")
        return req_id, (err[0], err[1])
    body = msg.get("body", {})
    match msg.get("kind"):
        case "placed":
            return req_id, Placed(tuple(_placement(p) for p in _list(body.get("placements"), "placements")))
        case "done":
            return req_id, Done()
        case "keylist":
            return req_id, KeyList(_keys(body.get("keys")))
        case "stats" if type(body.get("stats")) is dict:
            return req_id, StatsReply(body["stats"])
        case "committed" if type(body.get("info")) is dict:
            return req_id, Committed(body["info"])
        case "tags":
            tags = _list(body.get("tags"), "tags")
            if not all(type(t) is str for t in tags):
                raise _fail("tags must be strs")
            return req_id, TagList(tuple(tags))
        case other:
            raise _fail(f"unknown reply kind {other!r:.40}")


# ------------------------------------------------------- control socket
# Length-prefixed msgpack maps on a Unix stream socket.
CTL_HEADER = struct.Struct("!I")
MAX_CTL_BYTES = 1 << 20


def encode_ctl(msg: dict) -> bytes:
    data = msgpack.packb(msg)
    return CTL_HEADER.pack(len(data)) + data


def decode_ctl(data: bytes) -> dict:
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:  # see _unpack
        raise _fail("control message is not msgpack") from None
    if type(msg) is not dict:
        raise _fail("control message must be a map")
    return msg


def job_name(v: Any) -> str:
    """A job name a client may use, or ProtocolError naming the rule.

    Names reach file names and kernel objects, so they are short ASCII words:
    a letter or digit, then letters, digits and ``._:@+=/-``, at most
    MAX_JOB_LENGTH characters. ``pid-...`` and ``session-...`` are the
    daemon's names for sessions' own jobs and can be neither joined nor claimed.
    """
    if type(v) is not str or not 0 < len(v) <= MAX_JOB_LENGTH or not _JOB_NAME.fullmatch(v):
        raise ProtocolError(
            f"job name {v!r:.80} is not allowed: use 1-{MAX_JOB_LENGTH} characters, a letter "
            f"or digit first, then letters, digits and ._:@+=/- (e.g. 'run1')")
    if v.startswith(RESERVED_JOB_PREFIXES):
        raise ProtocolError(
            f"job name {v!r} is reserved ({' and '.join(p + '...' for p in RESERVED_JOB_PREFIXES)}"
            f" name sessions' own jobs, which only their session can use); pick another name")
    return v


def decode_hello(msg: dict) -> str | None:
    """The job a client's hello asks for (None: a job of the session's own)."""
    if msg.get("v") != VERSION or msg.get("op") != "hello":
        raise ProtocolError(f"bad hello; this daemon speaks protocol {VERSION}: "
                            f"{{'v': {VERSION}, 'op': 'hello', 'job': name or None}}")
    job = msg.get("job")
    return None if job is None else job_name(job)


def is_claim(msg: dict) -> bool:
    """Whether a control message claims the segments made for what the
    job expects (``{"claim": true}``: [Note: segments mapped ahead] in
    tierd.backends.hostpool) rather than asking for segments by id."""
    if "claim" not in msg:
        return False
    if msg["claim"] is not True or "segments" in msg:
        raise ProtocolError("expected {'claim': true} (and nothing else) or "
                            "{'segments': [segment ids]}")
    return True


def decode_segments(msg: dict) -> list[int]:
    """The segment ids a control message asks for (distinct, in order)."""
    ids = msg.get("segments")
    if type(ids) is not list:
        raise ProtocolError("expected {'segments': [segment ids]}")
    bad = [i for i in ids if not (type(i) is int and 0 < i < 1 << 62)]
    if bad:
        raise ProtocolError(f"segment ids are positive integers (from 1, below 2**62); got "
                            f"{bad[:5]!r}: ask only for ids that placements name")
    if len(ids) > MAX_SEGMENTS_PER_MESSAGE:
        raise ProtocolError(f"{len(ids)} segments asked in one message; the kernel passes at "
                            f"most {MAX_SEGMENTS_PER_MESSAGE} descriptors at once: ask in batches")
    return list(dict.fromkeys(ids))
