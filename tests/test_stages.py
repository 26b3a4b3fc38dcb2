"""Stages (producer/stage.py) and row templates (producer/row_template.py): a dataset whose rows are
another's records, followed as they land, exactly once whatever is killed; templates over an
ordinary dataset's columns; and what is refused, in one line."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.job import Job

import genq
from genq.keys import Keys
from tests.helpers import (
    log_of,
    read_jsonl,
    sigkill,
    sim_get,
    sim_stats,
    stop,
    wait_until,
    write_jsonl,
    write_prompts,
)

JUDGE = "Judge the answer.\nQuestion: {{ prompt }}\nAnswer: {{ content }}\nVerdict:"
# A JSON object: the row itself.
REVISE = '{"prompt": {{ ("Revise it, given the verdict: " ~ content) | tojson }}}'


def _lines_by_id(path: Path) -> Counter:
    return Counter(r["id"] for r in read_jsonl(path)) if path.exists() else Counter()


def _enqueued(conn: redis.Redis, keys: Keys, name: str) -> int:
    return conn.bitcount(keys.enqueued(name))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_chain_of_stages_killed_everywhere_makes_each_row_once(procs, start_sim, out, tmp_path):
    """A -> B -> C (answer, judge, revise) on 300 rows; B's follower, a worker and the collector are
    SIGKILLed mid-run (B's follower while A is still running: B follows it live). Every record of A
    has exactly one record in B and one in C, each naming its parent; the server generated each job
    once but for what the killed worker had in flight; verify is clean."""
    rows = 300
    data = write_jsonl(
        tmp_path / "a.jsonl", [{"prompt": f"Question {row}: what is {row} squared?"} for row in range(rows)]
    )
    (tmp_path / "judge.jinja").write_text(JUDGE)
    (tmp_path / "revise.jinja").write_text(REVISE)
    # 20 ms decode steps: A takes seconds, so B is seen following it before it ends.
    url = start_sim("--latency", "realistic")
    conn, keys = redis.Redis.from_url(procs.env["GENQ_REDIS_URL"]), Keys(procs.env["GENQ_NAMESPACE"])
    common = ("--max-new-tokens", "8")
    assert procs.run("enqueue", data, "--dataset", "A", *common).returncode == 0

    def follower(name: str, source: str, template: str):
        return procs.start(
            "enqueue", "--from-dataset", source, "--dataset", name, "--from-out", out,
            "--template", tmp_path / template, *common, name=f"stage-{name}",
        )  # fmt: skip

    concurrency = 4
    collector = procs.start("collect", "--out", out)
    worker = procs.start("worker", "--server", url, "--concurrency", str(concurrency))
    b = follower("B", "A", "judge.jinja")
    wait_until(lambda: datasets_exist(conn, keys, "B"), 60, "B registered")
    c = follower("C", "B", "revise.jinja")

    wait_until(lambda: _enqueued(conn, keys, "B") >= 40, 120, "B's first rows")
    a_done = len(_lines_by_id(out / "A" / "raw_responses.jsonl"))
    assert a_done < rows, "A was over before B had 40 rows: B did not follow it live"
    sigkill(b)
    b = follower("B", "A", "judge.jinja")
    wait_until(lambda: len(_lines_by_id(out / "A" / "raw_responses.jsonl")) >= 150, 120, "half of A")
    started = [
        Queue(keys.queue_name(n), connection=conn, serializer="json").started_job_registry.key for n in "ABC"
    ]
    sigkill(worker)
    # What the dead worker held and had already asked the server for: generated twice, no more.
    held = {member.decode().split(":")[0] for key in started for member in conn.zrange(key, 0, -1)}
    caught = held & {rid.split(".", 1)[0] for rid in sim_get(url, "/sim/rids")}
    worker = procs.start("worker", "--server", url, "--concurrency", str(concurrency))
    wait_until(lambda: len(_lines_by_id(out / "B" / "raw_responses.jsonl")) >= 60, 120, "B's records")
    sigkill(collector)
    collector = procs.start("collect", "--out", out)

    assert b.wait(240) == 0, log_of(b)  # A settled: B's follower is done
    assert c.wait(240) == 0, log_of(c)
    wait_until(lambda: len(_lines_by_id(out / "C" / "raw_responses.jsonl")) >= rows, 120, "C's records")
    for proc in (worker, collector):
        assert stop(proc, timeout=60) == 0, log_of(proc)

    by = {name: read_jsonl(out / name / "raw_responses.jsonl") for name in "ABC"}
    for name in "ABC":
        assert Counter(r["id"] for r in by[name]).most_common(1)[0][1] == 1, f"{name}: an id twice"
        assert sorted(r["row"] for r in by[name]) == list(range(rows)), name
    # Each record names its parent, the record of the dataset before it at the same row.
    assert all(r["parent"] == f"A-{r['row']}" for r in by["B"])
    assert all(r["parent"] == f"B-{r['row']}" for r in by["C"])
    a_text = {r["row"]: r["content"] for r in by["A"]}
    assert all(a_text[r["row"]] in r["messages"][-1]["content"] for r in by["B"])
    b_text = {r["row"]: r["content"] for r in by["B"]}
    assert all(
        r["messages"][-1]["content"] == f"Revise it, given the verdict: {b_text[r['row']]}" for r in by["C"]
    )
    asked = Counter(
        rid.split(".", 1)[0] for rid in sim_get(url, "/sim/rids") if not rid.startswith("genq-probe.")
    )
    assert len(asked) == 3 * rows
    twice = {job for job, n in asked.items() if n > 1}
    assert twice <= caught and max(asked.values()) <= 2, (sorted(twice - caught)[:5], asked.most_common(2))
    wasted = sim_stats(url)["generations"] - 2 - 3 * rows  # two workers' start-up probes
    assert 0 <= wasted <= len(caught), wasted
    verified = procs.run("verify", "--out", out)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    status = procs.run("status", "--json")
    assert '"from": "A"' in status.stdout.replace(" ", "").replace('"from":"A"', '"from": "A"')


def datasets_exist(conn: redis.Redis, keys: Keys, name: str) -> bool:
    return bool(conn.hexists(keys.datasets, name))


def test_a_template_makes_rows_of_an_ordinary_datasets_columns(procs, tmp_path):
    """--template over JSON Lines columns: each row's prompt is the rendering; a row missing a field
    the template names is that row's refusal (the template's words), the others enqueued; the
    template is part of the recipe: another one is refused."""
    data = write_jsonl(
        tmp_path / "qa.jsonl",
        [
            {"question": "What is 2+2?", "context": "arithmetic"},
            {"question": "Why?"},
            {"question": "Who?", "context": "people"},
        ],
    )
    (tmp_path / "t.jinja").write_text("Answer {{ question }} using {{ context }}")
    (tmp_path / "u.jinja").write_text("Reply to {{ question }} using {{ context }}")
    rejects = tmp_path / "rejects.jsonl"
    done = procs.run(
        "enqueue", data, "--template", tmp_path / "t.jinja", "--rejects", rejects, "--allow-rejects"
    )
    assert done.returncode == 0, done.stderr
    assert "qa: read 3, enqueued 2, skipped 0, rejected 1" in done.stdout
    [refused] = read_jsonl(rejects)
    assert (
        refused["dataset_row"] == 1
        and "the template failed" in refused["reason"]
        and "context" in refused["reason"]
    )
    client = genq.connect(procs.env["GENQ_REDIS_URL"], procs.env["GENQ_NAMESPACE"])
    conn, keys = client.conn, client.keys
    prompts = [
        Job.fetch(keys.job_id(f"qa-{row}"), connection=conn, serializer="json").kwargs["text"]
        for row in (0, 2)
    ]
    assert prompts == ["Answer What is 2+2? using arithmetic", "Answer Who? using people"]
    other = procs.run("enqueue", data, "--template", tmp_path / "u.jinja")
    assert other.returncode == 1 and "row_template" in other.stderr, other.stderr


def test_what_a_stage_cannot_be_is_refused_in_one_line(procs, out, tmp_path):
    """A missing source dataset, a cycle, a template naming a field no record has, a stage without
    its template or folder, and FILES with --from-dataset: each one line, nothing recorded."""
    data = tmp_path / "a.jsonl"
    write_prompts(data, 3)
    assert procs.run("enqueue", data, "--dataset", "A").returncode == 0
    template = tmp_path / "t.jinja"
    template.write_text("Judge {{ content }}")
    (tmp_path / "bad.jinja").write_text("Judge {{ answr }}")

    def stage(*args) -> tuple[int, str]:
        done = procs.run("enqueue", *args, timeout=60)
        return done.returncode, done.stderr.strip()

    code, said = stage("--from-dataset", "Z", "--dataset", "B", "--from-out", out, "--template", template)
    namespace = procs.env["GENQ_NAMESPACE"]
    assert code == 1 and said == (
        f"Error: --from-dataset Z: no such dataset in namespace {namespace!r}; enqueue it first"
    )
    code, said = stage(
        "--from-dataset", "A", "--dataset", "B", "--from-out", out, "--template", tmp_path / "bad.jinja"
    )
    assert code == 1 and "--template names 'answr', which A's records do not have" in said
    code, said = stage("--from-dataset", "A", "--dataset", "B", "--from-out", out)
    assert code == 2 and "--from-dataset needs --template" in said
    code, said = stage(
        "--from-dataset", "A", "--dataset", "B", "--from-out", out, "--template", template, "--only-accepted"
    )
    assert code == 1 and "--only-accepted: A is not checked" in said, said
    code, said = stage(
        data, "--from-dataset", "A", "--dataset", "B", "--from-out", out, "--template", template
    )
    assert code == 2 and "not both or neither" in said
    code, said = stage("--from-dataset", "A", "--dataset", "A", "--from-out", out, "--template", template)
    assert code == 1 and "a cycle (A <- A)" in said, said
    assert len(said.splitlines()) == 1


CHECKER = """
def judge(record):
    if record["row"] % 5 == 0:
        raise RuntimeError("no verdict for this one")
    return record["row"] % 2 == 0
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stage_of_only_the_accepted_records(procs, start_sim, out, tmp_path):
    """--only-accepted: B's rows are exactly A's records its checker accepted (not those it
    rejected, not those it failed on: filed apart, they make no row); verify counts B's rows from
    A's accepted records."""
    rows = 30
    data = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"Question {row}"} for row in range(rows)])
    (tmp_path / "judges.py").write_text(CHECKER)
    (tmp_path / "t.jinja").write_text("Judge: {{ content }}")
    url = start_sim("--latency", "zero")
    assert procs.run("enqueue", data, "--dataset", "A", "--checked", "--max-new-tokens", "8").returncode == 0
    roles = [
        procs.start("collect", "--out", out),
        procs.start("worker", "--server", url, "--concurrency", "8"),
        procs.start(
            "check", "--check", "judges:judge", "--max-check-attempts", "1", env={"PYTHONPATH": str(tmp_path)}
        ),
    ]
    follower = procs.start(
        "enqueue", "--from-dataset", "A", "--dataset", "B", "--from-out", out, "--template",
        tmp_path / "t.jinja", "--only-accepted", "--max-new-tokens", "8", name="stage-B",
    )  # fmt: skip
    assert follower.wait(240) == 0, log_of(follower)
    accepted = {row for row in range(rows) if row % 5 and row % 2 == 0}
    wait_until(
        lambda: len(_lines_by_id(out / "B" / "raw_responses.jsonl")) >= len(accepted), 120, "B's records"
    )
    for proc in roles:
        assert stop(proc, timeout=60) == 0, log_of(proc)
    # The records it rejected or failed on are A's rejected samples, apart: they make no row of B.
    apart = {r["row"]: r["check"]["status"] for r in read_jsonl(out / "A" / "rejected_samples.jsonl")}
    assert {row for row, status in apart.items() if status == "check_failed"} == {0, 5, 10, 15, 20, 25}
    rejected = {row for row in range(rows) if row % 2 and row % 5}
    assert {row for row, status in apart.items() if status == "rejected"} == rejected
    b = read_jsonl(out / "B" / "raw_responses.jsonl")
    assert sorted(r["parent"] for r in b) == sorted(f"A-{row}" for row in accepted)
    verified = procs.run("verify", "--out", out, "--dataset", "B")
    assert verified.returncode == 0 and f"B: {len(accepted)} expected" in verified.stdout, verified.stdout
