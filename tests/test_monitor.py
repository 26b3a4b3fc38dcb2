"""`genq monitor`: one frame of a run with known numbers, in 80 columns; Redis down; Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import time

from genq.embedded import free_port
from tests.helpers import genq_argv, log_of, read_jsonl, status_json, wait_until, write_prompts


def test_monitor_frame_of_a_run_fits_80_columns_and_agrees_with_status(procs, start_sim, out, tmp_path):
    url = start_sim()
    for name, n in (("alpha", 40), ("beta", 25)):
        write_prompts(tmp_path / f"{name}.jsonl", n)
        assert procs.run("enqueue", tmp_path / f"{name}.jsonl", "--max-new-tokens", "100").returncode == 0
    # A prompt that cannot fit: one failure with the server's reason.
    (tmp_path / "big.jsonl").write_text('{"input_ids": [' + ",".join(["7"] * 300) + "]}\n")
    assert procs.run("enqueue", tmp_path / "big.jsonl", "--max-new-tokens", "8000").returncode == 0
    worker = procs.start("worker", "--server", url, "--concurrency", "8")
    collector = procs.start("collect", "--out", out)
    wait_until(
        lambda: (
            (s := status_json(procs))["totals"]["done"] == 65
            and s["totals"]["failed"] == 1
            and s["workers"][0]["in_flight"] == 0
        ),
        60,
        "the run to finish",
    )
    svg = tmp_path / "monitor.svg"
    res = procs.run("monitor", "--once", "--width", "80", "--svg", svg)
    assert res.returncode == 0, res.stderr
    frame = res.stdout
    assert max(len(line) for line in frame.splitlines()) <= 80, frame
    lines = {line.split()[0]: line.split() for line in frame.splitlines() if line.strip()}
    assert lines["alpha"][2:5] == ["100%", "40/40", "0"], frame
    assert lines["beta"][2:5] == ["100%", "25/25", "0"], frame
    assert lines["big"][2:5] == ["100%", "1/1", "1"], frame
    assert lines["(all)"][2:5] == ["100%", "66/66", "1"], frame
    assert lines["alpha"][-1] == "done"  # ETA
    host_pid = f"{worker.pid}"
    (worker_line,) = [line for line in frame.splitlines() if f":{host_pid} " in line]
    assert url.split("://")[1] in worker_line and " 65 " in worker_line, frame
    assert "bad_request  Requested token count exceeds" in frame, "failures by reason"
    assert "stream 0 waiting" in frame
    assert svg.read_text().startswith("<svg") and "alpha" in svg.read_text()
    # The numbers are the files' numbers.
    records = read_jsonl(out / "alpha" / "raw_responses.jsonl") + read_jsonl(
        out / "beta" / "raw_responses.jsonl"
    )
    assert len(records) == 65 and len(read_jsonl(out / "big" / "errors.jsonl")) == 1
    for proc in (worker, collector):
        proc.terminate()
        assert proc.wait(60) == 0, log_of(proc)


def test_monitor_says_redis_is_unreachable_and_quits_cleanly_on_ctrl_c(procs, tmp_path):
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    res = procs.run("monitor", "--once", "--width", "80", env={"GENQ_REDIS_URL": url})
    assert res.returncode == 1
    assert "Redis unreachable at redis://:***@127.0.0.1:" in res.stdout, res.stdout
    assert "s3cret" not in res.stdout and "done/total" not in res.stdout, "no table of zeros"

    # Live: keeps retrying, and Ctrl-C exits 0 without a traceback.
    log = tmp_path / "monitor.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            genq_argv("monitor", "--interval", "0.5", "--width", "80"),
            env={**procs.env, "GENQ_REDIS_URL": url},
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    time.sleep(2.5)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(15) == 0
    text = log.read_text()
    assert "Redis unreachable" in text and "Traceback" not in text, text
