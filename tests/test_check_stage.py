"""The check stage end to end (issue 41): enqueue --accept K --max-samples M, a worker on the
simulator, `genq check` with a seeded checker that accepts about a third, and the collector.

The checker's verdict on each sample is a function of its id, so what every prompt must end with
is known beforehand: its samples are drawn in order, one more for each not accepted, so a prompt
ends with the fewest samples holding K accepted ones, or with M drawn. The files must hold exactly
that — accepted records in raw_responses.jsonl, the others in rejected_samples.jsonl, each once —
and the server must have generated each drawn sample once."""

from __future__ import annotations

import hashlib
import os
import subprocess
import textwrap
from collections import Counter

import orjson
import pyarrow.parquet as pq
import pytest
import redis
from rq import Queue

from genq import progress
from genq.checker.loop import FAILS_IN_A_ROW
from genq.keys import Keys
from genq.schema import record_id
from tests.helpers import (
    assert_verified,
    check_settled,
    genq_argv,
    log_of,
    read_jsonl,
    sigkill,
    sim_get,
    sim_stats,
    status_json,
    stop,
    wait_until,
    write_prompts,
)

CHECKS = textwrap.dedent(
    """
    import hashlib

    def third(record):
        digest = hashlib.blake2b(record["id"].encode(), digest_size=8).digest()
        accepted = int.from_bytes(digest, "big") % 3 == 0
        return {"accepted": accepted, "score": float(accepted), "reason": "" if accepted else "not this one"}
    """
)


def accepts(rid: str) -> bool:
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "big") % 3 == 0


def expected(dataset: str, rows: int, k: int, m: int) -> dict[int, tuple[int, int]]:
    """Per row: (samples drawn, of them accepted)."""
    found = {}
    for row in range(rows):
        accepted = drawn = 0
        while drawn < m and accepted < k:
            accepted += accepts(record_id(dataset, row, drawn, m))
            drawn += 1
        found[row] = (drawn, accepted)
    return found


