"""The rendezvous store's server side and its keys (shared by the rendezvous process, the mesh and `DataPlane`)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

JOINS = "mesh/joins"  # the join log, "rank:token;" per join and "rank:-;" per leave (see mesh.py)


def serve_store(host: str, port: int, timeout: timedelta = timedelta(seconds=60)) -> dist.TCPStore:
    """A TCPStore server listening on `host` only (torch's own would listen on every interface)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the listening socket from here on
    return dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False, master_listen_fd=fd)
