"""A dataset's settings, fixed at its first enqueue (decision 12).

One output file never mixes two recipes: enqueueing more rows of a dataset with other
generation settings is refused unless the caller says so explicitly.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from genq.keys import Keys, validate_name
from genq.schema import SETTINGS, dumps, loads, now_iso

log = logging.getLogger("genq.datasets")
_refused: set[bytes] = set()  # names already said to be refused: one error line each per process


@dataclass
class DatasetSettings:
    name: str
    samples: int
    sampling_params: dict[str, Any]
    sources: list[str] = field(default_factory=list)
    created_at: str = field(default_factory=now_iso)
    # How rows become prompts (format, field mapping, tokenizer and template, system prompt, think
    # markers, ...): only the settings that differ from the defaults, so older recipes still match.
    prompting: dict[str, Any] = field(default_factory=dict)
    # The check stage (enqueue --checked / --accept K): {} when records go straight to the collector;
    # else {"accept": K}, K None to judge every sample and draw no more, or a number: draw K samples a
    # prompt and one more for each not accepted, until K are or ``samples`` (the most) were drawn.
    check: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Settings read from Redis or a file are untrusted input: each field of the type genq
        writes (every role computes job positions from ``samples``), else ValueError naming it."""
        checks = (
            (
                "samples",
                isinstance(self.samples, int) and not isinstance(self.samples, bool) and self.samples >= 1,
            ),
            ("sampling_params", isinstance(self.sampling_params, dict)),
            ("sources", isinstance(self.sources, list) and all(isinstance(x, str) for x in self.sources)),
            ("created_at", isinstance(self.created_at, str)),
            ("prompting", isinstance(self.prompting, dict)),
            ("check", isinstance(self.check, dict) and set(self.check) <= {"accept"}),
        )
        for name, ok in checks:
            if not ok:
                raise ValueError(f"field {name!r} is {getattr(self, name)!r:.60}, not what genq writes")
        accept = self.check.get("accept")
        if accept is not None and not (
            isinstance(accept, int) and not isinstance(accept, bool) and 1 <= accept <= self.samples
        ):
            raise ValueError(f"check field 'accept' is {accept!r:.60}, not a whole number in [1, samples]")
        most = self.sampling_params.get("max_new_tokens")
        if not isinstance(most, int) or isinstance(most, bool) or most < 1:
            raise ValueError(
                f"sampling_params field 'max_new_tokens' is {most!r:.60}, not a whole number ≥ 1"
            )

    def recipe(self) -> dict[str, Any]:
        """What must match between two enqueues of the same dataset."""
        recipe: dict[str, Any] = {"samples": self.samples, "sampling_params": self.sampling_params}
        if self.check:
            recipe["check"] = self.check
        return {**recipe, "prompting": self.prompting} if self.prompting else recipe

    @property
    def checked(self) -> bool:
        """Its records pass the check stage (``genq check``) before the collector files them."""
        return bool(self.check)

    @property
    def first_draw(self) -> int:
        """Samples enqueued a prompt at first: K under --accept K, else all of them."""
        return self.check.get("accept") or self.samples


class SettingsMismatch(Exception):
    pass


def _differences(first: dict[str, Any], now: dict[str, Any], where: str = "") -> str:
    """Only the settings that differ, each as `key X, not Y` (nested ones by their path): two
    whole recipes side by side hide the one key that matters."""
    said = []
    for key in sorted(set(first) | set(now), key=str):
        a, b = first.get(key, "unset"), now.get(key, "unset")
        if isinstance(a, dict) and isinstance(b, dict):
            said.append(_differences(a, b, f"{where}{key}."))
        elif a != b:
            said.append(f"{where}{key} {a!r:.200}, not {b!r:.200}")
    return ", ".join(x for x in said if x)


def settings_for(
    name: str,
    paths: list[Path],
    sampling_params: dict[str, Any],
    samples: int,
    prompting: dict[str, Any] | None = None,
    check: dict[str, Any] | None = None,
) -> DatasetSettings:
    """The settings an enqueue of ``paths`` as dataset ``name`` records."""
    return DatasetSettings(
        name=name,
        samples=samples,
        sampling_params=sampling_params,
        sources=[p.name for p in paths],
        prompting=prompting or {},
        check=check or {},
    )