@pytest.mark.timeout(300)
def test_k_accepted_per_prompt_within_m_samples(procs, start_sim, out, tmp_path):
    (tmp_path / "user_checks.py").write_text(CHECKS)
    env_path = f"{tmp_path}"
    rows, k, m = 300, 2, 6
    data = tmp_path / "maths.jsonl"
    write_prompts(data, rows)
    lines = [orjson.loads(line) for line in data.read_bytes().splitlines()]
    data.write_bytes(b"".join(orjson.dumps({**row, "answer": str(i)}) + b"\n" for i, row in enumerate(lines)))
    url = start_sim("--latency", "realistic", "--decode-step-ms", "2", "--min-len", "8", "--max-len", "32")
    res = procs.run(
        "enqueue", data, "--max-new-tokens", "32", "--accept", k, "--max-samples", m, "--keep-field", "answer"
    )
    assert res.returncode == 0, res.stderr
    worker = procs.start("worker", "--server", url, "--concurrency", "32")
    checker = procs.start(
        "check", "--check", "user_checks:third", "--concurrency", "4", env={"PYTHONPATH": env_path}
    )
    collector = procs.start("collect", "--out", out)

    counts = check_settled(procs, "maths", 240)
    for proc in (worker, checker, collector):
        assert stop(proc, timeout=60) == 0, log_of(proc)

    want = expected("maths", rows, k, m)
    accepted = read_jsonl(out / "maths" / "raw_responses.jsonl")
    rejected = read_jsonl(out / "maths" / "rejected_samples.jsonl")
    assert not (out / "maths" / "errors.jsonl").exists() or not read_jsonl(out / "maths" / "errors.jsonl")
    ids = [r["id"] for r in accepted + rejected]
    assert len(ids) == len(set(ids)), "a sample filed twice"
    got_accepted = Counter(r["row"] for r in accepted)
    got_drawn = Counter(r["row"] for r in accepted + rejected)
    assert {row: (got_drawn[row], got_accepted[row]) for row in range(rows)} == want
    assert all(r["check"]["status"] == "accepted" and accepts(r["id"]) for r in accepted)
    assert all(
        r["check"]["status"] == "rejected" and r["check"]["reason"] == "not this one" for r in rejected
    )
    assert all(r["fields"] == {"answer": str(r["row"])} for r in accepted), "the kept field travels"
    assert all(r["check"]["checker"].startswith("user_checks:third sha256:") for r in accepted)
    short = [row for row, (drawn, got) in want.items() if got < k]
    assert short, "the seeded checker leaves some prompts short of K within M: the test covers them"
    assert counts["verdicts"] == {"accepted": len(accepted), "rejected": len(rejected)}
    assert counts["total"] == sum(drawn for drawn, _ in want.values())
    assert_verified(procs, out, data)
    check = status_json(procs)["datasets"]["maths"]["check"]
    judged = len(accepted) + len(rejected)
    assert (check["accepted"], check["rejected"], check["check_failed"]) == (len(accepted), len(rejected), 0)
    assert check["acceptance"] == round(len(accepted) / judged, 4)
    assert check["samples_per_accepted"] == round(judged / len(accepted), 2)
    assert check["checker_s"] is not None and check["checker_errors"] == 0
    (identity,) = check["checkers"]
    assert identity.startswith("user_checks:third sha256:") and check["checkers"][identity] == judged
    recorded = orjson.loads((out / "maths" / "provenance.json").read_bytes())["check"]
    assert recorded["checkers"] == check["checkers"], "the checker's identity is kept with the dataset"
    # The files alone say as much: stats lists the prompts short of K, the report shows the stage.
    from_files = orjson.loads(procs.run("stats", out, "--json").stdout)["datasets"]["maths"]["check"]
    assert from_files["verdicts"] == {"accepted": len(accepted), "rejected": len(rejected)}
    assert (from_files["accept"], from_files["max_samples"]) == (k, m)
    assert from_files["short_of_k_rows"] == short[:100] and from_files["short_of_k"] == len(short)
    assert from_files["prompts_with_k"] == rows - len(short)
    report = procs.run("report", out, "--output", tmp_path / "report.html")
    assert report.returncode == 0, report.stderr
    assert f"prompts short after {m} samples" in (tmp_path / "report.html").read_text()
    # Exports hold the accepted samples only, and their card says so.
    assert procs.run("export", out, "--format", "parquet", "--license", "mit").returncode == 0
    shards = sorted((out / "maths").glob("records-*.parquet"))
    assert sum(pq.read_metadata(shard).num_rows for shard in shards) == len(accepted)
    card = (out / "maths" / "README.md").read_text()
    assert f"Checked: {len(accepted):,} samples accepted" in card
    # How to make it again: the commands that were run, the checker's with its options.
    assert f"| samples per prompt | {k} accepted of at most {m} samples |" in card, card
    again = card.split("## How to make it again", 1)[1]
    assert "Enqueued with:" in again and "Judged with:" in again and "\ngenq check " in again, again
    shown = procs.run("status").stdout
    assert "check" in shown and f"{len(accepted):,}" in shown, shown
    # Each drawn sample generated once, and nothing else but the worker's start-up probe.
    assert sim_stats(url)["generations"] - 1 == len(ids)


def outcome(out, dataset: str) -> tuple[list[dict], list[dict]]:
    """The accepted and the other records of ``dataset``; each id once across both files."""
    accepted = read_jsonl(out / dataset / "raw_responses.jsonl")
    others = read_jsonl(out / dataset / "rejected_samples.jsonl")
    ids = [r["id"] for r in accepted + others]
    assert len(ids) == len(set(ids)), "a sample filed twice"
    return accepted, others


def verdicts_filed(procs, dataset: str) -> int:
    conn = redis.Redis.from_url(procs.env["GENQ_REDIS_URL"])
    return sum(progress.check_counts(conn, Keys(procs.env["GENQ_NAMESPACE"]), dataset).values())


