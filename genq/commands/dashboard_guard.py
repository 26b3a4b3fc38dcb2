"""What `genq dashboard` checks before any view runs: the Host it is called by, basic auth, and
that a request that changes something is a POST from the dashboard's own pages.

- **Host** (DNS rebinding: a web page whose name resolves to this host reaches the dashboard from
  the operator's browser): the name in the ``Host`` header, any port, must be the bind address,
  a loopback name, or one given with ``--allow-host``; anything else gets 400.
- **State changes** (CSRF: any web page can make the browser send a GET, or a form POST): only
  POST, and only with an ``Origin`` (else ``Referer``) naming the host the request came to; GET
  gets 405, a foreign or missing origin 403. Browsers send ``Origin`` with every POST, so
  rq-dashboard's buttons (``$.post`` in its scripts/*.js) pass.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from flask import Response, jsonify, request

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def allowed_names(bind: str, extra: Iterable[str]) -> frozenset[str]:
    """Host names (lowercase, IPv6 in brackets as in a Host header) the dashboard answers to."""
    return frozenset(_host_form(name) for name in (bind, *LOOPBACK_NAMES, *extra) if name)


def _host_form(name: str) -> str:
    """As the name appears in a Host header: an IPv6 address in brackets, a port dropped."""
    name = name.strip().lower()
    try:
        return f"[{name}]" if ipaddress.ip_address(name).version == 6 else name
    except ValueError:
        return _name_of(name)


def _name_of(host: str) -> str:
    """``example.org:9181`` -> ``example.org``; ``[::1]:9181`` -> ``[::1]``."""
    host = host.lower()
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.rpartition(":")[0] if ":" in host else host


def check_host(names: frozenset[str]) -> Callable[[], Response | None]:
    def check() -> Response | None:
        if _name_of(request.host) in names:
            return None
        return Response(
            f"genq dashboard: not served to Host {request.host!r} (add it with --allow-host)\n", 400
        )

    return check


def check_state_change(endpoints: frozenset[str]) -> Callable[[], Response | tuple[Response, int] | None]:
    """POST only, from a page of this dashboard (its Origin, or Referer, is the Host it called)."""

    def check() -> Response | tuple[Response, int] | None:
        if request.endpoint not in endpoints:
            return None
        if request.method != "POST":
            return Response("genq dashboard: POST only\n", 405, {"Allow": "POST"})
        origin = request.headers.get("Origin") or request.headers.get("Referer") or ""
        if urlsplit(origin).netloc.lower() != request.host.lower():
            message = f"cross-site request refused (Origin {origin!r}, Host {request.host!r})"
            return jsonify(status="REFUSED", message=message), 403
        return None

    return check


def basic_auth(username: str, password: str) -> Callable[[], Response | None]:
    def check() -> Response | None:
        auth = request.authorization
        ok = (
            auth is not None
            and hmac.compare_digest((auth.username or "").encode(), username.encode())
            and hmac.compare_digest((auth.password or "").encode(), password.encode())
        )
        if ok:
            return None
        return Response("genq dashboard: log in", 401, {"WWW-Authenticate": 'Basic realm="genq"'})

    return check
