"""`genq run`: the whole pipeline in one command, on its private Redis, resumable after a kill."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from genq.commands.embedded import EmbeddedRedis
from tests.helpers import check_records, read_jsonl, sigkill, wait_until, write_prompts, written_lines


def _run(data, out, *extra):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "genq",
            "run",
            str(data),
            "--out",
            str(out),
            "--simulate",
            "--workers",
            "2",
            "--max-new-tokens",
            "300",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


ROOT = Path(__file__).resolve().parent.parent

# `genq run`'s progress line (not a tty: printed at its first look, then every 5 s and at the end).
PROGRESS = re.compile(r"\] (\d+)/(\d+) on disk \((\d+) failed\), (\d+) in flight, (\d+) queued")


def _children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(600)  # waits of up to 120 + 30 + 240 + 120 s
@pytest.mark.slow
def test_run_killed_and_rerun_finishes_without_duplicates(tmp_path, monkeypatch):
    monkeypatch.delenv("GENQ_REDIS_URL", raising=False)
    data = tmp_path / "resume.jsonl"
    prompts = write_prompts(data, 250)
    out = tmp_path / "out"
    raw = out / "resume" / "raw_responses.jsonl"
    first = _run(data, out, "--concurrency", "32")
    try:
        wait_until(lambda: len(written_lines(raw)) >= 40, 120, "some results on disk")
        children = _children_of(first.pid)
        assert len(children) >= 4, "redis, simulator, collector and workers run as children"
        sigkill(first)
    finally:
        first.kill()
    # Nothing outlives a killed run: redis-server shuts down, the rest is killed.
    wait_until(lambda: not any(_alive(p) for p in children), 30, "the children of the killed run to exit")
    partial = len(written_lines(raw))  # the kill may have torn the last line: the rerun cuts it
    assert partial < 250, "the kill came mid-run"

    second = _run(data, out, "--concurrency", "64")
    try:
        stdout, stderr = second.communicate(timeout=240)
    finally:
        second.kill()
    assert second.returncode == 0, stderr.decode()[-3000:]
    assert "resume: 250 done, 0 failed of 250" in stdout.decode()
    check_records(out, "resume", prompts, {"max_new_tokens": 300})

    # A third run finds nothing to do and exits at once: its first look at the progress (always
    # printed) already finds every job on disk and nothing queued or in flight, so it waits for no
    # job and ends there; and not a byte more is written.
    assert len(read_jsonl(raw)) == 250
    before = raw.read_bytes()
    third = _run(data, out)
    stdout, stderr = third.communicate(timeout=120)
    assert third.returncode == 0, stderr.decode()[-3000:]
    assert b"enqueued 0, skipped 250" in stdout + stderr
    looks = PROGRESS.findall(stderr.decode())
    assert looks, stderr.decode()[-3000:]
    assert looks[0] == ("250", "250", "0", "0", "0"), f"the first look found work to wait for: {looks}"
    assert raw.read_bytes() == before, "the third run wrote records"


def test_run_example_dataset_text_prompts(tmp_path, monkeypatch):
    """The README's quick start, on the example that ships in the repo, with a relative --out."""
    from pathlib import Path

    from genq.sim.model import tokenize

    monkeypatch.delenv("GENQ_REDIS_URL", raising=False)
    example = Path(__file__).parent.parent / "examples" / "prompts.jsonl"
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "genq",
            "run",
            str(example),
            "--out",
            "out",
            "--simulate",
            "--sim-latency",
            "zero",
        ],
        cwd=tmp_path,
        capture_output=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    rows = [orjson.loads(line) for line in example.read_bytes().splitlines()]
    prompts = [tokenize(r["prompt"]) for r in rows]
    records = check_records(out, "prompts", prompts, {"max_new_tokens": 2048})
    assert {r["source_id"] for r in records} == {r["id"] for r in rows}


