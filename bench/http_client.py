"""What an HTTP client of genq's own would save: CPU per request of aiohttp as genq's ``Http`` uses
it, of aiohttp with its per-request extras off, and of a bare asyncio protocol, side by side.

    python bench/http_client.py                  # 4,000 requests, 64 in flight, 3 rounds (~1 minute)

Each variant sends the same SGLang ``/generate`` bodies (39 prompt ids, 16 new tokens) to one
zero-latency simulator (a process of its own, so its CPU is not counted) over keep-alive
connections and parses every answer's JSON; the number is this process's CPU time per request,
after 200 requests of warm-up. The bare protocol speaks only what this simulator answers
(Content-Length bodies): it is the floor under any client, not a client genq could ship. Rounds
alternate the variants (ABCABC...), the spread is reported. Results go to
bench/results/http_client.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import orjson
import yarl
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine  # noqa: E402
from bench.throughput import console  # noqa: E402
from genq.commands.processes import genq_command, spawn, wait_for_line  # noqa: E402

BODY = {"input_ids": list(range(1, 40)), "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
Send = Callable[[dict], Awaitable[None]]


async def cpu_per_request(send: Send, n: int, in_flight: int) -> float:
    """ms of this process's CPU per request, ``n`` requests ``in_flight`` at a time, after a warm-up."""
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        async with gate:
            await send({**BODY, "rid": f"r{i}"})

    await asyncio.gather(*(one(i) for i in range(200)))
    started = time.process_time()
    await asyncio.gather(*(one(i) for i in range(n)))
    return 1000 * (time.process_time() - started) / n


async def aiohttp_as_genq(url: str, n: int, in_flight: int) -> float:
    """genq/backends/base.py Http.call: a session with a bounded pool, a timeout per request."""
    connector = aiohttp.TCPConnector(limit=in_flight, keepalive_timeout=4)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=15)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def send(body: dict) -> None:
            async with asyncio.timeout(60):
                headers = {"Content-Type": "application/json"}
                async with session.post(url + "/generate", data=orjson.dumps(body), headers=headers) as r:
                    orjson.loads(await r.read())

        return await cpu_per_request(send, n, in_flight)


async def aiohttp_lean(url: str, n: int, in_flight: int) -> float:
    """The same without cookies, decompression, automatic headers or parsing the URL each time."""
    connector = aiohttp.TCPConnector(limit=in_flight, keepalive_timeout=4)
    async with aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=15),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
    ) as session:
        target = yarl.URL(url + "/generate")

        async def send(body: dict) -> None:
            async with asyncio.timeout(60):
                headers = {"Content-Type": "application/json"}
                async with session.post(target, data=orjson.dumps(body), headers=headers) as r:
                    orjson.loads(await r.read())

        return await cpu_per_request(send, n, in_flight)


class _Connection(asyncio.Protocol):
    """One keep-alive connection that reads Content-Length answers, one request at a time."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.answer: asyncio.Future[bytes] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(ConnectionError("closed"))

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.answer is None:
            return
        length = next(
            int(value)
            for name, _, value in (
                line.partition(b":") for line in bytes(self.buffer[:end]).split(b"\r\n")[1:]
            )
            if name.strip().lower() == b"content-length"
        )
        if len(self.buffer) >= end + 4 + length:
            body = bytes(self.buffer[end + 4 : end + 4 + length])
            del self.buffer[: end + 4 + length]
            self.answer.set_result(body)

    async def request(self, raw: bytes) -> bytes:
        assert self.transport is not None
        self.answer = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.answer


async def bare_protocol(url: str, n: int, in_flight: int) -> float:
    """The floor: a request's bytes written by hand, its answer found by Content-Length."""
    where = yarl.URL(url)
    assert where.host is not None and where.port is not None
    idle: list[_Connection] = []
    head = f"POST /generate HTTP/1.1\r\nHost: {where.host}:{where.port}\r\nContent-Type: application/json\r\n"

    async def send(body: dict) -> None:
        async with asyncio.timeout(60):
            if idle:
                connection = idle.pop()
            else:
                _, connection = await asyncio.get_running_loop().create_connection(
                    _Connection, where.host, where.port
                )
            data = orjson.dumps(body)
            orjson.loads(
                await connection.request(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
            )
            idle.append(connection)

    return await cpu_per_request(send, n, in_flight)


VARIANTS = {
    "aiohttp as genq uses it": aiohttp_as_genq,
    "aiohttp, extras off": aiohttp_lean,
    "bare protocol": bare_protocol,
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    argv = genq_command(
        "sim-server", "--port", "0", "--latency", "zero", "--min-len", "16", "--max-len", "16"
    )
    sim = spawn(argv, stdout=subprocess.PIPE)
    try:
        url = wait_for_line(sim, "sim-server listening on ", 30).rsplit(" ", 1)[1]
        found: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, variant in VARIANTS.items():
                found[name].append(asyncio.run(variant(url, args.requests, args.in_flight)))
    finally:
        sim.kill()
        sim.wait(10)
    table = Table(
        title=f"HTTP client CPU per request ({args.requests:,} requests, {args.in_flight} in flight)"
    )
    for col in ("client", "ms/request, each round", "vs aiohttp as genq uses it (medians)"):
        table.add_column(col, justify="left" if col == "client" else "right")
    base = sorted(found["aiohttp as genq uses it"])[args.rounds // 2]
    for name, values in found.items():
        median = sorted(values)[args.rounds // 2]
        table.add_row(name, ", ".join(f"{v:.3f}" for v in values), f"{median / base:.2f}")
    console.print(table)
    dest = ROOT / "bench" / "results" / "http_client.json"
    dest.write_text(
        json.dumps({"machine": machine(), "args": vars(args), "ms_per_request": found}, indent=2) + "\n"
    )
    console.print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
