"""A server that answers without text (SGLang's --skip-tokenizer-init), and one whose every answer
is wrong: the first is served, the second costs a few generations and holds the worker's jobs.

On the simulator, which answers as the real 0.5.23 does with the flag (tests/test_real_sglang.py
checks it against the real server) and can make every answer wrong on demand (the no_text fault:
no text from a server whose /server_info says it runs its tokenizer). GPU work is counted at the
server: every request id it received (/sim/rids), each genq job's ``<job>.<attempt>.<nonce>``.
"""

from __future__ import annotations

import subprocess
from collections import Counter

import pytest

from genq.commands.embedded import free_port
from genq.worker.gate import WRONG_IN_A_ROW
from tests.helpers import (
    check_records,
    finish_run,
    genq_argv,
    log_of,
    read_jsonl,
    server_up,
    sigkill,
    sim_get,
    sim_post,
    sim_stats,
    status_json,
    wait_for_records,
    wait_until,
    write_prompts,
)

MAX_NEW = 40
PARAMS = {"max_new_tokens": MAX_NEW}


def _generations(url: str) -> Counter[str]:
    """How often the server was asked to generate each job (probes left out)."""
    return Counter(
        rid.split(".", 1)[0] for rid in sim_get(url, "/sim/rids") if not rid.startswith("genq-probe.")
    )


def _probes(url: str) -> int:
    return sum(rid.startswith("genq-probe.") for rid in sim_get(url, "/sim/rids"))


def test_a_server_that_skips_its_tokenizer_serves_every_job_without_text(procs, start_sim, out, tmp_path):
    """No text in any answer, as /server_info says: every job done at its first send, the server's
    ids exact, text null (the dataset has no tokenizer to decode with: said once), nothing failed."""
    url = start_sim("--skip-tokenizer-init")
    assert sim_get(url, "/server_info")["skip_tokenizer_init"] is True
    data = tmp_path / "skip.jsonl"
    prompts = write_prompts(data, 120)
    assert procs.run("enqueue", data, "--max-new-tokens", str(MAX_NEW)).returncode == 0
    worker = procs.start("worker", "--server", url, "--burst", "--concurrency", "16", "--max-attempts", "1")
    assert worker.wait(120) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    records = check_records(out, "skip", prompts, PARAMS)
    assert all(r["text"] is None and r["content"] is None and r["attempts"] == 1 for r in records)
    assert not read_jsonl(out / "skip" / "errors.jsonl")
    log = log_of(worker)
    assert "skips its tokenizer" in log, log
    assert log.count("enqueued without --tokenizer") == 1, log
    assert sorted(_generations(url).values()) == [1] * len(prompts), "a job was generated twice"


def test_stop_strings_wait_for_a_server_that_runs_its_tokenizer(procs, start_sim, out, tmp_path):
    """SGLang without its tokenizer refuses stop strings (400 for every job): the worker leaves such
    a dataset queued, saying why once; a worker on a server with its tokenizer then serves it."""
    skipping, whole = start_sim("--skip-tokenizer-init"), start_sim()
    data = tmp_path / "stops.jsonl"
    prompts = write_prompts(data, 30)
    params = ("--max-new-tokens", str(MAX_NEW), "--sampling-params", '{"stop": ["zzz"]}')
    assert procs.run("enqueue", data, *params).returncode == 0
    declining = procs.start("worker", "--server", skipping)
    said = "dataset stops: its sampling uses stop, which SGLang started with --skip-tokenizer-init refuses"
    wait_until(lambda: said in log_of(declining), 60, "the worker to say why it leaves the dataset")
    assert status_json(procs)["datasets"]["stops"]["queued"] == 30
    assert sum(_generations(skipping).values()) == 0, "a job was sent to the server that refuses it"
    serving = procs.start("worker", "--server", whole, "--burst")
    assert serving.wait(120) == 0, log_of(serving)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    check_records(out, "stops", prompts, {**PARAMS, "stop": ["zzz"]})
    assert sum(_generations(skipping).values()) == 0
    assert declining.poll() is None and log_of(declining).count(said) == 1, log_of(declining)


def test_a_server_wrong_from_the_start_costs_no_job(procs, start_sim, out, tmp_path):
    """Every answer without text from a server that says it runs its tokenizer: the start-up probe's
    own answer is checked as a job's would be, so the worker takes no job, says what to check, and
    probes on; once answers pass, every job is generated once."""
    url = start_sim("--fail-no-text", "1")
    data = tmp_path / "wrong.jsonl"
    prompts = write_prompts(data, 60)
    assert procs.run("enqueue", data, "--max-new-tokens", str(MAX_NEW)).returncode == 0
    worker = procs.start("worker", "--server", url, "--burst", "--max-attempts", "1")
    wait_until(lambda: log_of(worker).count("not ready") >= 2, 60, "two probes refused")
    assert "is it started with --skip-tokenizer-init?" in log_of(worker), log_of(worker)
    assert sum(_generations(url).values()) == 0, "a job was sent to a server whose answers are all wrong"
    sim_post(url, "/sim/faults", {"no_text": 0.0})
    assert worker.wait(120) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    check_records(out, "wrong", prompts, PARAMS)
    assert sorted(_generations(url).values()) == [1] * len(prompts)


