"""The real `rq info` sees genq's asyncio worker the way it sees RQ's own: busy, jobs executing.

These are contract tests for the RQ internals the worker relies on (rq==2.12.*).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import check_records, log_of, status_json, wait_until, write_prompts

RQ = str(Path(sys.executable).parent / "rq")
LONG = {"min_len": 1500, "max_len": 1600}


def rq_info(redis_url: str, *flags: str) -> str:
    res = subprocess.run([RQ, "info", "-u", redis_url, *flags], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_rq_info_lists_the_worker_busy_and_its_jobs_executing(
    procs, start_sim, out, tmp_path, redis_url, namespace
):
    url = start_sim(
        "--latency", "realistic", "--min-len", "1500", "--max-len", "1600", "--decode-step-ms", "4"
    )
    data = tmp_path / "contract.jsonl"
    prompts = write_prompts(data, 30)
    assert procs.run("enqueue", data, "--max-new-tokens", "2000").returncode == 0
    worker = procs.start("worker", "--server", url, "--concurrency", "12")
    wait_until(lambda: status_json(procs)["datasets"]["contract"]["in_flight"] == 12, 30, "12 jobs in flight")

    queue = f"{namespace}.contract"
    for flags in (("-S", "json"), ()):  # operators run it without the serializer flag too
        info = rq_info(redis_url, *flags)
        line = next(line for line in info.splitlines() if line.startswith(queue))
        assert re.search(r"\b12 executing\b", line), info
        assert re.search(rf"genq\.{namespace}\.\S+ \(.*\): busy {re.escape(queue)}", info), info

    collector = procs.start("collect", "--out", out)
    wait_until(lambda: status_json(procs)["datasets"]["contract"]["done"] == 30, 120, "all 30 on disk")
    info = rq_info(redis_url, "-S", "json")
    line = next(line for line in info.splitlines() if line.startswith(queue))
    assert "0 executing" in line and re.search(r"\b0 failed\b", line), info
    worker.terminate()
    collector.terminate()
    assert worker.wait(60) == 0, log_of(worker)
    assert collector.wait(60) == 0, log_of(collector)
    check_records(out, "contract", prompts, {"max_new_tokens": 2000}, **LONG)
