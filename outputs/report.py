"""`genq report DIR`: one self-contained HTML page of a run, from the files alone (no Redis).

The numbers are `genq stats`'s (outputs/stats.py reads the files); this module only lays them
out, with bar charts as inline SVG (outputs/charts.py). Every string from the files is escaped:
they are untrusted (a prompt or a server's error message may hold markup). The page loads nothing
(no script, no network; its Content-Security-Policy forbids both).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from html import escape
from pathlib import Path

import click

from genq.outputs.charts import Bar, bar_chart
from genq.outputs.stats import WIDTHS_S, DatasetStats, Timeline, folder_stats, percentiles
from genq.schema import ERRORS, RAW
from genq.settings import option

UNKNOWN = "unknown"
HIST_BINS = 20
MAX_BARS = 120  # throughput bars: the narrowest bucket that draws the run in at most this many

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em auto;max-width:60em;color:#222}
h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;margin-top:2em}h3{font-size:1em;margin:1.2em 0 .3em}
table{border-collapse:collapse}td,th{padding:.15em .8em .15em 0;text-align:left;vertical-align:top}
td.n{text-align:right;font-variant-numeric:tabular-nums}.note{color:#666}
.chart .bar{fill:#4a7bb7}.chart line{stroke:#888}.chart text{font-size:11px;fill:#555}
pre{white-space:pre-wrap;margin:0}
"""


def _utc(epoch: float, fmt: str = "%Y-%m-%d %H:%M:%S UTC") -> str:
    return time.strftime(fmt, time.gmtime(epoch))


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    hours = f"{s // 3600} h " if s >= 3600 else ""
    return f"{s:,} s ({hours}{s % 3600 // 60} min {s % 60} s)"


def _rows(rows: list[tuple[str, str]], cls: str) -> str:
    """A two-column table; each row's key as ``data-k`` (the tests read the numbers by it). Both
    columns are escaped here."""
    body = "".join(
        f'<tr data-k="{escape(k)}"><th>{escape(k)}</th><td class="n">{escape(v)}</td></tr>' for k, v in rows
    )
    return f'<table class="{cls}">{body}</table>'


def _note(text: str) -> str:
    return f'<p class="note">{escape(text)}</p>'


# -- the charts' bars ---------------------------------------------------------------------------