def load_all(conn: redis.Redis, keys: Keys) -> dict[str, DatasetSettings]:
    """Every dataset of the namespace whose entry is sound. Redis content is untrusted input: a name
    enqueue would refuse (``..``, ``/abs``: it becomes a folder under OUT) or settings that do not
    parse are left out with one error line, so no role touches a file or queue for it, and its
    stream entries stay unacknowledged while every other dataset goes on."""
    found = {}
    for key, value in sorted(conn.hgetall(keys.datasets).items()):
        try:
            name = validate_name(key.decode("utf-8", "replace"))
            settings = DatasetSettings(**loads(value))
            if settings.name != name:
                raise ValueError(f"its settings name another dataset, {settings.name!r}")
        except (TypeError, ValueError) as exc:
            if key not in _refused:
                _refused.add(key)
                log.error("refusing dataset %r found in %s: %s", key, keys.datasets, exc)
            continue
        found[name] = settings
    return found


def write_file(settings: DatasetSettings, folder: Path) -> None:
    """``folder/dataset.json``: the settings beside the dataset's files, replaced whole (a reader
    never sees half of it)."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (SETTINGS + ".part")
    tmp.write_bytes(dumps(asdict(settings)) + b"\n")
    os.replace(tmp, folder / SETTINGS)


def read_file(folder: Path) -> DatasetSettings | None:
    """The settings in ``folder/dataset.json``, or None when there are none (a folder written
    before genq kept them) or they do not parse (ValueError says why)."""
    try:
        raw = (folder / SETTINGS).read_bytes()
    except FileNotFoundError:
        return None
    try:
        value = loads(raw)
        settings = DatasetSettings(**value) if isinstance(value, dict) else None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{folder / SETTINGS}: not genq's dataset settings: {exc}") from exc
    if settings is None or not isinstance(settings.prompting, dict):
        raise ValueError(f"{folder / SETTINGS}: not genq's dataset settings")
    return settings


def load(conn: redis.Redis, keys: Keys, name: str) -> DatasetSettings | None:
    raw = conn.hget(keys.datasets, name)
    return DatasetSettings(**loads(raw)) if raw else None


def register(
    conn: redis.Redis, keys: Keys, settings: DatasetSettings, replace: bool = False
) -> DatasetSettings:
    """Record ``settings`` for a new dataset, or check them against the recorded ones.

    Returns the settings in force. Raises :class:`SettingsMismatch` when the recipe differs,
    ``replace`` is false and a job of the dataset was enqueued already (before that, the new
    settings replace the recorded ones: nothing was made with those).
    """
    if conn.hsetnx(keys.datasets, settings.name, dumps(asdict(settings))):
        return settings
    current = load(conn, keys, settings.name)
    assert current is not None
    old, new = current.sources, settings.sources
    if new[: len(old)] != old and old[: len(new)] != new:
        raise SettingsMismatch(
            f"dataset {settings.name!r} was enqueued from {old}; rows are numbered across files in "
            f"that order, so {new} would reuse their ids. Give the same files first (more may follow), "
            "or use another --dataset name"
        )
    if current.recipe() == settings.recipe():
        if len(new) > len(old):
            current.sources = new
            conn.hset(keys.datasets, settings.name, dumps(asdict(current)))
        return current
    if not replace and not conn.bitcount(keys.enqueued(settings.name)):
        # Nothing of it was ever enqueued (a first run that failed before its first row, say
        # without the --tokenizer its rows need): its settings bind nothing yet.
        conn.hset(keys.datasets, settings.name, dumps(asdict(settings)))
        return settings
    if not replace:
        raise SettingsMismatch(
            f"dataset {settings.name!r} was first enqueued with "
            f"{_differences(current.recipe(), settings.recipe())}; "
            "give the same settings, use another --dataset name, or --replace-settings to mix recipes "
            "in one output file"
        )
    if current.samples != settings.samples:
        raise SettingsMismatch(f"dataset {settings.name!r}: --samples cannot change ({current.samples})")
    conn.hset(keys.datasets, settings.name, dumps(asdict(settings)))
    return settings