@pytest.mark.timeout(420)
def test_answers_gone_wrong_mid_run_hold_the_worker_after_a_few_generations(
    procs, start_sim, out, tmp_path, report
):
    """Mid-run every answer turns wrong the same way: after WRONG_IN_A_ROW jobs' answers the worker
    holds all its jobs (status says why), so the server makes only what was already in flight plus
    the probes; once answers pass it resumes. With --max-attempts 2 a job charged for each wrong
    answer would fail (--max-attempts 3, the answers wrong for longer than three sends take): none
    does."""
    concurrency = 8
    url = start_sim("--latency", "realistic", "--decode-step-ms", "10", "--min-len", "20", "--max-len", "40")
    data = tmp_path / "midrun.jsonl"
    prompts = write_prompts(data, 300)
    assert procs.run("enqueue", data, "--max-new-tokens", str(MAX_NEW)).returncode == 0
    worker = procs.start("worker", "--server", url, "--concurrency", str(concurrency), "--max-attempts", "3")
    collector = procs.start("collect", "--out", out)
    wait_for_records(procs, "midrun", 60, 120, in_flight=True)
    before = sum(_generations(url).values())
    sim_post(url, "/sim/faults", {"no_text": 1.0})
    held_line = f"answered {WRONG_IN_A_ROW} jobs in a row wrongly"
    wait_until(lambda: held_line in log_of(worker), 60, "the worker to hold its jobs")
    assert "is it started with --skip-tokenizer-init?" in log_of(worker), log_of(worker)
    wait_until(lambda: sim_stats(url)["in_flight"] == 0, 60, "what was in flight to come back")
    held = sum(_generations(url).values())
    probes = _probes(url)
    # The worker's next report (every few seconds) says it holds its jobs, and why.
    wait_until(
        lambda: any(
            "takes no jobs" in w and "--skip-tokenizer-init" in w for w in status_json(procs)["warnings"]
        ),
        30,
        "status to say the worker takes no jobs and why",
    )
    # Held, probed 1, 1, 2 and 4 s apart (longer than three sends and their backoffs would take
    # without the hold), and no job is sent meanwhile.
    wait_until(lambda: _probes(url) >= probes + 3, 60, "three more probes while held")
    assert sum(_generations(url).values()) == held, "a job was sent while the worker held its jobs"
    wasted = held - before
    report(f"answers turned wrong mid-run, {concurrency} in flight: {wasted} generations before the hold")
    # What was in flight when the answers turned, and what started before the third came back.
    assert wasted <= 2 * concurrency, f"{wasted} generations made after the answers turned wrong"
    sim_post(url, "/sim/faults", {"no_text": 0.0})
    finish_run(procs, "midrun", len(prompts), 120, worker, collector)
    records = check_records(out, "midrun", prompts, PARAMS, min_len=20, max_len=40)
    assert not read_jsonl(out / "midrun" / "errors.jsonl"), "a wrong answer of the server's failed a job"
    charged = [r["id"] for r in records if r["attempts"] > 1]
    assert len(charged) <= concurrency, charged
    assert max(_generations(url).values()) <= 3, _generations(url).most_common(3)
    assert "is up again; resuming" in log_of(worker)


def test_a_server_restarted_with_skip_tokenizer_init_is_read_again(procs, out, tmp_path):
    """The server comes back on its port started with --skip-tokenizer-init: the worker, having
    seen it go, probes it again before it resumes and reads the flag anew, so its answers without
    text are right, not wrong: no job charged or failed, each record the server's ids."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = genq_argv("sim-server", "--port", str(port), "--latency", "realistic", "--decode-step-ms", "5")
    sim = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    data = tmp_path / "restart.jsonl"
    prompts = write_prompts(data, 200)
    try:
        wait_until(lambda: server_up(url), 30, "the simulator")
        assert procs.run("enqueue", data, "--max-new-tokens", str(MAX_NEW)).returncode == 0
        worker = procs.start("worker", "--server", url, "--concurrency", "8", "--max-attempts", "1")
        collector = procs.start("collect", "--out", out)
        wait_for_records(procs, "restart", 50, 120, in_flight=True)
        sigkill(sim)
        wait_until(lambda: "looks down" in log_of(worker), 60, "the worker to see the server go")
        sim = subprocess.Popen([*argv, "--skip-tokenizer-init"], stdout=subprocess.DEVNULL)
        finish_run(procs, "restart", len(prompts), 120, worker, collector)
    finally:
        sim.kill()
    records = check_records(out, "restart", prompts, PARAMS)
    assert not read_jsonl(out / "restart" / "errors.jsonl")
    assert all(r["attempts"] == 1 for r in records), "a send was charged across the restart"
    without = [r for r in records if r["text"] is None]
    assert 0 < len(without) < len(records), "no record from after the restart, or none from before"
    assert "skips its tokenizer" in log_of(worker), log_of(worker)
