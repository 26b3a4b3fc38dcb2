"""genq from Python, measured beside the command line (docs/python.md; issue: the API's enqueue
within 10 % of the CLI's rows/s, a stage's lag p99 ≤ 1 s).

    python bench/api.py            # 20,000 rows a round, 3 rounds; a stage of 3,000 records
    python bench/api.py --quick    # 4,000 rows, 1 round; a stage of 600

1. Enqueue rows/s of the same rows, side by side in alternating rounds on one private redis-server:
   `genq enqueue FILE` (a process: its start-up counted, as a user pays it), `Client.enqueue(list of
   dicts)` and `Client.enqueue(datasets.Dataset)` (in this process: writing the rows' file counted).
2. Stage lag: A's records as they land (the simulator at zero latency, 2 workers) followed by a
   stage B; for each record, the seconds from its line in A's file to its job's bit in B's
   `enqueued` bitmap, both seen by pollers every 5 ms (so ±5 ms), p50/p99/max, and A's rate.
Results also go to bench/results/api.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import genq  # noqa: E402
from bench.common import kill_children, machine  # noqa: E402
from genq.commands.embedded import EmbeddedRedis  # noqa: E402
from genq.commands.processes import genq_command, wait_for_line  # noqa: E402

POLL_S = 0.005


def rows_of(n: int) -> list[dict]:
    return [{"prompt": f"Question {i}: what is {i} times {i + 7}?", "id": f"q{i}"} for i in range(n)]


def enqueue_rates(url: str, password: str, n: int, rounds: int, work: Path) -> dict[str, list[float]]:
    import datasets

    rows = rows_of(n)
    path = work / "rows.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    frame = datasets.Dataset.from_list(rows)
    env = {"GENQ_REDIS_URL": url, "GENQ_REDIS_PASSWORD": password, "GENQ_ROWS_DIR": str(work / "rows")}
    rates: dict[str, list[float]] = {
        "cli (file)": [],
        "api (list of dicts)": [],
        "api (datasets.Dataset)": [],
    }
    os.environ.update(env)
    for _ in range(rounds):
        for way in rates:
            namespace = "b" + uuid.uuid4().hex[:8]
            start = time.perf_counter()
            if way.startswith("cli"):
                argv = genq_command("enqueue", str(path), "--dataset", "d", "--namespace", namespace)
                subprocess.run(argv, check=True, capture_output=True, env={**os.environ, **env})
            else:
                client = genq.connect(url, namespace)
                done = client.enqueue(rows if "list" in way else frame, dataset="d")
                assert done.enqueued == n, done
                client.close()
            rates[way].append(n / (time.perf_counter() - start))
    return rates


def stage_lag(url: str, password: str, n: int, work: Path) -> dict[str, float]:
    """A of ``n`` rows run by two workers on the simulator; B follows it; lags per record."""
    namespace = "s" + uuid.uuid4().hex[:8]
    env = {**os.environ, "GENQ_REDIS_URL": url, "GENQ_REDIS_PASSWORD": password, "GENQ_NAMESPACE": namespace}
    out = work / "out"
    data = work / "a.jsonl"
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows_of(n)))
    (work / "t.jinja").write_text("Judge: {{ content }}")
    children: list[subprocess.Popen] = []
    try:
        sim = subprocess.Popen(genq_command("sim-server", "--port", "0"), stdout=subprocess.PIPE, env=env)
        children.append(sim)
        server = wait_for_line(sim, "sim-server listening on ", 30).rsplit(" ", 1)[1]
        enqueue = genq_command("enqueue", str(data), "--dataset", "A", "--max-new-tokens", "8")
        subprocess.run(enqueue, env=env, check=True, capture_output=True)
        children.append(
            subprocess.Popen(genq_command("collect", "--out", str(out)), env=env, stderr=subprocess.DEVNULL)
        )
        stage = genq_command("enqueue", "--from-dataset", "A", "--dataset", "B", "--from-out", str(out),
                             "--template", str(work / "t.jinja"), "--max-new-tokens", "8")  # fmt: skip
        follower = subprocess.Popen(stage, env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        children.append(follower)
        client = genq.connect(url, namespace)
        seen_a: dict[int, float] = {}
        seen_b: dict[int, float] = {}
        stop = threading.Event()

        def watch_a() -> None:
            raw, offset = out / "A" / "raw_responses.jsonl", 0
            while not stop.is_set():
                if raw.exists():
                    with raw.open("rb") as fh:
                        fh.seek(offset)
                        for line in fh:
                            if not line.endswith(b"\n"):
                                break
                            offset += len(line)
                            seen_a.setdefault(orjson.loads(line)["row"], time.monotonic())
                time.sleep(POLL_S)

        def watch_b() -> None:
            while not stop.is_set():
                bits = client.conn.get(client.keys.enqueued("B")) or b""
                now = time.monotonic()
                for byte_at, byte in enumerate(bits):
                    for bit in range(8):
                        if byte & (0x80 >> bit):
                            seen_b.setdefault(byte_at * 8 + bit, now)
                time.sleep(POLL_S)

        watchers = [threading.Thread(target=watch_a), threading.Thread(target=watch_b)]
        for thread in watchers:
            thread.start()
        started = time.monotonic()
        worker = genq_command("worker", "--server", server, "--concurrency", "64")
        for _ in range(2):
            children.append(subprocess.Popen(worker, env=env, stderr=subprocess.DEVNULL))
        follower.wait(600)
        stop.set()
        for thread in watchers:
            thread.join()
        elapsed = max(seen_a.values()) - started
    finally:
        kill_children(children)
    lags = sorted(seen_b[row] - seen_a[row] for row in seen_a if row in seen_b)
    assert len(lags) == n, (len(lags), n)
    return {
        "records": n,
        "a_records_per_s": round(n / elapsed, 1),
        "lag_p50_s": round(lags[len(lags) // 2], 3),
        "lag_p99_s": round(lags[int(len(lags) * 0.99)], 3),
        "lag_max_s": round(lags[-1], 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4,000 rows, 1 round; a stage of 600")
    args = ap.parse_args()
    n, rounds, staged = (4000, 1, 600) if args.quick else (20000, 3, 3000)
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        redis_server = EmbeddedRedis(work / "redis", private=True)
        url = redis_server.start()
        password = redis_server.password() or ""
        try:
            rates = enqueue_rates(url, password, n, rounds, work)
            lag = stage_lag(url, password, staged, work)
        finally:
            redis_server.stop()
    cli = statistics.median(rates["cli (file)"])
    table = Table(title=f"enqueue of {n:,} rows, median of {rounds} alternating rounds")
    for column in ("way", "rows/s", "vs the CLI"):
        table.add_column(column, justify="right" if column != "way" else "left")
    for way, values in rates.items():
        rate = statistics.median(values)
        table.add_row(way, f"{rate:,.0f}", f"{rate / cli:.2f}")
    console.print(table)
    stage_table = Table(title=f"stage lag: A's record on disk -> B's job queued ({lag['records']:,} records)")
    for key in ("a_records_per_s", "lag_p50_s", "lag_p99_s", "lag_max_s"):
        stage_table.add_column(key, justify="right")
    stage_table.add_row(*(str(lag[k]) for k in ("a_records_per_s", "lag_p50_s", "lag_p99_s", "lag_max_s")))
    console.print(stage_table)
    result = {"machine": machine(), "rows": n, "rounds": rounds, "enqueue_rows_per_s": rates, "stage": lag}
    (ROOT / "bench" / "results" / "api.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
