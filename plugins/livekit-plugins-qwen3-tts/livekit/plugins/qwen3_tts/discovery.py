"""Engines behind one name: an `http://` URL whose host name resolves to several addresses (a
Kubernetes headless Service, a compose service with replicas) stands for one engine per address.

A resolver is any `async (host, port) -> addresses` callable (the default asks the system's
resolver through asyncio's `getaddrinfo`), so a service registry or SRV records can stand in.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses `getaddrinfo` gives for `host`, in its order, without repeats: IPv4 ones
    when there are any (a name such as localhost that also has ::1 would otherwise count an
    engine twice, once on an address it does not listen on), else IPv6."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    v4 = [a for a in addresses if ":" not in a]
    return v4 or addresses


@dataclass(frozen=True)
class Target:
    """One configured URL."""

    url: str  # as configured, without a trailing slash
    scheme: str
    host: str
    port: int | None
    rest: str  # the path after host:port ("" or "/prefix")

    @classmethod
    def parse(cls, url: str) -> Target:
        url = url.strip().rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"a TTS base_url must be an http:// or https:// URL, not {url!r}")
        try:
            port = parts.port
        except ValueError as e:
            raise ValueError(f"TTS base_url {url!r}: {e}") from None
        return cls(url, parts.scheme, parts.hostname, port, parts.path)

    @property
    def resolvable(self) -> bool:
        """A host name over plain HTTP. An address is itself; behind TLS the name must stay (the
        certificate is the name's), so an https:// URL is one endpoint."""
        if self.scheme != "http":
            return False
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return True
        return False

    @property
    def default_port(self) -> int:
        return self.port or (443 if self.scheme == "https" else 80)

    def at(self, address: str) -> str:
        """The URL with `address` in place of the host name."""
        host = f"[{address}]" if ":" in address else address
        port = f":{self.port}" if self.port else ""
        return f"{self.scheme}://{host}{port}{self.rest}"
