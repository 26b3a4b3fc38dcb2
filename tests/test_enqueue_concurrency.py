"""`genq enqueue` run many times at once, and again on files that changed: each row once, or refused."""

from __future__ import annotations

import re
import subprocess

import orjson
from rq import Queue

from genq.keys import Keys
from tests.helpers import (
    genq_argv,
    log_of,
    sigkill,
    sim_stats,
    status_json,
    stop,
    wait_until,
    worker_name,
    write_prompts,
)

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


def test_an_enqueue_waits_for_its_datasets_lease_and_not_for_others(procs, conn, namespace, tmp_path):
    mine, other = tmp_path / "mine.jsonl", tmp_path / "other.jsonl"
    write_prompts(mine, 10)
    write_prompts(other, 10)
    lease = Keys(namespace).enqueuing("mine")
    conn.set(lease, "elsewhere:1:test", px=60_000)  # another enqueue of it, running
    waiting = procs.start("enqueue", mine)
    wait_until(lambda: "another enqueue (elsewhere:1:test)" in log_of(waiting), 30, "the waiting line")
    res = procs.run("enqueue", other)  # another dataset: its own lease
    assert res.returncode == 0 and "enqueued 10" in res.stdout, res.stderr
    assert waiting.poll() is None and _queued(conn, namespace, "mine") == 0
    conn.delete(lease)  # the other enqueue is done
    assert waiting.wait(30) == 0
    assert "mine: read 10, enqueued 10" in log_of(waiting)
    assert log_of(waiting).count("another enqueue") == 1
    assert not conn.exists(lease), "given back"


def test_an_enqueue_that_lost_its_lease_pushes_nothing_more(procs, conn, namespace, tmp_path):
    data = tmp_path / "fenced.jsonl"
    write_prompts(data, 50)
    queue_key = Queue(Keys(namespace).queue_name("fenced"), connection=conn, serializer="json").key
    proc = procs.start("enqueue", data, "--max-queued", "10")  # no worker: it waits for room
    wait_until(lambda: conn.llen(queue_key) == 10, 30, "the queue at its bound")
    conn.set(Keys(namespace).enqueuing("fenced"), "thief:1:test", px=60_000)  # as if its lease lapsed
    conn.delete(queue_key)  # room: its next push comes
    assert proc.wait(30) != 0
    assert (
        "another enqueue took the dataset while this one could not renew its lease (held by thief:1:test"
        in log_of(proc)
    )
    assert conn.llen(queue_key) == 0, "nothing pushed once the lease was another's"


def _queued(conn, namespace, dataset: str) -> int:
    return conn.llen(Queue(Keys(namespace).queue_name(dataset), connection=conn, serializer="json").key)


