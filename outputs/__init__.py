"""The readers of an output folder: exports (export, parquet), the numbers of the files (stats),
one HTML page of a run (report, charts) and the dataset card (card). Each reads the files alone,
no Redis, and writes beside them; none is part of what `genq collect` runs."""
