"""Hosts as Linux network namespaces, for tests/test_multihost.py.

A test builds a small network of its own: a "switch" namespace holding a Linux bridge, one
namespace per host joined to it by a veth pair, each host with an address in a private subnet
that exists only inside these namespaces. Every device is created directly inside a namespace of
the test, so the machine's own network is never touched and no packet leaves. Processes run "on"
a host through `ip netns exec` and `unshare --uts` (each host has its own hostname, which genq's
worker names and the collector's lease carry).

- cut(host) sets the host's port on the bridge down: its packets vanish, its connections stay
  open and resume when restore(host) sets it up again (TCP retransmits), as across a real
  partition; a new connection fails once ARP gives up, as on a real L2 segment.
- attach(host, name) gives a host a private link to a namespace of its own (an inference server
  in its own network namespace on that host); cut(that one) cuts that link alone.
- Wan routes chosen pairs of hosts through a router namespace, where tests/netem.py delays, drops,
  cuts and counts their packets (kernel netem does the delay and loss where the kernel has it).

Names are ``gq<pid>-<n>-<host>``: sweep() removes what a killed earlier session left, and
Net.close() removes everything a test made, processes first.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from urllib.parse import urlsplit

import redis

REPO = Path(__file__).resolve().parent.parent
NETEM = Path(__file__).resolve().parent / "netem.py"
PREFIX = "gq"
_NAME = re.compile(rf"^{PREFIX}(\d+)-\d+-")
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_nets = count(1)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2, util-linux)"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (the userspace netem needs TUN)"
    probe = f"{PREFIX}{os.getpid()}-0-probe"
    res = ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"`ip netns add` fails: {res.stderr.strip()}"
    try:
        res = ip("-n", probe, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb", check=False)
        if res.returncode != 0:
            return f"veth pairs cannot be made: {res.stderr.strip()}"
        res = ip("-n", probe, "link", "add", "name", "br", "type", "bridge", check=False)
        if res.returncode != 0:
            return f"bridges cannot be made: {res.stderr.strip()}"
    finally:
        ip("netns", "del", probe, check=False)
    return None


def kernel_netem() -> bool:
    """Whether `tc qdisc ... netem` works here (probed in a scratch namespace)."""
    if shutil.which("tc") is None:
        return False
    probe = f"{PREFIX}{os.getpid()}-0-netem"
    ip("netns", "add", probe)
    try:
        res = subprocess.run(
            ["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
            capture_output=True,
            timeout=30,
        )
        return res.returncode == 0
    finally:
        ip("netns", "del", probe, check=False)


def _kill_inside(ns: str) -> None:
    res = ip("netns", "pids", ns, check=False)
    for pid in res.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def sweep() -> list[str]:
    """Remove the namespaces (and what still runs in them) of earlier sessions that are gone."""
    removed = []
    for line in ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if not m or int(m.group(1)) == os.getpid() or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        _kill_inside(name)
        ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


@contextlib.contextmanager
def in_netns(ns: str) -> Iterator[None]:
    """Run the block (this thread only) in namespace ``ns``: a socket made there stays there."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(target, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {ns}: {os.strerror(err)}")
        try:
            yield
        finally:
            if _libc.setns(own, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the test's own namespace")
    finally:
        os.close(own)
        os.close(target)


class _NsConnection(redis.Connection):
    """A redis-py connection whose sockets are made inside a host's namespace."""

    def __init__(self, *args, netns: str, **kwargs) -> None:
        self._netns = netns
        super().__init__(*args, **kwargs)

    def _connect(self):
        with in_netns(self._netns):
            return super()._connect()


class Host:
    def __init__(self, name: str, ns: str, addr: str, port: tuple[str, str]) -> None:
        self.name = name
        self.ns = ns
        self.addr = addr
        self.port = port  # (namespace, device) whose link state cuts this host off

    def __repr__(self) -> str:
        return f"Host({self.name} {self.addr})"


class Net:
    """One test's network. Use as a context manager, or call close() (it never raises)."""

    def __init__(self, logs: Path) -> None:
        self.id = next(_nets)
        self.tag = f"{PREFIX}{os.getpid()}-{self.id}"
        self.octet = 20 + (os.getpid() + self.id) % 200  # 10.213.<octet>.0/24, inside the namespaces only
        self.subnet = f"10.213.{self.octet}.0/25"  # the bridge; .128/25 holds the private links
        self.logs = logs
        self.hosts: dict[str, Host] = {}
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self._links = 0
        self.switch = self._namespace("switch")
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")

    def __enter__(self) -> Net:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _namespace(self, name: str) -> str:
        ns = f"{self.tag}-{name}"
        ip("netns", "add", ns)
        self.namespaces.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")
        # A host takes no redirect: a pair routed through the Wan must stay routed through it.
        self.sysctl(ns, "net.ipv4.conf.all.accept_redirects", "0")
        self.sysctl(ns, "net.ipv4.conf.default.accept_redirects", "0")
        return ns

    @staticmethod
    def sysctl(ns: str, key: str, value: str) -> None:
        path = "/proc/sys/" + key.replace(".", "/")
        subprocess.run(
            ["ip", "netns", "exec", ns, "sh", "-c", f"echo {value} > {path}"], check=True, timeout=30
        )

    def host(self, name: str) -> Host:
        """A host on the switch."""
        ns = self._namespace(name)
        n = len([h for h in self.hosts.values() if h.port[0] == self.switch]) + 2
        addr = f"10.213.{self.octet}.{n}"
        port = f"p{n}"
        ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("-n", self.switch, "link", "set", port, "master", "br0")
        ip("-n", self.switch, "link", "set", port, "up")
        ip("-n", ns, "addr", "add", f"{addr}/25", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        self.hosts[name] = Host(name, ns, addr, (self.switch, port))
        return self.hosts[name]

    def attach(self, owner: Host, name: str) -> Host:
        """A namespace reachable only from ``owner``, over a private /30 link (an inference server
        in a network namespace of its own on that host)."""
        ns = self._namespace(name)
        base = 128 + 4 * self._links
        self._links += 1
        near, far = f"10.213.{self.octet}.{base + 1}", f"10.213.{self.octet}.{base + 2}"
        dev = f"l{self._links}"
        ip("-n", owner.ns, "link", "add", dev, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("-n", owner.ns, "addr", "add", f"{near}/30", "dev", dev)
        ip("-n", owner.ns, "link", "set", dev, "up")
        ip("-n", ns, "addr", "add", f"{far}/30", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        # Cutting sets the far end down: the owner keeps its route and its packets just vanish.
        self.hosts[name] = Host(name, ns, far, (ns, "eth0"))
        return self.hosts[name]

    # -- partitions ---------------------------------------------------------------------------

    def cut(self, host: Host) -> None:
        ip("-n", host.port[0], "link", "set", host.port[1], "down")

    def restore(self, host: Host) -> None:
        ip("-n", host.port[0], "link", "set", host.port[1], "up")

    # -- processes ----------------------------------------------------------------------------

    def argv(self, host: Host, argv: list[str]) -> list[str]:
        return [
            "ip", "netns", "exec", host.ns, "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec "$@"', host.name, *map(str, argv),
        ]  # fmt: skip

    def start(
        self, host: Host, argv: list[str], name: str, env: dict[str, str] | None = None, **kwargs
    ) -> subprocess.Popen:
        """Start ``argv`` on ``host``; its output goes to logs/<name>.log (``proc.log_path``)."""
        log = self.logs / f"{name}.log"
        with open(log, "ab") as fh:
            # A process that answers on stdout (tests/netem.py) still logs its stderr to the file.
            stdout = kwargs.pop("stdout", fh)
            stderr = subprocess.STDOUT if stdout is fh else fh
            proc = subprocess.Popen(
                self.argv(host, argv),
                env={**os.environ, **(env or {})},
                stdout=stdout,
                stderr=stderr,
                cwd=REPO,
                **kwargs,
            )
        proc.log_path = log  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def run(
        self, host: Host, argv: list[str], env: dict[str, str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.argv(host, argv),
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )

    # -- the test's own view from a host ------------------------------------------------------

    def redis(self, host: Host, url: str) -> redis.Redis:
        """A client of ``url`` whose connections are made from ``host``."""
        parts = urlsplit(url)
        pool = redis.ConnectionPool(
            connection_class=_NsConnection,
            netns=host.ns,
            host=parts.hostname,
            port=parts.port or 6379,
            db=int(parts.path.strip("/") or 0),
            socket_connect_timeout=5,
            socket_timeout=30,
        )
        return redis.Redis(connection_pool=pool)

    def socket(self, host: Host, addr: str, port: int, timeout: float = 10) -> socket.socket:
        """A TCP connection from ``host`` to ``addr:port``."""
        with in_netns(host.ns):
            return socket.create_connection((addr, port), timeout=timeout)

    def http_json(self, host: Host, url: str, timeout: float = 10) -> dict:
        """GET ``url`` from ``host``; the JSON body."""
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        try:
            with in_netns(host.ns):
                conn.connect()
            conn.request("GET", parts.path or "/")
            resp = conn.getresponse()
            return json.loads(resp.read())
        finally:
            conn.close()

    # -- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Kill what runs on the hosts, then remove every namespace (and so every link) made."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        for ns in reversed(self.namespaces):
            _kill_inside(ns)
            ip("netns", "del", ns, check=False)
        self.namespaces.clear()


class Wan:
    """A router host that pairs of hosts are routed through (tests/netem.py runs there)."""

    TABLE = "100"

    def __init__(self, net: Net, name: str = "wan", kernel: bool | None = None) -> None:
        self.net = net
        self.host = net.host(name)
        ns = self.host.ns
        self.kernel = kernel_netem() if kernel is None else kernel
        for key in ("all", "default", "eth0"):
            net.sysctl(ns, f"net.ipv4.conf.{key}.rp_filter", "0")
            net.sysctl(ns, f"net.ipv4.conf.{key}.send_redirects", "0")
        net.sysctl(ns, "net.ipv4.ip_forward", "1")
        self.proc = net.start(
            self.host,
            [sys.executable, str(NETEM), "--dev", "wan0"],
            "netem",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = json.loads(self.proc.stdout.readline() or "{}")  # type: ignore[union-attr]
        if not ready.get("ready"):
            raise RuntimeError(f"tests/netem.py did not start: {self.proc.log_path.read_text()}")  # type: ignore[attr-defined]
        net.sysctl(ns, "net.ipv4.conf.wan0.rp_filter", "0")
        ip("-n", ns, "link", "set", "wan0", "up")
        # What comes back out of the TUN goes on to its destination, on the bridge.
        ip("-n", ns, "rule", "add", "iif", "wan0", "lookup", self.TABLE, "pref", "100")
        ip("-n", ns, "route", "add", net.subnet, "dev", "eth0", "table", self.TABLE)
        self.routed: set[str] = set()

    def route(self, a: Host, b: Host) -> None:
        """Send the packets between ``a`` and ``b`` (both ways) through this router."""
        for host in (a, b):
            if host.addr not in self.routed:
                ip("-n", self.host.ns, "route", "replace", f"{host.addr}/32", "dev", "wan0")
                self.routed.add(host.addr)
        ip("-n", a.ns, "route", "replace", f"{b.addr}/32", "via", self.host.addr)
        ip("-n", b.ns, "route", "replace", f"{a.addr}/32", "via", self.host.addr)

    def command(self, **msg) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline() or "{}")
        if not answer.get("ok"):
            raise RuntimeError(f"netem {msg}: {answer or self.proc.log_path.read_text()}")  # type: ignore[attr-defined]
        return answer

    def impair(self, delay_ms: float, loss: float) -> None:
        """Delay every routed packet ``delay_ms`` and drop ``loss`` of them, in each direction:
        with the kernel's netem where it has it (on the router's way out), else tests/netem.py."""
        if self.kernel:
            if delay_ms or loss:
                subprocess.run(
                    ["tc", "-n", self.host.ns, "qdisc", "replace", "dev", "eth0", "root", "netem",
                     "delay", f"{delay_ms}ms", "loss", f"{loss * 100}%"],
                    check=True, timeout=30,
                )  # fmt: skip
            else:
                subprocess.run(["tc", "-n", self.host.ns, "qdisc", "del", "dev", "eth0", "root"], timeout=30)
            return
        self.command(cmd="impair", delay_ms=delay_ms, loss=loss)

    def stats(self) -> dict:
        return self.command(cmd="stats")

    def pair_stats(self, a: Host, b: Host) -> dict[str, int]:
        key = "-".join(sorted((a.addr, b.addr)))
        return self.stats()["pairs"].get(key, {"packets": 0, "dropped": 0, "round_trips": 0, "cut_drops": 0})
