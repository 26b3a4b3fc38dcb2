"""`genq report OUT`: the page headless Chromium shows holds the files' own numbers, its charts the
right bars, a failure message's markup as text, and nothing fetched from the network."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path

import orjson

from tests.dataset_helpers import run_pipeline
from tests.helpers import Procs, dump_dom, need, read_jsonl, write_jsonl, write_prompts

SCRIPT = "<script>alert(1)</script>"
TOOL = "<img src=x onerror=alert(3)>"  # a dataset (a folder's name) is untrusted too


class Page(HTMLParser):
    """What the rendered page shows, per section ("run", or the dataset's name): its tables (row
    key -> the row's cell texts), its charts (label -> bar titles) and notes; every element seen."""

    def __init__(self, dom: str):
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict]] = []
        self.sections: dict[str, dict] = {}
        self.text: list[str] | None = None
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        self.elements.append((tag, a))
        if tag == "section":
            name = a.get("data-dataset") or a["class"]
            self.section = self.sections.setdefault(name, {"tables": {}, "charts": {}, "notes": []})
        elif tag == "table":
            self.table = self.section["tables"].setdefault(a["class"], {})
        elif tag == "tr":
            self.row = self.table.setdefault(a.get("data-k"), [])
        elif tag == "svg":
            self.chart = self.section["charts"].setdefault(a["aria-label"], [])
        elif tag in ("td", "title", "p"):
            self.text = []

    def handle_data(self, data: str) -> None:
        if self.text is not None:
            self.text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "title", "p") and self.text is not None:
            text, self.text = "".join(self.text), None
            if tag == "td":
                self.row.append(text)
            elif tag == "title" and hasattr(self, "section"):
                self.chart.append(text)
            elif tag == "p" and hasattr(self, "section"):
                self.section["notes"].append(text)


def rendered(procs: Procs, folder: Path, profile: Path, *args: str) -> Page:
    res = procs.run("report", folder, *args, env={"GENQ_REDIS_URL": "redis://127.0.0.1:1/0"})  # no Redis
    assert res.returncode == 0, res.stderr
    page = Path(res.stdout.strip().removeprefix("wrote "))
    return Page(dump_dom(page.resolve().as_uri(), profile))


def hand_record(i: int) -> dict:
    """Record i of dataset "hand": lengths 10, 30, ..., 390 and an 11; finished in minutes 00:10,
    00:11 and 00:13 (none in 00:12); the last has no latency, attempts or finished_at."""
    minute = 10 if i < 8 else 11 if i < 12 else 13
    record = {
        "id": f"hand-{i}",
        "dataset": "hand",
        "row": i,
        "sample": 0,
        "prompt_tokens": 7 + i,
        "completion_tokens": 11 if i == 20 else 10 + 20 * i,
        "text": "<script>alert(2)</script>",
        "finish_reason": "length" if i % 5 == 0 else "stop",
        "sampling_params": {"max_new_tokens": 400},
        "schema": 1,
    }
    if i in (0, 10):
        record["finish_length"] = 300  # the server cut max_new_tokens to 300
    if i < 20:
        record |= {
            "latency_s": round(0.1 * (i + 1), 1),
            "attempts": 2 if i % 4 == 0 else 1,
            "finished_at": f"2026-12-02T00:{minute}:{5 + 2 * i:02d}Z",
        }
    return record


