"""The collector role: drains the result stream into deduplicated JSONL on disk."""
