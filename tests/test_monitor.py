"""`genq monitor`: one frame of a run with known numbers, in 80 columns; Redis down; Ctrl-C."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess

import orjson

from genq.commands.embedded import free_port
from tests.helpers import (
    genq_argv,
    log_of,
    read_jsonl,
    status_json,
    wait_until,
    write_jsonl,
    write_prompts,
)


def test_monitor_frame_of_a_run_fits_80_columns_and_agrees_with_status(procs, start_sim, out, tmp_path):
    url = start_sim()
    for name, n in (("alpha", 40), ("beta", 25)):
        write_prompts(tmp_path / f"{name}.jsonl", n)
        assert procs.run("enqueue", tmp_path / f"{name}.jsonl", "--max-new-tokens", "100").returncode == 0
    # A prompt that cannot fit: one failure with the server's reason.
    write_jsonl(tmp_path / "big.jsonl", [{"input_ids": [7] * 300}])
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
    lines: dict[str, list[str]] = {}  # each dataset's first row (progress), then its ledger row
    ledger: dict[str, list[str]] = {}
    for row in (line.split() for line in frame.splitlines() if line.strip()):
        (ledger if row[0] in lines else lines).setdefault(row[0], row)
    for name, n in (("alpha", 40), ("beta", 25), ("big", 1)):  # read, then where each row went
        assert ledger[name][1] == str(n) and sum(map(int, ledger[name][2:])) == n, frame
    assert ledger["big"][2:] == ["0", "0", "0", "1", "0", "0"], "stopped, continued, cut, failed, ..."
    # One word, one meaning on status's screen: the ledger's "cut" (ended on length), the tokens
    # table's "capped" (stopped below the max_new_tokens asked).
    wide = procs.run("status").stdout
    words = [line.replace("│", " ").split() for line in wide.splitlines()]
    assert sum(w.count("cut") for w in words) == 1 and sum(w.count("capped") for w in words) == 1, wide
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
    # Written as the collector stopped: the failure by its class, the ledger as the monitor showed it.
    prov = orjson.loads((out / "big" / "provenance.json").read_bytes())
    assert prov["failed_by_class"] == {"bad_request": 1} and prov["ledger"]["failed"] == 1, prov


def test_monitor_says_redis_is_unreachable_and_quits_cleanly_on_ctrl_c(procs):
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    res = procs.run("monitor", "--once", "--width", "80", env={"GENQ_REDIS_URL": url})
    assert res.returncode == 1
    assert "Redis unreachable at redis://:***@127.0.0.1:" in res.stdout, res.stdout
    assert "s3cret" not in res.stdout and "done/total" not in res.stdout, "no table of zeros"

    # Live, in a terminal (where a Ctrl-C comes from; elsewhere Rich draws only the last frame):
    # it keeps retrying, frame after frame, and Ctrl-C exits 0 without a traceback.
    master, terminal = pty.openpty()
    proc = subprocess.Popen(
        genq_argv("monitor", "--interval", "0.5", "--width", "80"),
        env={**procs.env, "GENQ_REDIS_URL": url, "TERM": "xterm"},
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        # A terminal's foreground job takes Ctrl-C; CI may start the suite in the background,
        # where SIGINT is ignored and stays ignored across exec (Python then installs no handler).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    os.close(terminal)
    screen = bytearray()

    def drawn() -> bytes:
        while select.select([master], [], [], 0)[0]:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: the monitor exited and closed the terminal
                break
            if not chunk:
                break
            screen.extend(chunk)
        return bytes(screen)

    def retrying() -> bool:
        screen_text = drawn().decode(errors="replace")[-2000:]
        assert proc.poll() is None, f"the monitor exited {proc.returncode}: {screen_text}"
        return drawn().count(b"Redis unreachable at redis://:***@127.0.0.1:") >= 5

    try:
        wait_until(retrying, 60, "five frames saying Redis is unreachable")
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: drawn() and proc.poll() is not None, 15, "the monitor to exit on Ctrl-C")
        text = drawn().decode(errors="replace")
    finally:
        proc.kill()
        proc.wait(10)
        os.close(master)
    assert proc.returncode == 0, f"exit {proc.returncode} on Ctrl-C: {text[-3000:]}"
    assert "Traceback" not in text and "s3cret" not in text, text[-3000:]


def test_a_worker_over_its_target_is_explained():
    """48 in flight for a target of 32: the monitor says why (the target was lowered, the jobs in
    flight finish), not only the two numbers."""
    from genq.commands.monitor import workers_table

    worker = {"host": "h", "pid": 1, "slurm_job": None, "server": "http://s:1", "retrying": 0, "done": 9,
              "failed": 0, "heartbeat_age_s": 1.0, "alive": True}  # fmt: skip
    over = workers_table({"workers": [{**worker, "in_flight": 48, "target": 32}]})
    assert "lowered its target" in str(over.caption), over.caption
    under = workers_table({"workers": [{**worker, "in_flight": 20, "target": 32}]})
    assert under.caption is None