def _genq(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "genq", *args], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.mark.timeout(300)
def test_a_finished_run_is_looked_at_with_out(tmp_path, monkeypatch):
    """After `genq run` has ended (its private Redis stopped, its port gone), status, failed, retry,
    monitor and verify `--out OUT` start that Redis again from OUT/.redis for as long as they run,
    answer from it, and leave no redis-server behind; a folder without one is one line."""
    monkeypatch.delenv("GENQ_REDIS_URL", raising=False)
    data = tmp_path / "looked.jsonl"
    write_prompts(data, 50)
    out = tmp_path / "out"
    ran = _run(data, out, "--sim-latency", "zero")
    _, stderr = ran.communicate(timeout=180)
    assert ran.returncode == 0, stderr.decode()[-3000:]

    status = _genq("status", "--out", str(out), "--json")
    assert status.returncode == 0, status.stderr
    counts = orjson.loads(status.stdout)["datasets"]["looked"]
    assert (counts["total"], counts["done"], counts["failed"]) == (50, 50, 0), counts
    assert "its private Redis is started again" in status.stderr, status.stderr
    for argv in (
        ["failed", "--out", str(out)],
        ["retry", "--all", "--out", str(out)],
        ["monitor", "--once", "--width", "100", "--out", str(out)],
        ["verify", "--out", str(out)],  # verify's --out is always there: the private Redis is found
    ):
        done = _genq(*argv)
        assert done.returncode == 0, (argv, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
    assert "no failed jobs" in _genq("failed", "--out", str(out)).stdout
    assert "looked: OK" in _genq("verify", "--out", str(out)).stdout
    assert EmbeddedRedis(out / ".redis").running_pid() is None, "a redis-server was left running"

    both = _genq("status", "--out", str(out), "--redis", "redis://127.0.0.1:6379")
    assert both.returncode == 2 and "give --out or --redis, not both" in both.stderr, both.stderr
    other = _genq("status", "--out", str(tmp_path))
    assert other.returncode == 1, other.stderr
    (line,) = other.stderr.strip().splitlines()
    assert "no private Redis of a `genq run` here" in line, line


@pytest.mark.timeout(480)  # two runs of up to 180 s each
def test_rerun_on_a_fresh_redis_runs_nothing_already_on_disk(tmp_path, redis_url):
    """The files are the truth: a new namespace (or a wiped Redis) learns from them what is done."""
    data = tmp_path / "again.jsonl"
    prompts = write_prompts(data, 120)
    out = tmp_path / "out"
    for namespace, expect in (("first", b"enqueued 120, skipped 0"), ("second", b"enqueued 0, skipped 120")):
        proc = _run(data, out, "--sim-latency", "zero", "--redis", redis_url, "--namespace", namespace)
        try:
            stdout, stderr = proc.communicate(timeout=180)
        finally:
            proc.kill()
        assert proc.returncode == 0, stderr.decode()[-3000:]
        assert expect in stdout + stderr
    # The second run's first look found every job done: it ran nothing.
    looks = PROGRESS.findall(stderr.decode())
    assert looks and looks[0] == ("120", "120", "0", "0", "0"), f"the second run had work: {looks}"
    check_records(out, "again", prompts, {"max_new_tokens": 300})


def test_simulate_refuses_an_api_the_simulator_does_not_speak(tmp_path):
    """`--simulate --backend llamacpp` fails at once, in one line, before anything starts."""
    data = tmp_path / "p.jsonl"
    write_prompts(data, 3)
    proc = _run(data, tmp_path / "out", "--backend", "llamacpp")
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2
    lines = [line for line in stderr.decode().splitlines() if line.startswith("Error")]
    assert lines and "--simulate speaks" in lines[0] and "llama-server" in lines[0], stderr
    assert not (tmp_path / "out" / ".redis").exists(), "nothing may start"


def test_a_redis_from_the_environment_is_said_at_start(tmp_path, redis_url):
    """An exported GENQ_REDIS_URL turns the private Redis off: genq run says so, and how to undo."""
    data = tmp_path / "env.jsonl"
    prompts = write_prompts(data, 20)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "genq", "run", str(data), "--out", str(out), "--simulate",
         "--sim-latency", "zero", "--max-new-tokens", "300", "--namespace", "fromenv"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "GENQ_REDIS_URL": redis_url},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(from GENQ_REDIS_URL; unset it for a private one)" in proc.stderr, proc.stderr
    assert not (out / ".redis").exists()
    check_records(out, "env", prompts, {"max_new_tokens": 300})


def test_run_takes_a_glob_as_enqueue_does(tmp_path, monkeypatch):
    """A quoted glob (and a dataset folder) is what enqueue takes, so run takes it: one dataset per file."""
    monkeypatch.delenv("GENQ_REDIS_URL", raising=False)
    folder = tmp_path / "parts"
    folder.mkdir()
    first = write_prompts(folder / "a.jsonl", 20)
    second = write_prompts(folder / "b.jsonl", 15)
    out = tmp_path / "out"
    proc = _run(str(folder / "*.jsonl"), out, "--sim-latency", "zero")
    try:
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr.decode()[-3000:]
    assert "a: 20 done, 0 failed of 20" in stdout.decode()
    assert "b: 15 done, 0 failed of 15" in stdout.decode()
    check_records(out, "a", first, {"max_new_tokens": 300})
    check_records(out, "b", second, {"max_new_tokens": 300})