@pytest.mark.timeout(420)  # in `make test-quick` too: the check stage's kill test
def test_a_kill_of_any_role_at_any_time_changes_nothing_of_the_result(procs, start_sim, out, tmp_path):
    """The checker, a worker and the collector are each SIGKILLed mid-run and started again: every
    prompt ends exactly as without the kills, no sample is filed twice, the counts in Redis are the
    files', and the server generated no more than the killed worker had in flight."""
    (tmp_path / "user_checks.py").write_text(CHECKS)
    checker_env = {"PYTHONPATH": str(tmp_path)}
    rows, k, m = 150, 2, 6
    data = tmp_path / "kills.jsonl"
    write_prompts(data, rows)
    url = start_sim("--latency", "realistic", "--decode-step-ms", "10", "--min-len", "16", "--max-len", "64")
    assert (
        procs.run("enqueue", data, "--max-new-tokens", "64", "--accept", k, "--max-samples", m).returncode
        == 0
    )
    in_flight = 16
    roles = {
        "worker": ("worker", "--server", url, "--concurrency", str(in_flight), "--heartbeat-ttl", "5"),
        "check": ("check", "--check", "user_checks:third", "--concurrency", "4"),
        "collect": ("collect", "--out", str(out)),
    }
    running = {
        name: procs.start(*argv, env=checker_env if name == "check" else None) for name, argv in roles.items()
    }
    total = sum(drawn for drawn, _ in expected("kills", rows, k, m).values())
    conn = redis.Redis.from_url(procs.env["GENQ_REDIS_URL"])
    keys = Keys(procs.env["GENQ_NAMESPACE"])
    started = Queue(keys.queue_name("kills"), connection=conn, serializer="json").started_job_registry.key
    caught: set[str] = set()
    for at, victim in ((0.2, "check"), (0.45, "worker"), (0.7, "collect")):
        wait_until(
            lambda at=at: verdicts_filed(procs, "kills") >= at * total, 120, f"{at:.0%} of the verdicts"
        )
        filed = verdicts_filed(procs, "kills")
        sigkill(running[victim])
        # Each kill lands mid-run: verdicts were still to be filed.
        assert filed < total, f"the {victim} was killed after the run had settled"
        if victim == "worker":
            # What the dead worker held and had already asked the server for: generated twice.
            held = {member.decode().split(":")[0] for member in conn.zrange(started, 0, -1)}
            asked = {rid.split(".", 1)[0] for rid in sim_get(url, "/sim/rids")}
            caught = held & asked
        running[victim] = procs.start(*roles[victim], env=checker_env if victim == "check" else None)
    counts = check_settled(procs, "kills", 240)
    for proc in running.values():
        assert stop(proc, timeout=60) == 0, log_of(proc)

    accepted, others = outcome(out, "kills")
    got = {row: (0, 0) for row in range(rows)}
    for r in accepted + others:
        drawn, ok = got[r["row"]]
        got[r["row"]] = (drawn + 1, ok + (r["check"]["status"] == "accepted"))
    assert got == expected("kills", rows, k, m)
    assert counts["verdicts"] == {"accepted": len(accepted), "rejected": len(others)}
    assert_verified(procs, out, data)
    # Each sample generated once, but those the killed worker held and had asked for (at the server,
    # or answered and waiting for their group commit): exactly those twice.
    rids = sim_get(url, "/sim/rids")
    asked = Counter(rid.split(".", 1)[0] for rid in rids if not rid.startswith("genq-probe."))
    twice = {job for job, n in asked.items() if n > 1}
    assert twice == caught and max(asked.values()) <= 2, (sorted(twice ^ caught)[:5], asked.most_common(2))
    assert caught, "the kill caught no generation: it landed between two"
    # The server finished each sample once and some of the caught ones again (two workers' probes).
    wasted = sim_stats(url)["generations"] - 2 - (len(accepted) + len(others))
    assert 0 <= wasted <= len(caught), wasted


CHECK_SH = textwrap.dedent(
    """\
    #!/bin/sh
    # A checker in another language: the record on stdin, a verdict on stdout; each try's record id
    # appended to the file named by its argument (the test counts the tries).
    record=$(cat)
    echo "$record" | grep -o '"id": "[^"]*"' >>"$1"
    if echo "$record" | grep -q '"id": "[a-z]*-[0-9]*7"'; then sleep 600; fi
    if echo "$record" | grep -q '"id": "[a-z]*-[0-9]*5"'; then echo "no sandbox here" >&2; exit 3; fi
    if echo "$record" | grep -q '"id": "[a-z]*-[0-9]*[02468]"'; then
      echo '{"accepted": true, "score": 1}'
    else
      echo '{"accepted": false, "score": 0, "reason": "odd"}'
    fi
    """
)