def histogram(lengths: list[int]) -> list[Bar]:
    """At most HIST_BINS bins of whole-token width from the shortest completion to the longest."""
    lo, hi = min(lengths), max(lengths)
    width = math.ceil((hi - lo + 1) / HIST_BINS)
    counts = Counter((n - lo) // width for n in lengths)
    bars = []
    for i in range(math.ceil((hi - lo + 1) / width)):
        start, end = lo + i * width, lo + (i + 1) * width - 1
        span = f"{start:,}" if width == 1 else f"{start:,}–{end:,}"
        bars.append(Bar(counts[i], span, f"{span} tokens: {counts[i]:,} records"))
    return bars


def throughput(finished: Timeline) -> tuple[list[Bar], int]:
    """Completion tokens per second, one bar per bucket from the first to the last (a bucket in
    which nothing finished is a real 0), the buckets as narrow as MAX_BARS allows: a 30-s run is
    drawn by the second, a day by the quarter hour. Returns the bars and their width in seconds."""
    fine = finished.width_s
    first, last = min(finished.buckets) * fine, (max(finished.buckets) + 1) * fine  # epoch seconds
    usable = [w for w in WIDTHS_S if w >= fine and w % fine == 0]
    width = next((w for w in usable if (last // w - first // w) <= MAX_BARS), usable[-1])
    buckets: Counter = Counter()
    for bucket, tokens in finished.buckets.items():
        buckets[bucket * fine // width] += tokens
    bars = []
    for i in range(first // width, (last - 1) // width + 1):
        rate = buckets[i] / width
        at = _utc(i * width)
        bars.append(Bar(rate, at, f"{at}: {rate:,.1f} tokens/s"))
    return bars, width


# -- one dataset --------------------------------------------------------------------------------


def _capped(d: DatasetStats) -> str:
    if not d.capped_known:
        return UNKNOWN
    rest = d.records - d.capped_known
    return f"{d.capped:,}" + (f" (unknown for {rest:,} records of another tool)" if rest else "")


def _numbers(d: DatasetStats) -> str:
    return _rows(
        [
            ("records", f"{d.records:,}"),
            ("failed", f"{sum(d.errors.values()):,}"),
            ("capped", _capped(d)),
            ("prompt tokens", f"{d.prompt_tokens:,}"),
            ("completion tokens", f"{d.completion_tokens:,}"),
            ("unrecognized lines", f"{d.unrecognized:,}"),
        ],
        "numbers",
    )


def _lengths(d: DatasetStats) -> str:
    lengths = d.record_lengths()
    if not lengths:
        return _note("no records")
    return bar_chart(histogram(lengths), "completion length histogram", "records", "tokens")


def _ledger(d: DatasetStats) -> str:
    book = d.ledger()
    if book is None:
        return _note("no ledger: records of another tool")
    return _rows([(k, f"{v:,}") for k, v in book.items()], "ledger: where each row read went")


def _check(d: DatasetStats) -> str:
    """A checked dataset's check stage (genq check): verdicts, samples per prompt, the prompts that
    reached K and those that hit M without K."""
    check = d.check()
    if check is None:
        return ""
    rows = [(status, f"{n:,}") for status, n in check["verdicts"].items()]
    rows += [("prompts", f"{check['prompts']:,}"), ("samples per prompt", f"{check['samples_per_prompt']:,}")]
    if "accept" in check:
        rows += [
            (f"prompts with {check['accept']} accepted", f"{check['prompts_with_k']:,}"),
            (f"prompts short after {check['max_samples']} samples", f"{check['short_of_k']:,}"),
        ]
    return "<h3>Check</h3>" + _rows(rows, "check: what the checker made of the samples")


def _throughput(d: DatasetStats) -> str:
    if not d.finished:
        return _note(f"{UNKNOWN}: no record says when it finished (finished_at)")
    bars, width = throughput(d.finished)
    per = _duration(width) if width < 60 else f"{width // 60} min" if width < 3600 else f"{width // 3600} h"
    chart = bar_chart(bars, "completion tokens per second", "tok/s", "")
    missing = d.records - d.timed
    return (
        chart
        + _note(f"one bar per {per}")
        + (_note(f"{missing:,} of {d.records:,} records are not in it (no finished_at)") if missing else "")
    )


def _latency(d: DatasetStats) -> str:
    pct = percentiles(d.latencies)
    if pct is None:
        return _note(f"{UNKNOWN}: the records carry no latency")
    missing = d.records - len(d.latencies)
    table = _rows([(k, f"{pct[k]:,.3f} s") for k in ("p50", "p90", "p99", "min", "max")], "latency")
    note = _note(f"{UNKNOWN} for {missing:,} of {d.records:,} records (no latency)") if missing else ""
    return table + note


def _attempts(d: DatasetStats) -> str:
    rows = [(f"{n} send" + ("s" if n > 1 else ""), f"{c:,}") for n, c in sorted(d.attempts.items())]
    missing = d.records - sum(d.attempts.values())
    if missing:
        rows.append((UNKNOWN, f"{missing:,}"))
    return _rows(rows, "attempts") if d.records else _note("no records")


def _failures(d: DatasetStats) -> str:
    if not d.errors:
        return _note("none")
    body = "".join(
        f'<tr data-k="{escape(cls)}"><th>{escape(cls)}</th><td class="n">{count:,}</td>'
        f"<td><pre>{escape(d.error_examples.get(cls, UNKNOWN))}</pre></td></tr>"
        for cls, count in d.errors.most_common()
    )
    return f'<table class="failures"><tr><th>class</th><th>count</th><th>e.g.</th></tr>{body}</table>'


def _dataset(name: str, d: DatasetStats) -> str:
    finish = _rows([(k, f"{v:,}") for k, v in (+d.finish_reasons).most_common()], "finish")
    parts = [
        f'<section class="dataset" data-dataset="{escape(name)}"><h2>{escape(name)}</h2>',
        _numbers(d),
        "<h3>Ledger</h3>",
        _ledger(d),
        _check(d),
        "<h3>Completion length</h3>",
        _lengths(d),
        "<h3>Finish reasons</h3>",
        finish if d.records else _note("no records"),
        "<h3>Throughput (completion tokens per second)</h3>",
        _throughput(d),
        "<h3>Latency</h3>",
        _latency(d),
        "<h3>Attempts (sends a record needed)</h3>",
        _attempts(d),
        "<h3>Failures</h3>",
        _failures(d),
    ]
    if d.unrecognized:
        parts.append(f"<h3>Unrecognized lines ({d.unrecognized:,}, not counted), e.g.</h3>")
        parts.append("<ul>" + "".join(f"<li><pre>{escape(e)}</pre></li>" for e in d.examples) + "</ul>")
    return "".join(parts) + "</section>"


# -- the page -----------------------------------------------------------------------------------


def _totals(stats: dict[str, DatasetStats]) -> str:
    ds = stats.values()
    firsts = [d.first_at for d in ds if d.first_at is not None]
    lasts = [d.last_at for d in ds if d.last_at is not None]
    wall = (
        f"{_duration(max(lasts) - min(firsts))}, {_utc(min(firsts))} to {_utc(max(lasts))}"
        if firsts
        else f"{UNKNOWN} (no record says when it finished)"
    )
    return _rows(
        [
            ("datasets", f"{len(stats):,}"),
            ("records", f"{sum(d.records for d in ds):,}"),
            ("failed", f"{sum(sum(d.errors.values()) for d in ds):,}"),
            ("prompt tokens", f"{sum(d.prompt_tokens for d in ds):,}"),
            ("completion tokens", f"{sum(d.completion_tokens for d in ds):,}"),
            ("wall time", wall),
        ],
        "totals",
    )


def render(folder: Path, stats: dict[str, DatasetStats]) -> str:
    title = f"genq report: {folder.resolve().name}"
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        "<meta http-equiv=Content-Security-Policy content=\"default-src 'none'; style-src 'unsafe-inline'\">"
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>{escape(title)}</h1>"
        + _note(f"{folder.resolve()}, read {_utc(time.time())}; wall time: first to last finished_at")
        + '<section class="run"><h2>Run</h2>'
        + _totals(stats)
        + "</section>"
        + "".join(_dataset(name, d) for name, d in stats.items())
        + "</body></html>\n"
    )


@click.command("report")
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@option(
    "--output",
    env="GENQ_REPORT_OUTPUT",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write the page (default: FOLDER/report.html).",
)
def report_command(folder: Path, output: Path | None) -> None:
    """One self-contained HTML page of FOLDER's run, from the files alone (as `genq stats` reads
    them): per dataset records, failed, capped, a completion-length histogram, finish reasons,
    throughput over time, latency, attempts and failures; the run's totals. No script, no network."""
    if not any(folder.glob(f"*/{RAW}")) and not any(folder.glob(f"*/{ERRORS}")):
        raise click.ClickException(
            f"{folder}: not a genq output folder (no <dataset>/{RAW} in it): give the folder "
            "`genq run --out` or `genq collect --out` wrote"
        )
    stats = folder_stats(folder)
    if not stats:
        raise click.ClickException(f"no *.jsonl files under {folder}: nothing to report")
    output = output or folder / "report.html"
    try:
        output.write_text(render(folder, stats))
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc.strerror or exc}") from exc
    click.echo(f"wrote {output}")
