"""A port for Serve's HTTP proxy, reserved so that no other program can take it first.

Ray 2.60's proxy binds whatever port it is given (0 included) but reports only the configured
number, so the port that ``port=0`` bound cannot be learnt. Instead a socket takes a free port from
the kernel with SO_REUSEPORT and keeps it bound (never listening): no other program can take the
port, while the proxy, which binds with SO_REUSEPORT too (``REUSE_PORT_ENV``, in the environment before
``ray.init`` so every Ray process inherits it), shares it and alone accepts.
"""

from __future__ import annotations

import socket

HOST = "127.0.0.1"
REUSE_PORT_ENV = {"SERVE_SOCKET_REUSE_PORT_ENABLED": "1"}  # Serve's proxy binds with SO_REUSEPORT


def reserve_port(host: str = HOST) -> socket.socket:
    """A socket holding a free port (``.getsockname()[1]``) that Serve's proxy can share; close it at the end."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, 0))
    return sock