def test_another_file_under_the_same_name_is_refused(procs, conn, namespace, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    write_prompts(first / "same.jsonl", 100)
    rows = (first / "same.jsonl").read_bytes().splitlines(keepends=True)
    (first / "same.jsonl").write_bytes(b"".join(rows[:3] + [b"{not json\n"] + rows[4:]))
    assert "enqueued 99, skipped 0, rejected 1" in procs.run("enqueue", first / "same.jsonl").stdout
    # Another file of the same name, longer: before, its first 100 rows were skipped by position and
    # its other 200 enqueued into the dataset.
    write_prompts(second / "same.jsonl", 300, start=1000)
    res = procs.run("enqueue", second / "same.jsonl")
    assert res.returncode != 0
    error = [line for line in res.stderr.splitlines() if line.startswith("Error")]
    assert len(error) == 1, res.stderr
    assert f"{second / 'same.jsonl'}:100: the first 100 rows of this file are not the 100 rows" in error[0]
    assert "another --dataset" in error[0] and "--replace-settings" in error[0]
    # Not even its row 3, new to the dataset (refused in the first file): held until the check.
    assert _queued(conn, namespace, "same") == 99, "nothing of the other file queued"
    # With --replace-settings it is taken as it is (said so), and only rows past the first 100 come from it.
    res = procs.run("enqueue", second / "same.jsonl", "--replace-settings")
    assert res.returncode == 0, res.stderr
    assert "--replace-settings: this file's rows are the dataset's from now on" in res.stderr
    assert "enqueued 201, skipped 99" in res.stdout
    assert procs.run("enqueue", second / "same.jsonl").returncode == 0, "its print is the dataset's now"


def test_rows_appended_to_the_last_file_only_are_enqueued(procs, conn, namespace, tmp_path):
    data, later = tmp_path / "grows.jsonl", tmp_path / "later.jsonl"
    write_prompts(data, 50)
    assert "enqueued 50" in procs.run("enqueue", data).stdout
    write_prompts(data, 80)  # the same 50 rows, 30 more
    res = procs.run("enqueue", data)
    assert res.returncode == 0 and "read 80, enqueued 30, skipped 50" in res.stdout, res.stderr
    # A row changed inside the rows enqueued: refused, whatever was appended.
    rows = data.read_bytes().splitlines(keepends=True)
    data.write_bytes(b"".join(rows[:10] + [b'{"prompt": "changed"}\n'] + rows[11:]))
    res = procs.run("enqueue", data)
    assert res.returncode != 0 and f"{data}:80: the first 80 rows" in res.stderr, res.stderr
    # Rows appended to a file that is not the last would renumber the later files' rows.
    write_prompts(data, 80)
    write_prompts(later, 5, start=500)
    assert "enqueued 5, skipped 80" in procs.run("enqueue", data, later, "--dataset", "grows").stdout
    write_prompts(data, 81)
    res = procs.run("enqueue", data, later, "--dataset", "grows")
    assert res.returncode != 0 and f"{data}:81: this file has more rows than the 80" in res.stderr
    assert "rows may be added only to the last file" in res.stderr
    again = procs.run("enqueue", data, later, "--dataset", "grows")
    assert again.returncode != 0 and "this file has more rows" in again.stderr, "nothing of it recorded"
    assert _queued(conn, namespace, "grows") == 85


def test_a_dataset_enqueued_without_prints_gets_them_then(procs, conn, namespace, tmp_path):
    data = tmp_path / "old.jsonl"
    write_prompts(data, 20)
    assert procs.run("enqueue", data).returncode == 0
    conn.delete(Keys(namespace).sources("old"))  # as an enqueue before source prints left it
    res = procs.run("enqueue", data)
    assert res.returncode == 0 and "enqueued 0, skipped 20" in res.stdout, res.stderr
    assert conn.hexists(Keys(namespace).sources("old"), "0")
    # The print an older genq wrote (a running blake2b of every row): recorded afresh, said so.
    older = {"file": data.name, "rows": 20, "blake2b": "00" * 16}
    conn.hset(Keys(namespace).sources("old"), "0", orjson.dumps(older))
    res = procs.run("enqueue", data)
    assert res.returncode == 0 and "source prints of an older genq (files 0)" in res.stderr, res.stderr
    assert "terms" in orjson.loads(conn.hget(Keys(namespace).sources("old"), "0"))
    write_prompts(data, 20, start=100)
    assert procs.run("enqueue", data).returncode != 0


def test_parquet_and_json_array_sources_are_known_by_content(procs, conn, namespace, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = tmp_path / "table.parquet"
    pq.write_table(pa.table({"prompt": [f"row {i}" for i in range(30)]}), table)
    assert procs.run("enqueue", table).returncode == 0
    pq.write_table(pa.table({"prompt": [f"row {i}" for i in range(30)] + ["new"]}), table)
    assert "enqueued 1, skipped 30" in procs.run("enqueue", table).stdout
    pq.write_table(pa.table({"prompt": [f"other {i}" for i in range(40)]}), table)
    res = procs.run("enqueue", table)
    assert res.returncode != 0 and f"{table}:row 30: the first 31 rows" in res.stderr, res.stderr
    array = tmp_path / "array.json"
    array.write_text('[{"prompt": "x"},\n {"prompt": "y"}]')
    assert procs.run("enqueue", array).returncode == 0
    array.write_text('[{"prompt": "x"},\n {"prompt": "z"}]')
    res = procs.run("enqueue", array)
    assert res.returncode != 0 and f"{array}:2: the first 2 rows" in res.stderr, res.stderr
    # An array broken in the middle stops the enqueue; fixed, it goes on (the broken row is no row).
    broken = tmp_path / "broken.json"
    broken.write_text('[{"prompt": "x"},\n {"prompt": "y"},\n {"prompt": oops}]')
    assert procs.run("enqueue", broken).returncode != 0
    broken.write_text('[{"prompt": "x"},\n {"prompt": "y"},\n {"prompt": "z"}]')
    res = procs.run("enqueue", broken)
    assert res.returncode == 0 and "enqueued 1, skipped 2" in res.stdout, res.stderr


def test_enqueues_at_once_while_a_worker_runs_generate_each_row_once(
    procs, start_sim, conn, namespace, tmp_path
):
    """The measured case: a worker takes jobs while four enqueues of one file run at once, twice."""
    rows = 4000
    url = start_sim("--latency", "zero")
    data = tmp_path / "live.jsonl"
    write_prompts(data, rows)
    collector = procs.start("collect", "--out", tmp_path / "out")
    worker = procs.start("worker", "--server", url, "--concurrency", "64")
    worker_name(procs, worker)  # registered: its probe (a 1-token /generate) is sent
    probes = sim_stats(url)["requests"]
    runs = _enqueue_together(procs, data, 4) + _enqueue_together(procs, data, 4)
    assert [run.returncode for run in runs] == [0] * 8, [run.stderr for run in runs]
    wait_until(lambda: status_json(procs)["datasets"]["live"]["done"] == rows, 120, "every record")
    assert stop(worker) == 0 and stop(collector) == 0
    assert _queued(conn, namespace, "live") == 0, "no second copy left queued"
    assert sim_stats(url)["requests"] - probes == rows, "each prompt generated once"


def test_each_file_of_a_glob_and_a_saved_dataset_is_known_by_content(procs, conn, namespace, tmp_path):
    import datasets

    shards = tmp_path / "shards"
    shards.mkdir()
    write_prompts(shards / "part-0.jsonl", 10)
    write_prompts(shards / "part-1.jsonl", 10, start=10)
    pattern = str(shards / "*.jsonl")
    assert procs.run("enqueue", pattern, "--dataset", "glob").returncode == 0
    write_prompts(shards / "part-1.jsonl", 10, start=50)  # the second shard replaced
    res = procs.run("enqueue", pattern, "--dataset", "glob")
    assert res.returncode != 0 and f"{shards / 'part-1.jsonl'}:10: the first 10 rows" in res.stderr
    assert _queued(conn, namespace, "glob") == 20
    saved, elsewhere = tmp_path / "saved", tmp_path / "elsewhere" / "saved"
    column = {"n": list(range(12))}
    datasets.Dataset.from_dict({"prompt": [f"p{i}" for i in range(12)], **column}).save_to_disk(saved)
    assert procs.run("enqueue", saved).returncode == 0
    res = procs.run("enqueue", saved)
    assert res.returncode == 0 and "enqueued 0, skipped 12" in res.stdout, res.stderr
    datasets.Dataset.from_dict({"prompt": [f"q{i}" for i in range(12)], **column}).save_to_disk(elsewhere)
    res = procs.run("enqueue", elsewhere)
    assert res.returncode != 0 and "the first 12 rows of this file are not the 12 rows" in res.stderr


def test_rows_refused_then_fixed_in_place_are_taken_in_and_counted_once(procs, conn, namespace, tmp_path):
    """The way the rejection's hint says (fix them and run again): a row refused for its JSON (read
    time) and one refused for its sampling (checked after reading) are enqueued once fixed, with no
    --replace-settings; the ledger then counts 10 rows read, none rejected; a row taken in is known
    by content from then on, and a row still refused keeps counting as refused."""

    def row(i: int, max_tokens: int = 64) -> bytes:
        body = {"model": "m", "prompt": f"prompt {i}", "max_tokens": max_tokens}
        return orjson.dumps({"custom_id": f"c-{i}", "method": "POST", "url": "/v1/completions", "body": body})

    data = tmp_path / "fixed.jsonl"
    good = [row(i) for i in range(10)]
    data.write_bytes(b"\n".join(good[:3] + [b"{not json"] + good[4:6] + [row(6, 999)] + good[7:]) + b"\n")
    first = procs.run("enqueue", data, "--allow-rejects")
    assert first.returncode == 0 and "enqueued 8, skipped 0, rejected 2" in first.stdout, first.stderr
    ledger = status_json(procs)["datasets"]["fixed"]
    assert (ledger["total"], ledger["rejected"]) == (8, 2), ledger

    data.write_bytes(b"\n".join(good[:6] + [row(6, 999)] + good[7:]) + b"\n")  # row 3 fixed, row 6 not
    second = procs.run("enqueue", data, "--allow-rejects")
    assert second.returncode == 0 and "enqueued 1, skipped 8, rejected 1" in second.stdout, second.stderr
    data.write_bytes(b"\n".join(good) + b"\n")  # row 6 fixed too
    third = procs.run("enqueue", data)
    assert third.returncode == 0 and "enqueued 1, skipped 9, rejected 0" in third.stdout, third.stderr
    counts = status_json(procs)["datasets"]["fixed"]
    assert (counts["total"], counts["rejected"]) == (10, 0), counts
    assert _queued(conn, namespace, "fixed") == 10

    again = procs.run("enqueue", data)
    assert again.returncode == 0 and "enqueued 0, skipped 10" in again.stdout, again.stderr
    data.write_bytes(b"\n".join(good[:3] + [row(33)] + good[4:]) + b"\n")  # a row taken in, changed
    changed = procs.run("enqueue", data)
    assert changed.returncode != 0 and f"{data}:10: the first 10 rows" in changed.stderr, changed.stderr
    assert _queued(conn, namespace, "fixed") == 10


def test_an_enqueue_of_fixed_rows_killed_midway_is_resumed_by_the_next(procs, conn, namespace, tmp_path):
    """The print and the rejected bits move in one MULTI: an enqueue taking in 3,000 fixed rows,
    killed while it waits at its --max-queued bound, leaves a print the next enqueue accepts (no
    refusal), and that one queues the rest: each of the 6,000 rows once, none counted rejected."""
    data = tmp_path / "half.jsonl"
    write_prompts(data, 6000)
    rows = data.read_bytes().splitlines(keepends=True)
    data.write_bytes(b"".join(line if i % 2 == 0 else b"{broken\n" for i, line in enumerate(rows)))
    first = procs.run("enqueue", data, "--allow-rejects", timeout=120)
    assert first.returncode == 0 and "enqueued 3000, skipped 0, rejected 3000" in first.stdout, first.stderr
    data.write_bytes(b"".join(rows))
    keys = Keys(namespace)
    queue = Queue(keys.queue_name("half"), connection=conn, serializer="json")
    bounded = procs.start("enqueue", data, "--max-queued", "4000")
    wait_until(lambda: conn.llen(queue.key) >= 3500, 60, "the fixed rows' first pushes")
    sigkill(bounded)
    assert conn.llen(queue.key) < 6000
    resumed = procs.run("enqueue", data, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert conn.llen(queue.key) == 6000
    ids = [job.decode() for job in conn.lrange(queue.key, 0, -1)]
    assert len(set(ids)) == 6000, "each row queued once"
    assert (conn.bitcount(keys.enqueued("half")), conn.bitcount(keys.rejected("half"))) == (6000, 0)
    again = procs.run("enqueue", data)
    assert again.returncode == 0 and "enqueued 0, skipped 6000" in again.stdout, again.stderr
