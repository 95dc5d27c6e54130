"""systemd readiness: ``READY=1`` to ``$NOTIFY_SOCKET`` once the daemon serves.

With ``Type=notify`` systemd starts the units ordered after tierd (and
``systemctl start`` returns) only when the daemon says it is ready, i.e.
when both sockets listen and jobs can connect. The protocol is one datagram
of ``KEY=VALUE`` lines on the Unix socket named by ``$NOTIFY_SOCKET`` (a
path, or ``@name`` for the abstract namespace); see sd_notify(3). Outside
systemd the variable is unset and nothing is sent.

>>> ready("serving at /run/tierd/tierd.sock")   # doctest: +SKIP
True
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("tierd.notify")


def notify(state: str, env: Mapping[str, str] = os.environ) -> bool:
    """Send ``state`` (``KEY=VALUE`` lines) to the service manager; False
    when there is none. A failure to send is logged, never raised: the
    daemon serves either way, and systemd reports the missing readiness."""
    address = env.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if env.get("SYSTEMD_EXEC_PID", str(os.getpid())) != str(os.getpid()):
        return False   # a child of the unit's main process (e.g. a job's embedded daemon)
    if address.startswith("@"):
        address = "\0" + address[1:]          # abstract socket namespace
    elif not address.startswith("/"):
        log.warning("NOTIFY_SOCKET=%s is neither a path nor @abstract; not notifying", address)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall(state.encode())
    except OSError as exc:
        log.warning("cannot notify the service manager at %s: %s", env["NOTIFY_SOCKET"], exc)
        return False
    return True


def ready(status: str, env: Mapping[str, str] = os.environ) -> bool:
    """``READY=1`` with a one-line ``STATUS`` (shown by ``systemctl status``)."""
    return notify(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}", env)
