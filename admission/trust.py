"""Who may call what on a sidecar: the trust model, in one place.

- `/admit` and `/release` are the edge's. On the unix socket, its permissions are the boundary
  (`serve --socket-mode`, default 0660, `--socket-group`: NGINX's workers'); whoever can connect
  may name a tenant, exactly as NGINX does after checking the API key. Over TCP (the admin port)
  they are refused unless `serve --edge-over-tcp` says otherwise (benchmarks, tests).
- Node admin (`POST /nodes/{node}/drain|undrain`) changes what the cluster serves: it needs
  `Authorization: Bearer <admin token>` (`serve --admin-token-file`) on every transport where a
  token is configured; without one it is only accepted on the unix socket (whose group is
  NGINX's, and NGINX forwards nothing but the Batch API's own paths there).
- Everything else (`/healthz`, `/metrics`, `/nodes`, the status page) is read-only. On an admin
  port that listens beyond loopback (`serve --host`) the reads that show tenants, nodes and
  figures (`/metrics`, `/nodes`, `/status.json`) need the admin token too; `/healthz` stays
  open (load balancers) and so does the status page's HTML, which holds no figures: it takes
  the token from its URL's fragment (`/status#token=…`, never sent to a server nor logged).
- The admin port listens on loopback; another `--host` is refused without an admin token.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

from aiohttp import web

from admission.errors import Forbidden, Unauthorized


@dataclass(frozen=True)
class Access:
    edge_over_tcp: bool = False
    admin_token: str | None = None
    exposed: bool = False  # the admin port listens beyond loopback: reads need the token too

    def check_read(self, request: web.Request) -> None:
        """A read page: open on loopback and the unix socket; the admin token when exposed."""
        if self.exposed and over_tcp(request):
            self.check_admin(request)

    def check_edge(self, request: web.Request) -> None:
        if not self.edge_over_tcp and over_tcp(request):
            raise Forbidden(
                f"{request.path} is served to the edge on the unix socket only", code="edge_only"
            )

    def check_admin(self, request: web.Request) -> None:
        if not over_tcp(request) and self.admin_token is None:
            return
        if self.admin_token is None:
            raise Forbidden(
                "node admin over TCP needs an admin token (serve --admin-token-file)",
                code="admin_token_not_configured",
            )
        given = request.headers.get("Authorization", "")
        expected = f"Bearer {self.admin_token}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise Unauthorized("missing or wrong admin token", code="invalid_admin_token")


def over_tcp(request: web.Request) -> bool:
    # A TCP peer is (host, port[, …]); a unix-socket peer is '' or None.
    return isinstance(request.transport and request.transport.get_extra_info("peername"), tuple)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(path: str) -> str:
    """The admin token from a file (first line, stripped); ValueError when empty or short."""
    with open(path, encoding="utf-8") as f:
        token = f.readline().strip()
    if len(token) < 16:
        raise ValueError(f"admin token in {path} must be at least 16 characters")
    return token
