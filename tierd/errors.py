"""The errors tierd raises. Every message carries the values involved and the fix.

Errors cross the wire as ``(code, message)``; :func:`from_wire` turns a reply
back into the same class on the client, so a caller catches the same type
whether the failure happened in-process or in the daemon.
"""

from __future__ import annotations


class TierdError(Exception):
    """Base of every error tierd raises on purpose."""

    code = "tierd"


class CapacityError(TierdError):
    """The pool and NVMe tier together cannot hold what was asked for."""

    code = "capacity"


class ProtocolError(TierdError):
    """A frame was malformed, of an unknown version, or a request was invalid."""

    code = "protocol"


class IntegrityError(TierdError):
    """Bytes read back do not match what was written."""

    code = "integrity"


class DaemonUnavailable(TierdError):
    """No daemon answers at the socket, or it went away mid-request."""

    code = "unavailable"


class Busy(TierdError):
    """The daemon has too many requests in flight; retry later."""

    code = "busy"


class TierIOError(TierdError):
    """An NVMe read or write failed (EIO, ENOSPC, ...); stored data is untouched."""

    code = "io"


class StateError(TierdError):
    """A tensor was asked to do something its current state does not allow."""

    code = "state"


class AccessDenied(TierdError):
    """The daemon does not serve this user: it serves its own user, root and,
    when started with ``--group``, the members of that group."""

    code = "access"


class RankFailed(TierdError):
    """Another rank of a data-parallel job stopped (or a collective among the
    ranks failed); this rank cannot go on with the job."""

    code = "rank"


class InternalError(TierdError):
    """A bug in the daemon failed this one request; the daemon logged the
    traceback and goes on serving. Report it with the daemon's log."""

    code = "internal"


class UnknownKey(TierdError, KeyError):
    """No tensor is stored under this key (also a ``KeyError``)."""

    code = "key"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown key"


_BY_CODE = {cls.code: cls for cls in (TierdError, CapacityError, ProtocolError,
                                       IntegrityError, DaemonUnavailable, Busy,
                                       TierIOError, StateError, AccessDenied, RankFailed,
                                       InternalError, UnknownKey)}


def from_wire(code: str, message: str) -> TierdError:
    return _BY_CODE.get(code, TierdError)(message)