def chat(completion: int) -> dict:
    """Another tool's record: no latency, no time, no attempts, no finish_length."""
    return {
        "choices": [{"message": {"content": "a"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": completion},
    }


def test_report_shows_the_files_numbers_escaped_and_self_contained(procs: Procs, tmp_path):
    need("chromium")
    root = tmp_path / "run"
    (root / "hand").mkdir(parents=True)
    (root / TOOL).mkdir()
    records = write_jsonl(root / "hand" / "raw_responses.jsonl", [hand_record(i) for i in range(21)])
    errors = [
        {"id": "hand-30", "row": 30, "error": "server_error", "message": "boom 1", "status": 500},
        {"id": "hand-31", "row": 31, "error": "bad_request", "message": f"{SCRIPT} too long", "status": 400},
        {"id": "hand-32", "row": 32, "error": "server_error", "message": "boom 2", "status": 500},
    ]
    write_jsonl(root / "hand" / "errors.jsonl", errors)
    write_jsonl(root / TOOL / "chat.jsonl", [chat(5), chat(9)])
    recs = read_jsonl(records)

    page = rendered(procs, root, tmp_path / "chromium")
    assert (root / "report.html").is_file(), "written to OUT/report.html by default"
    assert set(page.sections) == {"run", "hand", TOOL}

    hand = page.sections["hand"]
    assert hand["tables"]["numbers"] == {
        "records": ["21"],
        "failed": ["3"],
        "capped": [str(sum("finish_length" in r for r in recs))],
        "prompt tokens": [f"{sum(r['prompt_tokens'] for r in recs):,}"],
        "completion tokens": [f"{sum(r['completion_tokens'] for r in recs):,}"],
        "unrecognized lines": ["0"],
    }
    finish = Counter(r["finish_reason"] for r in recs)
    assert hand["tables"]["finish"] == {k: [str(v)] for k, v in finish.items()}

    # 10..409 in 20 bins of 20 tokens: the first holds 10 and 11, each other one record.
    bars = hand["charts"]["completion length histogram"]
    assert len(bars) == 20, bars
    assert bars[0] == "10–29 tokens: 2 records" and bars[-1] == "390–409 tokens: 1 records", bars
    assert sum(int(re.search(r": (\d+) records", b)[1]) for b in bars) == 21

    # Finished from 00:10:05 to 00:13:43: 219 s drawn in 2-s bars (the narrowest that fit in 120),
    # each bucket that saw nothing a real 0 (00:12 holds none).
    timed = [r for r in recs if "finished_at" in r]
    per_bucket = Counter()
    for r in timed:
        per_bucket[int(datetime.fromisoformat(r["finished_at"]).timestamp()) // 2] += r["completion_tokens"]
    span = range(min(per_bucket), max(per_bucket) + 1)
    expected = [
        f"{datetime.fromtimestamp(b * 2, UTC):%Y-%m-%d %H:%M:%S} UTC: {per_bucket[b] / 2:,.1f} tokens/s"
        for b in span
    ]
    assert hand["charts"]["completion tokens per second"] == expected
    assert len(expected) == 110 and "one bar per 2 s" in hand["notes"]
    assert "1 of 21 records are not in it (no finished_at)" in hand["notes"]

    latencies = [r["latency_s"] for r in recs if "latency_s" in r]
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    latency = hand["tables"]["latency"]
    for name, cut in (("p50", cuts[49]), ("p90", cuts[89]), ("p99", cuts[98])):
        assert latency[name] == [f"{cut:.3f} s"], (name, latency)
    assert "unknown for 1 of 21 records (no latency)" in hand["notes"]

    attempts = Counter(r.get("attempts") for r in recs)
    assert hand["tables"]["attempts"] == {
        "1 send": [str(attempts[1])],
        "2 sends": [str(attempts[2])],
        "unknown": ["1"],
    }

    assert hand["tables"]["failures"] == {
        None: [],  # the header row
        "server_error": ["2", "boom 1"],
        "bad_request": ["1", f"{SCRIPT} too long"],
    }, "the message's markup shows as text"
    assert not [tag for tag, _ in page.elements if tag in ("script", "img", "link", "iframe", "object")]
    urls = [v for _, a in page.elements for k, v in a.items() if k in ("src", "href") and v]
    assert not [u for u in urls if re.match(r"\s*(https?:)?//", u)], urls

    tool = page.sections[TOOL]
    assert tool["tables"]["numbers"]["records"] == ["2"]
    assert tool["tables"]["numbers"]["capped"] == ["unknown"], "another tool's records cannot say"
    assert tool["tables"]["attempts"] == {"unknown": ["2"]}
    assert "unknown: the records carry no latency" in tool["notes"]
    assert "unknown: no record says when it finished (finished_at)" in tool["notes"]
    assert not tool["charts"].get("completion tokens per second")

    run = page.sections["run"]["tables"]["totals"]
    assert run["records"] == ["23"] and run["failed"] == ["3"]
    assert run["completion tokens"] == [f"{sum(r['completion_tokens'] for r in recs) + 14:,}"]
    # first finished 00:10:05 (record 0), last 00:13:43 (record 19)
    assert run["wall time"] == ["218 s (3 min 38 s), 2026-12-02 00:10:05 UTC to 2026-12-02 00:13:43 UTC"]


def test_report_of_a_simulated_run(procs: Procs, start_sim, out, tmp_path):
    """A real run: records, failures (a prompt longer than the context) and the cut (the simulator
    lowers max_new_tokens to fit the context, as SGLang does) as the files have them."""
    need("chromium")
    url = start_sim("--context-length", "256")
    data = tmp_path / "p.jsonl"
    write_prompts(data, 40, length=(150, 200))
    with data.open("ab") as fh:
        fh.write(orjson.dumps({"id": "long", "input_ids": [101] * 300}) + b"\n")
    recs = run_pipeline(procs, url, out, "sim", str(data), "--max-new-tokens", "100")
    errs = read_jsonl(out / "sim" / "errors.jsonl")
    cut = [r for r in recs if r["finish_reason"] == "length" and r.get("finish_length", 100) < 100]
    assert recs and errs and cut, "the run has records, failures and cut records to show"

    page = rendered(procs, out, tmp_path / "chromium", "--output", str(tmp_path / "r.html"))
    sim = page.sections["sim"]
    numbers = sim["tables"]["numbers"]
    assert numbers["records"] == [f"{len(recs):,}"]
    assert numbers["failed"] == [f"{len(errs):,}"]
    assert numbers["capped"] == [f"{len(cut):,}"]
    assert numbers["completion tokens"] == [f"{sum(r['completion_tokens'] for r in recs):,}"]
    # A run of seconds is drawn by the second (the report scales its bars to the run).
    seconds = [int(datetime.fromisoformat(r["finished_at"]).timestamp()) for r in recs]
    assert len(sim["charts"]["completion tokens per second"]) == max(seconds) - min(seconds) + 1
    assert "one bar per 1 s" in sim["notes"]
    lengths = sim["charts"]["completion length histogram"]
    assert sum(int(re.search(r": (\d+) records", b)[1]) for b in lengths) == len(recs), lengths
    sends = Counter(r["attempts"] for r in recs)
    shown = {f"{n} send" + "s" * (n > 1): [str(c)] for n, c in sorted(sends.items())}
    assert sim["tables"]["attempts"] == shown


def test_a_timeline_keeps_a_week_in_bounded_buckets_and_every_token():
    """A record a minute for a week: the timeline coarsens as it grows (never over MAX_BUCKETS) and
    loses no token; the report draws it in at most 120 bars, as wide as needed and no wider."""
    from genq.outputs.report import MAX_BARS, throughput
    from genq.outputs.stats import MAX_BUCKETS, Timeline

    timeline, start = Timeline(), 1_800_000_000.0
    for minute in range(7 * 24 * 60):
        timeline.add(start + minute * 60 + 0.5, 3)
        assert len(timeline.buckets) <= MAX_BUCKETS
    bars, width = throughput(timeline)
    assert len(bars) <= MAX_BARS and width == 7200, (len(bars), width)  # 2 h: the first that fits
    assert sum(b.value * width for b in bars) == 3 * 7 * 24 * 60
