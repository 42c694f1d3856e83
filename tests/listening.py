"""Which TCP addresses given processes listen on, read from /proc (no tool needed)."""

from __future__ import annotations

import os
import socket
import struct


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return inodes
    for name in names:
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _decode(address: str, v6: bool) -> str:
    host_hex, port_hex = address.split(":")
    port = int(port_hex, 16)
    raw = bytes.fromhex(host_hex)
    if v6:
        words = struct.unpack("<4I", raw)
        host = socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))
        return f"[{host}]:{port}"
    return f"{socket.inet_ntoa(struct.pack('<I', int(host_hex, 16)))}:{port}"


def listening_addresses(pids: list[int]) -> list[str]:
    """'host:port' of every listening TCP socket owned by any of `pids`."""
    inodes: set[str] = set()
    for pid in pids:
        inodes |= _socket_inodes(pid)
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                    found.append(_decode(fields[1], v6))
    return found


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    host = host.removeprefix("::ffff:")  # an IPv4 address mapped into IPv6
    return host.startswith("127.") or host == "::1"
