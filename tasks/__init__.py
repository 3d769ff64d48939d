"""Celery tasks (`tasks.index`, `tasks.group`), cancellation (`tasks.cancel`) and the producer API
(`tasks.producer`). Importing this package imports no Celery app."""

NOTE = "GenerateEmbedding"
KNOWLEDGE_ITEM = "GenerateKnowledgeItemEmbedding"
GROUP = "kidx.index_group"  # a bulk run's items in one task (tasks.group)
TASK_FOR_KIND = {"note": NOTE} | dict.fromkeys(("file", "url", "code"), KNOWLEDGE_ITEM)


def attempt_of(retries: object) -> int:
    """A run's attempt from Celery's `retries` header, which a host's message may set to
    anything ("abc", [1], -1000, 10**30): 0 for what is no count or below 0, and at most the
    largest KIDX_TASKS__MAX_RETRIES (past a run's own, it has no retry left), so that it is
    stored and a retry counts on from it within bounds (from -1000, Celery retried a thousand
    times more)."""
    from worker.settings import RETRIES_MAX

    return min(max(retries, 0), RETRIES_MAX) if type(retries) is int else 0
