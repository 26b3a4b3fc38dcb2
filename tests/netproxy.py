"""A TCP proxy a test can cut and restore: a network partition between one process and a server,
on one machine. While cut, nothing crosses either way (bytes wait, as packets a partition delays
would be retransmitted); connections stay open, so the client just hangs, as across a real
partition, instead of seeing a reset.

:meth:`Proxy.lose_reply` loses one reply instead: the request goes through and is answered, and
the client sees its connection drop before the answer, as when a link fails at that moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from genq.commands.embedded import free_port


class Proxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._open: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._lose: bytes | None = None  # the next request holding these bytes loses its reply
        self._pattern: bytes | None = None
        self.lost = threading.Event()
        self.sent = 0  # requests that held the pattern, the lost one and any sent again

    def start(self) -> Proxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise AssertionError(f"the proxy to {self.target} was not listening after 10 s")
        return self

    def cut(self) -> None:
        self._loop.call_soon_threadsafe(self._open.clear)  # type: ignore[union-attr]

    def restore(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)  # type: ignore[union-attr]

    def lose_reply(self, pattern: bytes) -> None:
        """The next request that holds ``pattern`` and is answered without an error reply (``-``:
        a NOSCRIPT is not an answer worth losing) reaches the server, which runs it; its
        connection is then closed before the answer is forwarded. :attr:`lost` is set then;
        :attr:`sent` counts the requests that held ``pattern``."""
        self._lose = self._pattern = pattern

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._open = asyncio.Event()
        self._open.set()
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        doomed = asyncio.Event()  # this connection's last request is to lose its reply

        def sent(data: bytes) -> None:
            if self._pattern is not None and self._pattern in data:
                self.sent += 1
                if self._lose is not None:
                    doomed.set()

        def answered(data: bytes) -> bool:
            if not doomed.is_set():
                return True
            if data.startswith(b"-"):  # refused, not run: the client sends it again
                doomed.clear()
                return True
            self._lose = None
            self.lost.set()
            for w in (writer, up_writer):
                w.close()
            return False

        await asyncio.gather(self._pump(reader, up_writer, sent), self._pump(up_reader, writer, answered))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, check=None) -> None:
        assert self._open is not None
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                await self._open.wait()
                if check is not None and check(data) is False:
                    break
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(ConnectionError, OSError):
            writer.close()
