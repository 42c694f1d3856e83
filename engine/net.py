"""Rendezvous stores that listen only where they are told (127.0.0.1 by default).

torch's TCPStore server binds every interface (`*:port`) when it opens its own socket. pdserve
listens on loopback unless a user opts into another address, so the master side opens the
listening socket itself, bound to `host`, and hands its file descriptor to the store.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def create_store(
    host: str,
    port: int,
    world_size: int | None,
    is_master: bool,
    timeout_s: float,
    wait_for_workers: bool = True,
) -> dist.TCPStore:
    """A TCPStore client, or a server listening on (host, port) only; port 0 picks a free one
    (read it back from `store.port`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
        bound_port = int(sock.getsockname()[1])
    except BaseException:
        sock.close()
        raise
    # the store owns the descriptor from here on (detach: Python must not close it)
    return dist.TCPStore(
        host,
        bound_port,
        world_size,
        True,
        timeout=timeout,
        wait_for_workers=wait_for_workers,
        master_listen_fd=sock.detach(),
        use_libuv=True,
    )
