"""A userspace netem: delays, drops and cuts the IP packets of chosen host pairs (tests/netns.py).

Why it exists: the kernel of this project's machines and of CI is built without sch_netem
(CONFIG_NET_SCH_NETEM is not set, and there is no module to load), so `tc qdisc ... netem` is not
available there; /dev/net/tun is. Where the kernel has netem, tests/netns.py applies the delay and
loss with it instead and this program only forwards, counts and cuts.

How: it runs inside a router namespace and owns a TUN device there. Routes send the packets of
the host pairs under test through that namespace and into the TUN (`ip route add <host>/32 dev
<tun>` there, `via <router>` on the hosts); this program reads each IP packet, drops it with
probability LOSS, otherwise holds it DELAY and writes it back into the TUN, from where policy
routing (`ip rule add iif <tun> lookup <table>`) forwards it on to its destination. So TCP sees
real loss and delay — it retransmits, its RTT estimate grows — not a proxy's. The delay is the
same for every packet, which keeps their order, as netem's does; it applies to each direction
(50 ms each way makes the 100 ms of round trip that `netem delay 100ms` on one side's egress
gives), and so does the loss.

It also cuts a pair (drops all its packets, both ways) on command, or arms a cut that falls
between a client's request and the server's reply, so the client is left holding what it read
just before (the collector test); and it counts, per pair, the packets, the drops and the round
trips: a client's TCP payload following the server's payload on one connection (a pipeline of many
commands is one round trip, however many segments it takes).

Control: one JSON object a line on stdin, one answer a line on stdout; it exits when stdin closes.
Run: ``python tests/netem.py --dev wan0`` (root, inside the router namespace).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import heapq
import json
import os
import random
import selectors
import socket
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
SYN, ACK = 0x02, 0x10


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class Router:
    def __init__(self, tun: int, seed: int) -> None:
        self.tun = tun
        self.random = random.Random(seed)
        self.delay = 0.0
        self.loss = 0.0
        self.cut: set[frozenset[str]] = set()
        # pair -> {"client", "server", "marker", "stage"}: a cut armed to fall after a reply
        self.arms: dict[frozenset[str], dict] = {}
        self.stats: dict[frozenset[str], dict[str, int]] = {}
        self.clients: dict[tuple, tuple[str, int]] = {}  # connection -> the endpoint that opened it
        self.last_sender: dict[tuple, tuple[str, int]] = {}  # connection -> who sent payload last
        self.queue: list[tuple[float, int, bytes]] = []
        self.last_release = 0.0
        self.seq = 0

    # -- packets ------------------------------------------------------------------------------

    def packet(self, pkt: bytes) -> None:
        if len(pkt) < 20 or pkt[0] >> 4 != 4:
            return self.forward(pkt)  # not IPv4: nothing of ours
        src, dst = socket.inet_ntoa(pkt[12:16]), socket.inet_ntoa(pkt[16:20])
        pair = frozenset((src, dst))
        st = self.stats.setdefault(pair, {"packets": 0, "dropped": 0, "round_trips": 0, "cut_drops": 0})
        st["packets"] += 1
        tcp = self.tcp(pkt)
        if pair in self.cut:
            st["cut_drops"] += 1
            return
        arm = self.arms.get(pair)
        if arm is not None and tcp is not None and tcp[3] and self.arm_step(arm, src, tcp[3]):
            self.cut.add(pair)
            st["cut_drops"] += 1
            return
        if self.loss and self.random.random() < self.loss:
            st["dropped"] += 1
            return
        if tcp is not None:
            self.count(st, src, dst, tcp)
        self.forward(pkt)

    @staticmethod
    def tcp(pkt: bytes) -> tuple[int, int, int, bytes] | None:
        """(source port, destination port, flags, payload) of a TCP packet."""
        if pkt[9] != 6:
            return None
        ihl = (pkt[0] & 15) * 4
        total = struct.unpack("!H", pkt[2:4])[0]
        if len(pkt) < ihl + 20:
            return None
        sport, dport = struct.unpack("!HH", pkt[ihl : ihl + 4])
        doff = (pkt[ihl + 12] >> 4) * 4
        return sport, dport, pkt[ihl + 13], pkt[ihl + doff : total]

    def count(self, st: dict[str, int], src: str, dst: str, tcp: tuple[int, int, int, bytes]) -> None:
        sport, dport, flags, payload = tcp
        me, peer = (src, sport), (dst, dport)
        conn = (min(me, peer), max(me, peer))
        if flags & SYN and not flags & ACK:
            self.clients[conn] = me
        if not payload:
            return
        # A connection opened before it was routed here: its client is the ephemeral port.
        client = self.clients.setdefault(conn, me if sport > dport else peer)
        if me == client and self.last_sender.get(conn) != me:
            st["round_trips"] += 1
        self.last_sender[conn] = me

    @staticmethod
    def arm_step(arm: dict, src: str, payload: bytes) -> bool:
        """Advance an armed cut; True when it falls (on the server's first reply to the request
        the client sent after reading a reply that held the marker at least ``times`` times)."""
        stage = arm["stage"]
        if stage == "armed" and src == arm["client"]:
            arm["seen"] = 0  # a new request: count the marker in its reply afresh
        elif stage == "armed" and src == arm["server"]:
            arm["seen"] += payload.count(arm["marker"])
            if arm["seen"] >= arm["times"]:
                arm["stage"] = "primed"
        elif stage == "primed" and src == arm["client"]:
            arm["stage"] = "asked"
        elif stage == "asked" and src == arm["server"]:
            arm["stage"] = "cut"
            arm["at"] = time.time()
            return True
        return False

    def forward(self, pkt: bytes) -> None:
        now = time.monotonic()
        if not self.delay and not self.queue:
            self.write(pkt)
            return
        # Never before a packet already waiting: a constant delay keeps the order.
        release = max(now + self.delay, self.last_release)
        self.last_release = release
        self.seq += 1
        heapq.heappush(self.queue, (release, self.seq, pkt))

    def release_due(self) -> float | None:
        """Write what is due; returns seconds until the next packet is, or None."""
        now = time.monotonic()
        while self.queue and self.queue[0][0] <= now:
            self.write(heapq.heappop(self.queue)[2])
        return max(0.0, self.queue[0][0] - now) if self.queue else None

    def write(self, pkt: bytes) -> None:
        with contextlib.suppress(OSError):  # the stack refused it (no route any more): lost, as on a wire
            os.write(self.tun, pkt)

    # -- control ------------------------------------------------------------------------------

    def command(self, msg: dict) -> dict:
        cmd = msg["cmd"]
        if cmd == "impair":
            self.delay, self.loss = msg["delay_ms"] / 1000.0, float(msg["loss"])
        elif cmd == "cut":
            self.cut.add(frozenset((msg["a"], msg["b"])))
        elif cmd == "restore":
            pair = frozenset((msg["a"], msg["b"]))
            self.cut.discard(pair)
            self.arms.pop(pair, None)
        elif cmd == "arm":
            pair = frozenset((msg["client"], msg["server"]))
            self.arms[pair] = {
                "client": msg["client"],
                "server": msg["server"],
                "marker": msg["marker"].encode(),
                "times": int(msg.get("times", 1)),
                "seen": 0,
                "stage": "armed",
            }
        elif cmd != "stats":
            return {"ok": False, "error": f"unknown command {cmd!r}"}
        return {
            "ok": True,
            "delay_ms": self.delay * 1000,
            "loss": self.loss,
            "cut": sorted("-".join(sorted(p)) for p in self.cut),
            "arms": {
                "-".join(sorted(p)): {k: v for k, v in a.items() if k != "marker"}
                for p, a in self.arms.items()
            },
            "pairs": {"-".join(sorted(p)): dict(s) for p, s in self.stats.items()},
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dev", required=True, help="TUN device to create and serve")
    parser.add_argument("--seed", type=int, default=0, help="seed of the loss")
    args = parser.parse_args()
    tun = open_tun(args.dev)
    router = Router(tun, args.seed)
    sel = selectors.DefaultSelector()
    sel.register(tun, selectors.EVENT_READ, "tun")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "control")
    os.set_blocking(sys.stdin.fileno(), False)
    pending = b""
    print(json.dumps({"ok": True, "ready": args.dev}), flush=True)
    while True:
        for key, _ in sel.select(router.release_due()):
            if key.data == "tun":
                for _ in range(256):  # read what is there, then let due packets out
                    try:
                        pkt = os.read(tun, 65536)
                    except BlockingIOError:
                        break
                    router.packet(pkt)
                continue
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                return  # the test is done with us
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if line.strip():
                    print(json.dumps(router.command(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
