"""genq from Python (genq/api, docs/python.md): the example script as a user runs it, a local run
started and stopped from Python leaving no process behind, and the API's refusals in genq's words."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

import genq
from tests.helpers import read_jsonl, wait_until

REPO = Path(__file__).resolve().parent.parent


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (their own sessions included), from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie is gone: it only waits to be reaped)."""
    left = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.add(pid)
    return left


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_example_script_runs_as_written_and_again_generates_nothing(tmp_path):
    """examples/python_api.py as a user runs it: a datasets.Dataset of 500 rows enqueued on a local
    run, waited on, read back as a datasets.Dataset equal to the file on disk; run again, it
    resumes and generates nothing twice; no process of the run is left either time."""
    out = tmp_path / "out"
    argv = [sys.executable, str(REPO / "examples" / "python_api.py"), str(out)]
    first = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "squares: 500 enqueued, 0 already queued or done" in first.stdout
    assert "squares: 500 records" in first.stdout
    lines = read_jsonl(out / "squares" / "raw_responses.jsonl")
    assert sorted(r["row"] for r in lines) == list(range(500))
    # The Dataset read back is the file: each record's output ids and text, row by row.
    records = genq.results(out, "squares").to_dataset()
    by_row = {r["row"]: r for r in lines}
    assert records["row"] == list(range(500))
    assert records["output_ids"] == [by_row[row]["output_ids"] for row in range(500)]
    assert records["text"] == [by_row[row]["text"] for row in range(500)]
    kept = [orjson.loads(extra)["fields"]["answer"] for extra in records["extra"]]
    assert kept == [row * (row + 1) for row in range(500)]

    again = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "squares: 0 enqueued, 500 already queued or done" in again.stdout
    assert len(read_jsonl(out / "squares" / "raw_responses.jsonl")) == 500
    assert not _processes_naming(out)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_stages_example_judges_each_answer_once(tmp_path):
    """examples/stages.py as written: 200 answers, a judge stage following them, each answer judged
    once (its verdict naming it), the answers kept those the files say were judged right."""
    out = tmp_path / "out"
    argv = [sys.executable, str(REPO / "examples" / "stages.py"), str(out)]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    answers = read_jsonl(out / "answers" / "raw_responses.jsonl")
    verdicts = read_jsonl(out / "verdicts" / "raw_responses.jsonl")
    assert sorted(v["parent"] for v in verdicts) == sorted(a["id"] for a in answers)
    assert len(answers) == 200 and "verdicts: 200 judged" in done.stdout
    right = sum("right" in (v["content"] or "").split() for v in verdicts)
    assert f"answers: 200, kept (judged right): {right}" in done.stdout
    assert not _processes_naming(out)


def _processes_naming(out: Path) -> list[str]:
    """Command lines of live processes that name ``out`` (the run, its collector, its Redis)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(out) in cmdline and entry.name.isdigit() and alive({int(entry.name)}):
            found.append(cmdline)
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_local_run_stops_from_python_and_dies_with_the_process_that_started_it(tmp_path):
    """LocalRun.stop() (another cell) stops every process of the run; a Python that started one and
    is SIGKILLed (a kernel killed) takes them all with it, and the run resumes on the next start."""
    out = tmp_path / "out"
    run = genq.LocalRun(out, simulate=True, backend="vllm", sim_latency="zero")
    client = run.start()
    assert run.proc is not None
    pids = descendants(run.proc.pid) | {run.proc.pid}
    assert len(pids) >= 5, pids  # genq run, Redis, the simulator, the collector, two workers
    client.enqueue([{"prompt": f"p{i}"} for i in range(50)], dataset="cell", max_new_tokens=8)
    client.wait("cell", timeout=120, show=False)
    run.stop()
    wait_until(lambda: not alive(pids), 60, "every process of the run gone after stop()")

    script = tmp_path / "kernel.py"
    script.write_text(
        "import sys, time, genq\n"
        "run = genq.LocalRun(sys.argv[1], simulate=True, backend='vllm', sim_latency='zero')\n"
        "run.start()\n"
        "print(run.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    kernel = subprocess.Popen(
        [sys.executable, str(script), str(out)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert kernel.stdout is not None
        run_pid = int(kernel.stdout.readline())
        pids = descendants(kernel.pid)
        assert run_pid in pids and len(pids) >= 6, pids
        os.kill(kernel.pid, signal.SIGKILL)
        kernel.wait(10)
        wait_until(lambda: not alive(pids), 90, "every process of the run gone with its Python")
    finally:
        if kernel.poll() is None:
            kernel.kill()
    with genq.LocalRun(out, simulate=True, backend="vllm", sim_latency="zero") as client:  # resumes
        again = client.enqueue([{"prompt": f"p{i}"} for i in range(50)], dataset="cell", max_new_tokens=8)
        assert (again.enqueued, again.skipped) == (0, 50)
    assert len(read_jsonl(out / "cell" / "raw_responses.jsonl")) == 50


def test_the_api_says_what_it_refuses_in_genq_words(redis_url, namespace, tmp_path, monkeypatch):
    """Refused rows come back with their row and reason while the good ones are enqueued; options
    that cannot go together, unknown options, rows that are not dicts, changed rows and a wait that
    times out are genq's exceptions with genq's words."""
    monkeypatch.setenv("GENQ_ROWS_DIR", str(tmp_path / "rows"))
    with pytest.raises(genq.UsageError, match="no scheme genq knows"):
        genq.connect("http://127.0.0.1:6379", namespace)
    client = genq.connect(redis_url, namespace)
    rows = [{"prompt": "a"}, {"question": "no prompt here"}, {"prompt": "c"}]
    result = client.enqueue(rows, dataset="mixed", max_new_tokens=8)
    assert (result.read, result.enqueued, result.rejected) == (3, 2, 1)
    [refusal] = result.refusals
    assert refusal["dataset_row"] == 1 and "no prompt" in refusal["reason"]
    assert client.status()["datasets"]["mixed"]["queued"] == 2

    import pandas

    frame = pandas.DataFrame({"prompt": ["x", "y"], "score": [0.5, float("nan")]})
    framed = client.enqueue(frame, dataset="framed", max_new_tokens=8, keep_fields=("score",))
    assert (framed.read, framed.enqueued) == (2, 2)
    written = read_jsonl(tmp_path / "rows" / namespace / "framed.jsonl")
    assert written == [{"prompt": "x", "score": 0.5}, {"prompt": "y", "score": None}]  # NaN: null, not 0

    again = client.enqueue(rows, dataset="mixed", max_new_tokens=8)
    assert (again.enqueued, again.skipped) == (0, 2)
    with pytest.raises(genq.GenqError, match="another file under the same name"):
        client.enqueue([{"prompt": "A"}, *rows[1:]], dataset="mixed", max_new_tokens=8)
    with pytest.raises(genq.UsageError, match="max-samples"):
        client.enqueue(rows, dataset="judged", accept=1)
    with pytest.raises(genq.UsageError, match="takes no option"):
        client.enqueue(rows, dataset="judged", temprature=0.5)
    with pytest.raises(genq.UsageError, match="not a dict"):
        client.enqueue([("a", "tuple")], dataset="tuples")
    with pytest.raises(genq.UsageError, match="need dataset="):
        client.enqueue(rows)
    with pytest.raises(genq.WaitTimeout, match="not settled within"):
        client.wait("mixed", timeout=0.5, show=False)  # no worker takes its jobs
    with pytest.raises(genq.GenqError, match="no dataset 'absent'"):
        client.wait("absent", timeout=0.5, show=False)
    assert list(genq.results(tmp_path / "nothing", "mixed")) == []
    client.close()