@pytest.mark.timeout(300)
def test_a_command_checker_that_hangs_or_crashes_is_bounded_and_its_records_kept(
    procs, start_sim, out, tmp_path
):
    """--check-cmd with a shell script over a --checked dataset: records it hangs on (past
    --timeout) or crashes on are tried --max-check-attempts times, then filed check_failed with
    the checker's last words; none is lost, the others are judged."""
    script = tmp_path / "check.sh"
    script.write_text(CHECK_SH)
    tries = tmp_path / "tries.log"
    rows = 60
    data = tmp_path / "docs.jsonl"
    write_prompts(data, rows)
    url = start_sim("--latency", "zero")
    assert procs.run("enqueue", data, "--max-new-tokens", "16", "--checked").returncode == 0
    roles = [
        procs.start("worker", "--server", url, "--concurrency", "16"),
        procs.start(
            "check", "--check-cmd", f"sh {script} {tries}", "--timeout", "1", "--max-check-attempts", "2"
        ),
        procs.start("collect", "--out", out),
    ]
    counts = check_settled(procs, "docs", 240)
    for proc in roles:
        assert stop(proc, timeout=60) == 0, log_of(proc)

    accepted, others = outcome(out, "docs")
    status = {r["row"]: r["check"]["status"] for r in accepted + others}
    assert status == {
        row: "check_failed" if row % 10 in (5, 7) else "accepted" if row % 2 == 0 else "rejected"
        for row in range(rows)
    }
    failed = [r for r in others if r["check"]["status"] == "check_failed"]
    assert all("no sandbox here" in r["check"]["reason"] for r in failed if r["row"] % 10 == 5)
    assert all("within 1 s" in r["check"]["reason"] for r in failed if r["row"] % 10 == 7)
    assert counts["verdicts"] == dict(Counter(status.values()))
    # Tried --max-check-attempts (2) times where it hangs or crashes, once elsewhere; every failed
    # try counted in status.
    tried = Counter(orjson.loads("{" + line + "}")["id"] for line in tries.read_text().splitlines())
    assert tried == {f"docs-{row}": 2 if row % 10 in (5, 7) else 1 for row in range(rows)}, tried
    assert status_json(procs)["datasets"]["docs"]["check"]["checker_errors"] == 2 * len(failed)
    assert_verified(procs, out, data)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_what_a_killed_checker_was_judging_is_taken_up_by_another(procs, start_sim, out, tmp_path):
    """A checker SIGKILLed in the middle of slow checks leaves those records pending in its group:
    the next checker takes them up once they have been idle for CLAIM_AFTER_S (a live checker
    keeps touching what it judges), and each is filed once."""
    (tmp_path / "slow_checks.py").write_text(
        "import time\n\ndef slow(record):\n    time.sleep(3)\n    return True\n"
    )
    env = {"PYTHONPATH": str(tmp_path)}
    rows = 12
    data = tmp_path / "slow.jsonl"
    write_prompts(data, rows)
    url = start_sim("--latency", "zero")
    assert procs.run("enqueue", data, "--max-new-tokens", "16", "--checked").returncode == 0
    worker = procs.start("worker", "--server", url, "--concurrency", "16")
    collector = procs.start("collect", "--out", out)
    first = procs.start("check", "--check", "slow_checks:slow", "--concurrency", "4", env=env)
    conn = redis.Redis.from_url(procs.env["GENQ_REDIS_URL"])
    keys = Keys(procs.env["GENQ_NAMESPACE"])

    def judging() -> bool:
        try:
            return conn.xpending(keys.unchecked("slow"), keys.checkers_group)["pending"] >= 4
        except redis.ResponseError:  # its group is not made yet
            return False

    wait_until(judging, 60, "the first checker judging 4 records")
    sigkill(first)
    second = procs.start("check", "--check", "slow_checks:slow", "--concurrency", "4", env=env)
    counts = check_settled(procs, "slow", 200)
    for proc in (worker, second, collector):
        assert stop(proc, timeout=60) == 0, log_of(proc)
    assert "endings of slow a checker that is gone held" in log_of(second)
    accepted, others = outcome(out, "slow")
    assert sorted(r["row"] for r in accepted) == list(range(rows)) and not others
    assert counts["verdicts"] == {"accepted": rows}


