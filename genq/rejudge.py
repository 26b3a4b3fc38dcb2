"""The endings the check stage filed ``check_failed``, listed and sent to be judged again.

A checker that fails on a record (it raises, answers nonsense, times out) ``--max-check-attempts``
times has it filed ``check_failed``: in rejected_samples.jsonl like a rejection, and kept as it
came to the check stage in ``ds:<name>:check_failed`` (checker/commit.py, in the verdict's own
script). Once the checker is fixed, `genq retry --check-failed` sends each back, nothing
generated again: one script per ending moves it to the unchecked stream with ``rejudged`` counted
up in its record, clears its ``checked`` bit (so its verdict is applied anew: under ``--accept K``
a rejection then draws the next sample, an acceptance counts), sets its ``extending`` bit (the
line on disk will be superseded: status counts it pending meanwhile), and takes it off the
``check_failed`` count. The collector appends the new line, which supersedes the old one
(genq/schema.py ``rejudged``); its tokens were counted already. Only endings already on disk are
sent (the line to supersede must be there first); the others wait for the next run of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from genq.bitmaps import is_set
from genq.entries import ENTRY_DATA, ENTRY_VERDICT, BadEntry, read_entry
from genq.keys import Keys
from genq.schema import REJUDGED, dumps, loads, rejudged

BATCH = 500
LISTED = 100  # `genq failed` shows the last this many of each dataset

# KEYS: check_failed stream, unchecked stream, in_check, checked, extending, verdicts.
# ARGV: the check_failed entry's id, the dataset, the job's bit, then the unchecked entry's fields.
SEND_AGAIN = """
local kept, unchecked, in_check = KEYS[1], KEYS[2], KEYS[3]
local checked, extending, verdicts = KEYS[4], KEYS[5], KEYS[6]
local entry_id, dataset, index = ARGV[1], ARGV[2], tonumber(ARGV[3])
if redis.call('XDEL', kept, entry_id) == 0 then
  return 0  -- sent already (another retry at once)
end
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', unchecked, '*', unpack(fields))
redis.call('HINCRBY', in_check, dataset, 1)
redis.call('SETBIT', checked, index, 0)
redis.call('SETBIT', extending, index, 1)
redis.call('HINCRBY', verdicts, 'check_failed', -1)
return 1
"""


@dataclass(frozen=True)
class CheckFailed:
    """One ending the checker failed on, as `genq failed` shows it."""

    dataset: str
    id: str
    reason: str
    checker: str | None


def listed(conn: redis.Redis, keys: Keys, name: str) -> tuple[int, list[CheckFailed]]:
    """How many endings of ``name`` wait filed check_failed, and the last LISTED of them (Redis
    content: a verdict that is not an object shows as unknown)."""
    stream = keys.check_failed(name)
    total = conn.xlen(stream)
    shown = []
    for _, fields in reversed(conn.xrevrange(stream, count=LISTED)):
        verdict = _object(fields.get(ENTRY_VERDICT.encode()))
        data = _object(fields.get(ENTRY_DATA.encode()))
        shown.append(
            CheckFailed(
                name,
                str(data.get("id", "?")),
                str(verdict.get("reason") or "unknown")[:300],
                verdict.get("checker") if isinstance(verdict.get("checker"), str) else None,
            )
        )
    return total, shown


def send_again(conn: redis.Redis, keys: Keys, name: str, samples: int) -> tuple[int, int, int]:
    """Every check_failed ending of ``name`` on disk sent to be judged again; returns (sent, not on
    disk yet, not a genq ending: left where it is for `genq failed` to show)."""
    script = conn.register_script(SEND_AGAIN)
    done = conn.get(keys.done(name)) or b""
    stream = keys.check_failed(name)
    sent = waiting = bad = 0
    after = "-"
    while True:
        found = conn.xrange(stream, min=after, count=BATCH)
        if not found:
            return sent, waiting, bad
        for entry_id, fields in found:
            try:
                entry = read_entry(fields, name, samples)
            except BadEntry:
                bad += 1
                continue
            if not is_set(done, entry.index):
                waiting += 1
                continue
            again = {**entry.data, REJUDGED: (rejudged(entry.data) or 0) + 1}
            flat: list[Any] = []
            for key, value in fields.items():
                if key == ENTRY_VERDICT.encode():
                    continue
                flat += [key, dumps(again) if key == ENTRY_DATA.encode() else value]
            touched = [stream, keys.unchecked(name), keys.in_check, keys.checked(name)]
            touched += [keys.extending(name), keys.verdicts(name)]
            sent += script(keys=touched, args=[entry_id, name, entry.index, *flat])
        after = "(" + found[-1][0].decode()  # exclusive: the entries after it


def _object(raw: bytes | None) -> dict[str, Any]:
    try:
        value = loads(raw) if raw is not None else None
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
