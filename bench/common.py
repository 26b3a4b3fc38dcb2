"""What the benchmarks share: prompts that need no tokenizer, CPU seconds of a process, the machine."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import orjson


def write_prompts(path: Path, n: int, vocabulary: list[list[int]] | None = None) -> list[list[int]]:
    """Pre-tokenized prompts: of 4..39 tokens (like tests/helpers.write_prompts), or ``vocabulary``'s
    prompts cycled through (a real engine's token ids); their ids."""
    if vocabulary:
        prompts = [vocabulary[i % len(vocabulary)] for i in range(n)]
    else:
        prompts = [[100 + (i * 7 + j * 13) % 30000 for j in range(4 + i % 36)] for i in range(n)]
    with path.open("wb") as fh:
        for i, ids in enumerate(prompts):
            fh.write(orjson.dumps({"id": f"src-{i}", "input_ids": ids}) + b"\n")
    return prompts


def cpu_s(pid: int) -> float:
    """utime + stime of a running process; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """utime + stime of a process and every descendant running now (SGLang's and vLLM's engine
    processes are children of their API server's)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    total, todo = 0.0, [pid]
    while todo:
        one = todo.pop()
        total += cpu_s(one)
        todo.extend(children.get(one, []))
    return total


def machine() -> dict[str, object]:
    return {
        "nproc": os.cpu_count(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def kill_children(children: list[subprocess.Popen]) -> None:
    """Every process a benchmark started and left running, last started first."""
    for proc in reversed(children):
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
