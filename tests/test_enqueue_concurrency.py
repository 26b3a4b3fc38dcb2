"""`genq enqueue` run many times at once, and again on files that changed: each row once, or refused."""

from __future__ import annotations

import re
import subprocess

from rq import Queue

from genq.keys import Keys
from tests.helpers import genq_argv, write_prompts

ROWS = 20_000  # enough that four enqueues started together overlap while they push


def _enqueue_together(procs, data, n: int) -> list[subprocess.CompletedProcess]:
    """``n`` enqueues of ``data`` started at once, each waited for (a bounded time)."""
    started = [
        subprocess.Popen(
            genq_argv("enqueue", data), env=procs.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(n)
    ]
    done = []
    for proc in started:
        out, err = proc.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode()))
    return done


def test_enqueues_of_one_file_at_once_push_each_row_once(procs, conn, namespace, tmp_path):
    data = tmp_path / "together.jsonl"
    write_prompts(data, ROWS)
    queue = Queue(Keys(namespace).queue_name("together"), connection=conn, serializer="json")
    runs = _enqueue_together(procs, data, 4) + _enqueue_together(procs, data, 4)
    for run in runs:
        assert run.returncode == 0, run.stderr
    enqueued = [int(re.search(r"enqueued (\d+)", run.stdout).group(1)) for run in runs]
    assert sum(enqueued) == ROWS, enqueued
    # A row pushed twice is two entries of one id in the queue (RPUSH keeps both): both would run.
    ids = conn.lrange(queue.key, 0, -1)
    assert len(ids) == ROWS and len(set(ids)) == ROWS, f"{len(ids)} queued, {len(set(ids))} distinct"
    # One that found the dataset's lease taken said so once, and waited for it.
    assert all(run.stderr.count("another enqueue") <= 1 for run in runs)
