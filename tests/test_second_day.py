"""A user's second day with `genq run` (issue #38): run from any folder, runs that never touch
each other's processes, a Ctrl-C that does not turn the jobs in flight into crash suspects."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from genq.commands.embedded import EmbeddedRedis
from tests.helpers import check_records, sim_get, wait_until, write_prompts, written_lines

# The console script, as a user types `genq`: not `python -m genq`, which puts the current folder
# first on sys.path itself.
GENQ = str(Path(sys.executable).parent / "genq")
PARAMS = {"max_new_tokens": 300}


def _run(
    data: Path,
    out: Path,
    *extra: str,
    cwd: Path | None = None,
    env: dict | None = None,
    server: str | None = None,
    **popen,
) -> subprocess.Popen:
    """`genq run --simulate` (or on ``server``) on its private Redis (an exported GENQ_REDIS_URL
    left out)."""
    where = ["--server", server] if server else ["--simulate"]
    argv = [GENQ, "run", str(data), "--out", str(out), *where, "--max-new-tokens", "300", *extra]
    env = {**{k: v for k, v in os.environ.items() if k != "GENQ_REDIS_URL"}, **(env or {})}
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def _finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[str, str]:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return stdout.decode(), stderr.decode()


def test_run_from_a_folder_holding_a_genq_folder(tmp_path):
    """The parent of a clone holds a folder named `genq`: the children still start the installed
    program; and a child that dies at start says its own last words, in one line."""
    (tmp_path / "genq").mkdir()  # a namespace package `genq`, first on sys.path for `python -m`
    data = tmp_path / "p.jsonl"
    prompts = write_prompts(data, 30)
    out = tmp_path / "out"
    proc = _run(data, out, "--sim-latency", "zero", cwd=tmp_path)
    _, stderr = _finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    check_records(out, "p", prompts, PARAMS)

    # The simulator refuses its settings and exits: run says why, naming its log.
    env_bad = {"GENQ_SIM_DECODE_STEP_MS": "abc"}
    proc = subprocess.run(
        [GENQ, "run", str(data), "--out", str(tmp_path / "bad"), "--simulate"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**{k: v for k, v in os.environ.items() if k != "GENQ_REDIS_URL"}, **env_bad},
    )
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "sim-server exited at start" in errors[0] and "GENQ_SIM_DECODE_STEP_MS" in errors[0], errors
    assert str(tmp_path / "bad" / ".logs" / "sim.log") in errors[0], errors


@pytest.mark.timeout(420)  # in `make test-quick` too: the second day's kill test
def test_two_runs_at_once_never_stop_each_others_processes(tmp_path):
    """A folder copied from a live run (its records of pids included) is run while the original
    still runs: the copy must not stop the original's Redis, and both finish exactly once. A second
    run on the very folder of a live one is refused in one line, and the first goes on."""
    data = tmp_path / "twice.jsonl"
    prompts = write_prompts(data, 40)
    first, copy = tmp_path / "a", tmp_path / "b"
    # The first run's server is slowed (25 ms a decode step: ~35 s for the whole run) so the copy's run
    # starts, and ends, while it still runs: the test asserts they overlapped.
    a = _run(data, first, "--workers", "1", "--concurrency", "8", env={"GENQ_SIM_DECODE_STEP_MS": "25"})
    try:
        raw = first / "twice" / "raw_responses.jsonl"
        wait_until(lambda: len(written_lines(raw)) >= 10, 120, "the first run's progress")
        redis_a = EmbeddedRedis(first / ".redis").running_pid()
        assert redis_a is not None
        shutil.copytree(first, copy, ignore=shutil.ignore_patterns("*.sock"))

        again = subprocess.run(
            [GENQ, "run", str(data), "--out", str(first), "--simulate"],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if k != "GENQ_REDIS_URL"},
        )
        assert again.returncode == 1, again.stderr
        (line,) = [x for x in again.stderr.splitlines() if x.strip()]
        assert f"another genq run (pid {a.pid}) is writing this folder" in line, line

        b = _run(data, copy, "--workers", "1", "--concurrency", "32", "--sim-latency", "zero")
        wait_until(lambda: EmbeddedRedis(copy / ".redis").running_pid(), 60, "the copy's own Redis")
        assert a.poll() is None, "the first run ended before the copy's started: they did not overlap"
        assert EmbeddedRedis(first / ".redis").running_pid() == redis_a, "the copy stopped the first's Redis"
        _, stderr_b = _finish(b, 240)
        assert b.returncode == 0, stderr_b[-3000:]
        assert a.poll() is None, "the first run ended before the copy's: they did not overlap throughout"
        assert EmbeddedRedis(first / ".redis").running_pid() == redis_a, (
            "the copy's end stopped the first's Redis"
        )
        _, stderr_a = _finish(a, 240)
    finally:
        a.kill()
    assert a.returncode == 0, stderr_a[-3000:]
    assert "Redis unreachable" not in stderr_a, stderr_a[-3000:]
    check_records(first, "twice", prompts, PARAMS)
    check_records(copy, "twice", prompts, PARAMS)


@pytest.mark.timeout(420)
@pytest.mark.slow
def test_a_double_ctrl_c_makes_no_crash_suspects(tmp_path):
    """Ctrl-C on a terminal signals the whole foreground process group. The run's children are not
    in it: the first Ctrl-C stops the workers while their server and Redis still answer (no server
    'crash', no Redis outage in their logs), the second kills everything. The resumed run then
    has no crash suspect to resend alone, and writes each prompt once."""
    data = tmp_path / "ctrl.jsonl"
    prompts = write_prompts(data, 60)
    out = tmp_path / "out"
    # Outputs of 1,500 tokens at 5 ms a step: the jobs in flight at the first Ctrl-C take seconds.
    long = {"GENQ_SIM_MIN_LEN": "1500", "GENQ_SIM_MAX_LEN": "1500", "GENQ_SIM_DECODE_STEP_MS": "5"}
    flags = ("--workers", "2", "--concurrency", "16", "--max-new-tokens", "2000")
    run = _run(data, out, *flags, start_new_session=True, env=long)
    try:
        raw = out / "ctrl" / "raw_responses.jsonl"
        wait_until(lambda: len(written_lines(raw)) >= 10, 120, "progress")
        os.killpg(run.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
        wait_until(lambda: _logs(out).count("stop requested") == 2, 30, "both workers to drain")
        os.killpg(run.pid, signal.SIGINT)
        assert run.wait(30) == 130
    finally:
        run.kill()
    interrupted = _logs(out)
    assert len(written_lines(raw)) < 60, "the Ctrl-C came after the end"
    assert "looks down" not in interrupted and "Redis unreachable" not in interrupted, interrupted[-3000:]
    rerun = _run(data, out, *flags, env=long)
    _, stderr = _finish(rerun, 240)
    assert rerun.returncode == 0, stderr[-3000:]
    check_records(out, "ctrl", prompts, {"max_new_tokens": 2000}, min_len=1500, max_len=1500)
    resumed = _logs(out)[len(interrupted) :]
    assert "looks down" not in resumed and "server crashes" not in resumed, resumed[-3000:]


def _logs(out: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((out / ".logs").glob("worker-*.log")))


@pytest.mark.timeout(300)
def test_commands_on_a_run_folder_look_at_its_own_redis_and_namespace(tmp_path, redis_url):
    """`--out` names a run: its private Redis and namespace win over exported GENQ_* variables; a
    different --namespace on the command line is an error naming both; and verify against a Redis
    holding nothing of it is an error, not a clean bill."""
    data = tmp_path / "own.jsonl"
    write_prompts(data, 20)
    out = tmp_path / "out"
    ran = _run(data, out, "--sim-latency", "zero", "--namespace", "mine")
    _, stderr = _finish(ran)
    assert ran.returncode == 0, stderr[-3000:]
    exported = {**os.environ, "GENQ_REDIS_URL": redis_url, "GENQ_NAMESPACE": "theirs"}

    def genq(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([GENQ, *args], capture_output=True, text=True, timeout=60, env=exported)

    verified = genq("verify", "--out", str(out))
    assert verified.returncode == 0 and "own: OK" in verified.stdout, verified.stdout + verified.stderr
    status = genq("status", "--out", str(out), "--json")
    assert status.returncode == 0, status.stderr
    assert orjson.loads(status.stdout)["datasets"]["own"]["done"] == 20
    assert "GENQ_NAMESPACE=theirs left aside: the run in" in status.stderr, status.stderr
    both = genq("status", "--out", str(out), "--namespace", "theirs")
    assert both.returncode == 2 and "used namespace 'mine'" in both.stderr, both.stderr

    elsewhere = genq("verify", "--out", str(out), "--redis", redis_url, "--namespace", "nothing-here")
    assert elsewhere.returncode == 1, elsewhere.stdout + elsewhere.stderr
    (line,) = elsewhere.stderr.strip().splitlines()
    assert "no dataset in namespace 'nothing-here'" in line, line
    plain = genq("status", "--redis", redis_url, "--namespace", "nothing-here", "--json")
    assert plain.returncode == 0, plain.stderr
    assert any("no dataset in namespace 'nothing-here'" in w for w in orjson.loads(plain.stdout)["warnings"])


@pytest.mark.timeout(300)
def test_a_cut_output_file_is_made_whole_again_after_verify_repair(tmp_path, start_sim):
    """raw_responses.jsonl cut by hand to 25 of its 40 lines: run's summary counts what is on disk
    (25) and the audit says how to get the rest back; `verify --repair` reopens exactly the 15
    missing jobs, and the same run command makes those again, each once: the server generates only
    them (its request ids counted), and each id is on disk once."""
    url = start_sim()
    data = tmp_path / "gone.jsonl"
    prompts = write_prompts(data, 40)
    out = tmp_path / "out"
    first = _run(data, out, server=url)
    _, stderr = _finish(first)
    assert first.returncode == 0, stderr[-3000:]
    raw = out / "gone" / "raw_responses.jsonl"
    lines = raw.read_bytes().splitlines(keepends=True)
    assert len(lines) == 40
    raw.write_bytes(b"".join(lines[:25]))
    missing = sorted(set(range(40)) - {orjson.loads(line)["row"] for line in lines[:25]})
    assert len(missing) == 15

    again = _run(data, out, server=url)
    stdout, stderr = _finish(again)
    assert again.returncode == 1, stdout + stderr[-3000:]
    assert "gone: 25 done, 0 failed of 40" in stdout, stdout
    assert "gone: MISSING 15" in stderr and "--repair" in stderr, stderr[-3000:]

    env = {k: v for k, v in os.environ.items() if k != "GENQ_REDIS_URL"}
    repaired = subprocess.run(
        [GENQ, "verify", "--out", str(out), str(data), "--repair"], capture_output=True, text=True, env=env
    )
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "gone: reopened 15 missing jobs" in repaired.stderr, repaired.stderr

    before = len(sim_get(url, "/sim/rids"))
    last = _run(data, out, server=url)
    stdout, stderr = _finish(last)
    assert last.returncode == 0, stderr[-3000:]
    assert "gone: 40 done, 0 failed of 40" in stdout, stdout
    assert "completion tokens" in stdout, stdout  # the counters were derived again from the files
    check_records(out, "gone", prompts, PARAMS)
    looked = subprocess.run(
        [GENQ, "status", "--out", str(out), "--json"], capture_output=True, text=True, env=env, check=True
    )
    gone = orjson.loads(looked.stdout)["datasets"]["gone"]
    on_disk = [orjson.loads(line) for line in raw.read_bytes().splitlines()]
    assert gone["completion_tokens"] == sum(r["completion_tokens"] for r in on_disk), gone
    assert gone["ledger"] is not None, gone
    # Generated again: exactly the missing rows, once each (probes aside).
    rids = [rid for rid in sim_get(url, "/sim/rids")[before:] if not rid.startswith("genq-probe.")]
    rows = sorted(int(rid.split(".", 1)[0].rsplit("-", 1)[1]) for rid in rids)
    assert rows == missing, f"generated again: {rows}, missing were {missing}"


@pytest.mark.timeout(300)
def test_a_trial_run_with_limit_then_the_whole_run(tmp_path, start_sim):
    """`genq run --limit 10`: the first 10 rows made and verified (the rest is not missing); the
    same run without --limit makes the other 20, each once (the server's request ids counted)."""
    url = start_sim()
    data = tmp_path / "trial.jsonl"
    prompts = write_prompts(data, 30)
    out = tmp_path / "out"
    stdout, stderr = _finish(first := _run(data, out, "--limit", "10", server=url))
    assert first.returncode == 0, stderr[-3000:]
    assert "trial: 10 done, 0 failed of 10" in stdout, stdout
    assert "20 rows after the first 10 not read yet" in stdout + stderr, stdout + stderr
    assert len(written_lines(out / "trial" / "raw_responses.jsonl")) == 10
    before = len(sim_get(url, "/sim/rids"))
    stdout, stderr = _finish(whole := _run(data, out, server=url))
    assert whole.returncode == 0, stderr[-3000:]
    assert "trial: 30 done, 0 failed of 30" in stdout, stdout
    check_records(out, "trial", prompts, PARAMS)
    rids = [rid for rid in sim_get(url, "/sim/rids")[before:] if not rid.startswith("genq-probe.")]
    assert sorted(int(rid.split(".", 1)[0].rsplit("-", 1)[1]) for rid in rids) == list(range(10, 30))
