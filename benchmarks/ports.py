"""A TCP port for a spawned job's rank 0 to bind its store on (the benchmarks that spawn their own
ranks, and the tests' rank harness, ``tests/distributed.py``)."""

from __future__ import annotations

import random
import socket


def _ephemeral_ports() -> range:
    """The kernel's range for ports it hands out itself (Linux's default where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


_TORCH_DEFAULT_PORTS = range(29400, 29600)  # torchrun's and torch's own defaults


def free_port() -> int:
    """A TCP port free on every address now, for a rank 0 to bind its store on later.

    Not ``bind(("", 0))``: that draws from the kernel's ephemeral range, the range every gloo
    pair's listening socket and every outgoing connection on this machine draws from too. Between
    this call and rank 0's bind (seconds later, after a recipe's setup) another test worker's gloo
    traffic took such a port (CI, 2026-12-07: ``EADDRINUSE`` on 37177). A random port below that
    range, checked free, is one nothing else on the machine is handed by chance."""
    ephemeral = _ephemeral_ports()
    candidates = [p for p in range(10000, ephemeral.start) if p not in _TORCH_DEFAULT_PORTS]
    for port in random.SystemRandom().sample(candidates, min(64, len(candidates))):
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # a machine whose ephemeral range starts low: the kernel's
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