@pytest.mark.parametrize("on_pythonpath", [True, False], ids=["on PYTHONPATH", "working folder"])
def test_a_checker_beside_the_users_own_checker_py_and_worker_py(
    procs, start_sim, out, tmp_path, on_pythonpath
):
    """`genq check --check mychecks:judge` run from a folder that also holds the user's own
    `checker.py` and `worker.py` (the most natural names), that folder on PYTHONPATH or only the
    working folder: genq's packages are genq.checker and genq.worker, so nothing of the user's
    shadows them, and the user's module is found (the working folder is searched last)."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "checker.py").write_text("raise SystemExit('the user checker.py was imported')\n")
    (folder / "worker.py").write_text("raise SystemExit('the user worker.py was imported')\n")
    (folder / "mychecks.py").write_text("def judge(record):\n    return record['row'] % 2 == 0\n")
    data = tmp_path / "mine.jsonl"
    write_prompts(data, 20)
    url = start_sim("--latency", "zero")
    assert procs.run("enqueue", data, "--max-new-tokens", "16", "--checked").returncode == 0
    env = {"PYTHONPATH": str(folder)} if on_pythonpath else None
    roles = [
        procs.start("worker", "--server", url, env=env, cwd=folder),
        procs.start("check", "--check", "mychecks:judge", env=env, cwd=folder),
        procs.start("collect", "--out", out),
    ]
    counts = check_settled(procs, "mine", 120)
    for proc in roles:
        assert stop(proc, timeout=60) == 0, log_of(proc)
    assert counts["verdicts"] == {"accepted": 10, "rejected": 10}, counts
    accepted, others = outcome(out, "mine")
    assert sorted(r["row"] for r in accepted) == list(range(0, 20, 2))


def test_genq_run_takes_the_check_stage_and_genq_check_attaches_to_its_folder(tmp_path):
    """One command for a checked run: `genq run --accept K --max-samples M --check MOD:FN` starts the
    checker beside the workers; every prompt ends as the checker implies. A checked dataset without
    a checker (or a checker without one) is refused in one line before anything starts; `genq check
    --out OUT` finds the run's private Redis again afterwards."""
    (tmp_path / "user_checks.py").write_text(CHECKS)
    rows, k, m = 40, 1, 3
    data = tmp_path / "ran.jsonl"
    write_prompts(data, rows)
    out = tmp_path / "out"
    env = {**{key: v for key, v in os.environ.items() if key != "GENQ_REDIS_URL"}}
    base = [
        *genq_argv("run", data, "--out", out, "--simulate", "--sim-latency", "zero"),
        "--max-new-tokens",
        "16",
    ]
    for flags, said in (
        (("--accept", "1", "--max-samples", "3"), "needs this host's checker"),
        (("--check", "user_checks:third"), "judge a checked dataset"),
    ):
        res = subprocess.run(
            [*base, *flags], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
        )
        assert res.returncode == 2 and said in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert not (out / ".redis").exists(), "something started before the refusal"
    flags = ("--accept", str(k), "--max-samples", str(m), "--check", "user_checks:third")
    res = subprocess.run([*base, *flags], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    accepted, others = outcome(out, "ran")
    got = {row: (0, 0) for row in range(rows)}
    for r in accepted + others:
        drawn, ok = got[r["row"]]
        got[r["row"]] = (drawn + 1, ok + (r["check"]["status"] == "accepted"))
    assert got == expected("ran", rows, k, m)
    export = genq_argv("export", out, "--format", "parquet")
    exported = subprocess.run(export, capture_output=True, text=True, env=env, timeout=120)
    assert exported.returncode == 0, exported.stderr
    again = (out / "ran" / "README.md").read_text().split("## How to make it again", 1)[1]
    assert "Made with one command" in again and "\ngenq run " in again, again
    assert "--check user_checks:third" in again, again
    assert "Enqueued with" not in again, again
    attach = [*genq_argv("check", "--out", out, "--check", "user_checks:third", "--burst")]
    res = subprocess.run(attach, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert res.returncode == 0 and "has ended" in res.stderr, res.stderr[-2000:]


BROKEN_UNTIL_FIXED = textwrap.dedent(
    """
    import os
    from user_checks import third

    def judge(record):
        if os.path.exists(os.environ["BROKEN_FLAG"]):
            raise RuntimeError("no sandbox here")
        return third(record)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_checker_that_fails_on_every_record_holds_its_dataset_and_draws_nothing(
    procs, start_sim, out, tmp_path
):
    """A checker broken at first, then fixed: after FAILS_IN_A_ROW records failed in a row the
    dataset is held (status says why), no sample beyond the first draw is generated meanwhile and
    no record is filed check_failed but the few tried before the hold; once the checker works, the
    waiting records are judged at once and every prompt ends as the fixed checker implies."""
    (tmp_path / "user_checks.py").write_text(CHECKS)
    (tmp_path / "broken_checks.py").write_text(BROKEN_UNTIL_FIXED)
    flag = tmp_path / "broken"
    flag.touch()
    env = {"PYTHONPATH": str(tmp_path), "BROKEN_FLAG": str(flag)}
    rows, k, m = 60, 1, 3
    data = tmp_path / "held.jsonl"
    write_prompts(data, rows)
    url = start_sim("--latency", "zero")
    assert (
        procs.run("enqueue", data, "--max-new-tokens", "16", "--accept", k, "--max-samples", m).returncode
        == 0
    )
    roles = [
        procs.start("worker", "--server", url, "--concurrency", "16"),
        procs.start("check", "--check", "broken_checks:judge", "--concurrency", "4", env=env),
        procs.start("collect", "--out", out),
    ]
    said = "the check stage holds it"
    wait_until(lambda: any(said in w for w in status_json(procs)["warnings"]), 60, "the dataset to be held")
    wait_until(lambda: sim_stats(url)["generations"] >= rows + 1, 60, "the first draws generated")
    first = sim_stats(url)["generations"]
    filed_early = progress.check_counts(
        redis.Redis.from_url(procs.env["GENQ_REDIS_URL"]), Keys(procs.env["GENQ_NAMESPACE"]), "held"
    )
    # Held a while (two tries of the checker at least): nothing drawn, nothing filed meanwhile.
    log = roles[1]
    wait_until(lambda: log_of(log).count("the checker failed on") >= 8, 60, "the held checker tried again")
    assert sim_stats(url)["generations"] == first == rows + 1, "a sample was drawn while the checker failed"
    assert set(filed_early) <= {"check_failed"} and filed_early.get("check_failed", 0) < FAILS_IN_A_ROW
    flag.unlink()  # fixed
    counts = check_settled(procs, "held", 120)
    assert "the hold is lifted" in log_of(log), log_of(log)
    assert not any(said in w for w in status_json(procs)["warnings"])
    # The few filed check_failed before the hold drew nothing; judged again by the fixed checker.
    accepted, others = outcome(out, "held")
    failed = {r["row"] for r in others if r["check"]["status"] == "check_failed"}
    assert all(sum(1 for r in accepted + others if r["row"] == row) == 1 for row in failed)
    assert counts["verdicts"].get("check_failed", 0) == len(failed) < FAILS_IN_A_ROW
    assert procs.run("retry", "--check-failed").returncode == 0
    check_settled(procs, "held", 120)
    for proc in roles:
        assert stop(proc, timeout=60) == 0, log_of(proc)
    accepted, others = superseded(out, "held")
    got = {row: (0, 0) for row in range(rows)}
    for r in accepted + others:
        drawn, ok = got[r["row"]]
        got[r["row"]] = (drawn + 1, ok + (r["check"]["status"] == "accepted"))
    assert got == expected("held", rows, k, m), "every prompt as the fixed checker implies"
    assert sim_stats(url)["generations"] - 1 == sum(drawn for drawn, _ in got.values()), "each sample once"


FAILS_ON_SOME = textwrap.dedent(
    """
    import os
    from user_checks import third

    def judge(record):
        if record["row"] % 10 == 0 and os.path.exists(os.environ["BROKEN_FLAG"]):
            raise RuntimeError("no sandbox for this one")
        return third(record)
    """
)


def superseded(out, dataset: str) -> tuple[list[dict], list[dict]]:
    """The accepted and the other records of ``dataset``, each id's last line (a record judged
    again supersedes its check_failed line, whichever file holds it)."""
    last: dict[str, dict] = {}
    for name in ("rejected_samples.jsonl", "raw_responses.jsonl"):
        for r in read_jsonl(out / dataset / name):
            if r["id"] not in last or r.get("rejudged", 0) > last[r["id"]].get("rejudged", 0):
                last[r["id"]] = r
    accepted = [r for r in last.values() if r["check"]["status"] == "accepted"]
    return accepted, [r for r in last.values() if r["check"]["status"] != "accepted"]


@pytest.mark.timeout(300)
def test_records_the_checker_failed_on_are_judged_again_once_it_is_fixed(procs, start_sim, out, tmp_path):
    """A checker that fails on some records (every tenth row's): they are filed check_failed and
    draw nothing; `genq failed` lists them; once the checker is fixed, `genq retry --check-failed`
    has them judged again without generating anything again: every prompt then ends as the fixed
    checker implies, the server generated each drawn sample once, verify and stats agree."""
    (tmp_path / "user_checks.py").write_text(CHECKS)
    (tmp_path / "some_checks.py").write_text(FAILS_ON_SOME)
    flag = tmp_path / "broken"
    flag.touch()
    env = {"PYTHONPATH": str(tmp_path), "BROKEN_FLAG": str(flag)}
    rows, k, m = 60, 1, 3
    data = tmp_path / "again.jsonl"
    write_prompts(data, rows)
    url = start_sim("--latency", "zero")
    enqueued = procs.run("enqueue", data, "--max-new-tokens", "16", "--accept", k, "--max-samples", m)
    assert enqueued.returncode == 0, enqueued.stderr
    roles = [
        procs.start("worker", "--server", url, "--concurrency", "8"),
        procs.start("check", "--check", "some_checks:judge", "--max-check-attempts", "2", env=env),
        procs.start("collect", "--out", out),
    ]
    counts = check_settled(procs, "again", 120)
    failing = {row for row in range(rows) if row % 10 == 0}
    assert counts["verdicts"]["check_failed"] == len(failing), counts
    listed = orjson.loads(procs.run("failed", "--json").stdout)["check_failed"]["again"]
    assert listed["count"] == len(failing) and {c["id"] for c in listed["last"]} == {
        record_id("again", row, 0, m) for row in failing
    }, listed
    assert "no sandbox for this one" in listed["last"][0]["reason"]
    assert "then genq retry --check-failed" in " ".join(procs.run("failed").stdout.split())

    flag.unlink()  # the checker fixed
    sent = procs.run("retry", "--check-failed")
    assert sent.returncode == 0, sent.stderr
    assert f"again: {len(failing)} records the checker failed on sent to be judged again" in sent.stdout
    counts = check_settled(procs, "again", 120)
    assert "check_failed" not in counts["verdicts"], counts
    nothing = procs.run("retry", "--check-failed")
    assert "again: 0 records" in nothing.stdout, "sent once"
    for proc in roles:
        assert stop(proc, timeout=60) == 0, log_of(proc)
    accepted, others = superseded(out, "again")
    got = {row: (0, 0) for row in range(rows)}
    for r in accepted + others:
        drawn, ok = got[r["row"]]
        got[r["row"]] = (drawn + 1, ok + (r["check"]["status"] == "accepted"))
    assert got == expected("again", rows, k, m)
    judged_again = [r for r in accepted + others if r.get("rejudged")]
    assert {r["row"] for r in judged_again} == failing and all(r["sample"] == 0 for r in judged_again)
    # Nothing generated again: each drawn sample once, and the worker's start-up probe.
    assert sim_stats(url)["generations"] - 1 == sum(drawn for drawn, _ in got.values())
    assert_verified(procs, out, data)
    from_files = orjson.loads(procs.run("stats", out, "--json").stdout)["datasets"]["again"]
    assert from_files["check"]["verdicts"] == {
        s: n for s, n in (("accepted", len(accepted)), ("rejected", len(others))) if n
    }, from_files["check"]
    assert from_files["records"] == len(accepted) + len(others), "a record judged again counted once"
    tokens = status_json(procs)["datasets"]["again"]
    assert tokens["completion_tokens"] == sum(r["completion_tokens"] for r in accepted + others), tokens
