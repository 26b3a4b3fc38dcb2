"""The worker role: an asyncio RQ worker that keeps many /generate calls in flight."""
