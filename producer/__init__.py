"""The producer role: reads datasets and enqueues one RQ job per prompt (and sample)."""