@pytest.mark.timeout(180)
def test_ctrl_c_says_it_drains_and_a_second_stops_at_once(tmp_path, monkeypatch, start_sim):
    """The first Ctrl-C lets the generations in flight finish or go back, saying how long it may
    take and that a second Ctrl-C stops at once; the second does, exit 130, no traceback."""
    monkeypatch.delenv("GENQ_REDIS_URL", raising=False)
    sim = start_sim(
        "--latency", "realistic", "--decode-step-ms", "5", "--min-len", "6000", "--max-len", "6000"
    )
    data = tmp_path / "slow.jsonl"
    write_prompts(data, 20)
    out = tmp_path / "out"
    err = tmp_path / "run.err"
    argv = [sys.executable, "-m", "genq", "run", str(data), "--out", str(out), "--server", sim]
    with err.open("wb") as fh:
        run = subprocess.Popen([*argv, "--max-new-tokens", "7000"], stdout=subprocess.DEVNULL, stderr=fh)
    try:
        wait_until(
            lambda: PROGRESS.search(err.read_text()) and int(PROGRESS.findall(err.read_text())[-1][3]) > 0,
            90,
            "generations in flight",
        )
        run.send_signal(2)
        wait_until(lambda: "Ctrl-C again to stop now" in err.read_text(), 30, "the first Ctrl-C's line")
        assert run.poll() is None, "the first Ctrl-C waits for the generations in flight"
        run.send_signal(2)
        assert run.wait(20) == 130, err.read_text()[-2000:]
    finally:
        run.kill()
    text = err.read_text()
    assert "stopping now" in text and "Traceback" not in text, text[-2000:]


@pytest.mark.timeout(300)
def test_progress_in_a_log_has_rates_and_eta_and_the_end_says_what_next(tmp_path, monkeypatch):
    """Off a terminal (a log), the progress lines carry tokens/s and an ETA once the collector has
    measured a rate; the start says how to watch the private Redis (`genq monitor --out`), the
    end the wall time, the tokens and the commands to run next."""
    monkeypatch.delenv("GENQ_REDIS_URL", raising=False)
    data = tmp_path / "p.jsonl"
    write_prompts(data, 300)
    out = tmp_path / "out"
    run = _run(data, out)
    # While it runs, `--out` finds its private Redis on the port it has now (nothing restarted).
    wait_until(lambda: (out / ".redis" / "port").exists(), 60, "the private Redis")
    looked = _genq("status", "--out", str(out), "--json")
    assert looked.returncode == 0 and "started again" not in looked.stderr, looked.stderr
    assert orjson.loads(looked.stdout)["datasets"].get("p", {}).get("done", 0) < 300, "looked after the end"
    stdout, stderr = (part.decode() for part in run.communicate(timeout=240))
    assert run.returncode == 0, stderr[-3000:]
    assert f"genq run: watch it with genq monitor --out {out}\n" in stderr, stderr[-3000:]
    rated = [line for line in stderr.splitlines() if PROGRESS.search(line) and " tok/s, ETA " in line]
    assert rated, stderr[-3000:]
    assert re.search(r"wall time \d.*, [\d,]+ completion tokens\. Next: genq stats ", stdout), stdout


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_demo_exports_eagle3_training_rows(tmp_path, monkeypatch):
    """README's first command, as the Makefile runs it, then `genq export --format eagle3`: the 200
    example prompts give 200 training rows (the simulated vLLM answers with the prompt's ids), and
    a dataset card beside them."""
    monkeypatch.delenv("GENQ_REDIS_URL", raising=False)
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^demo:.*\n\t\$\(BIN\)/genq (.+)$", makefile, re.M)
    assert recipe, "the Makefile's demo target runs genq"
    argv = [a if a != "out" else str(tmp_path / "out") for a in recipe.group(1).split()]
    argv = [a if a != "examples/prompts.jsonl" else str(ROOT / a) for a in argv]
    res = subprocess.run([sys.executable, "-m", "genq", *argv], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    export = subprocess.run(
        [sys.executable, "-m", "genq", "export", str(tmp_path / "out"), "--format", "eagle3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert export.returncode == 0, export.stderr
    rows = read_jsonl(tmp_path / "out" / "prompts" / "tokenized_data.jsonl")
    assert len(rows) == 200 and all(0 < r["loss_mask"].index(1) < len(r["input_ids"]) for r in rows)
    assert (tmp_path / "out" / "prompts" / "README.md").read_text().startswith("---\n")
