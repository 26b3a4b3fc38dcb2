"""A dataset's results as Python reads them: the records on disk, the errors and the rejected
samples apart, as a ``datasets.Dataset`` or a pandas ``DataFrame``. From the files alone (the
collector's folder), as `genq export` reads them: no Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from genq.api.errors import GenqError, genq_errors
from genq.keys import validate_name
from genq.outputs.export import records
from genq.outputs.parquet import records_table
from genq.schema import ERRORS, RAW, REJECTED_SAMPLES


class Results:
    """The records of one dataset in an output folder (``OUT/<dataset>/``)."""

    def __init__(self, out: Path, dataset: str) -> None:
        self.folder = Path(out) / validate_name(dataset)
        self.dataset = dataset

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Each job's record in the order of the dataset's rows (and samples), an id's latest line
        only (the supersede rule: a continuation or a record judged again replaces its first line);
        a line the collector is still writing is left for the next read."""
        raw = self.folder / RAW
        if not raw.exists():
            return
        with genq_errors():
            yield from records(raw)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def errors(self) -> Iterator[dict[str, Any]]:
        """The jobs that failed for good (errors.jsonl), one line each, as the collector wrote them."""
        return _lines(self.folder / ERRORS)

    def rejected(self) -> Iterator[dict[str, Any]]:
        """The samples the check stage rejected (rejected_samples.jsonl), apart from the records."""
        return _lines(self.folder / REJECTED_SAMPLES)

    def to_dataset(self) -> Any:
        """The records as a ``datasets.Dataset`` with the columns of `genq export --format parquet`
        (the record's fields typed; nested ones and any other field as JSON text)."""
        import datasets

        try:
            return datasets.Dataset(records_table(self))
        except ValueError as exc:
            raise GenqError(f"{self.folder / RAW}: {exc}") from None

    def to_pandas(self) -> Any:
        """The records as a pandas ``DataFrame``, one row per record, nested fields as Python objects."""
        import pandas

        return pandas.DataFrame.from_records(list(self))


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    """Every complete JSON line of ``path`` (none when it does not exist)."""
    if not path.exists():
        return
    with path.open("rb") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.endswith(b"\n") or not line.strip():
                continue  # the collector is writing it
            try:
                yield orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise GenqError(f"{path}:{number}: malformed JSON: {exc}") from None
