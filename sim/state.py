"""The simulator's live state: settings, counters, in-flight requests, health, scheduler."""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass, field
from typing import NoReturn

from aiohttp import web

from genq.sim.cache import PromptCache
from genq.sim.config import SimConfig
from genq.sim.faults import FaultInjector
from genq.sim.scheduler import BatchScheduler, Sequence
from genq.sim.stats import SimStats
from genq.sim.versions import Quirks

CRASH_EXIT = 134  # as a process killed by an abort()/device assert


@dataclass(eq=False)
class Flight:
    """A request being served; /abort_request finds it by rid and wakes it."""

    rid: str
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    seq: Sequence | None = None  # its decode work, under realistic latency
    abort_message: str | None = None
    closing: bool = False  # the server is stopping: drop the connection instead of answering


class SimState:
    """Holds what the handlers share; one per application."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.quirks = Quirks(config.version)
        self.api_key = config.api_key
        self.started = asyncio.Event()  # set once --startup-s has passed
        self.shutting_down = False
        self.rids: list[str] = []  # every rid received, in order: tests check none repeats or prefixes
        self.stats = SimStats()
        self.faults = FaultInjector(config.faults, config.seed)
        self.cache = PromptCache(config.prefix_cache_entries)
        self.scheduler = BatchScheduler(config.latency_params()) if config.latency == "realistic" else None
        self.healthy = config.healthy
        self.in_flight: dict[str, Flight] = {}

    def note_rid(self, rid: str) -> None:
        self.rids.append(rid)

    def crash(self, why: str) -> NoReturn:
        """Die as a GPU fault kills SGLang: at once, every connection dropped, no answer."""
        sys.stderr.write(f"sim-server: crashing: {why}\n")
        sys.stderr.flush()
        os._exit(CRASH_EXIT)

    def abort(self, flight: Flight, message: str) -> None:
        """End a request early; it answers HTTP 200 with finish_reason abort, as SGLang does."""
        flight.abort_message = message
        if flight.seq is not None and self.scheduler is not None:
            self.scheduler.abort(flight.seq, message)
        flight.wake.set()

    async def shutdown(self) -> None:
        """Let hanging requests drop their connections and abort decoding ones."""
        self.shutting_down = True
        for flight in list(self.in_flight.values()):
            flight.closing = True
            flight.wake.set()
        if self.scheduler is not None:
            await self.scheduler.stop()


SIM_STATE = web.AppKey("sim_state", SimState)
