"""Celery tasks (`tasks.index`, `tasks.group`), cancellation (`tasks.cancel`) and the producer API
(`tasks.producer`). Importing this package imports no Celery app."""

NOTE = "GenerateEmbedding"
KNOWLEDGE_ITEM = "GenerateKnowledgeItemEmbedding"
GROUP = "kidx.index_group"  # a bulk run's items in one task (tasks.group)
TASK_FOR_KIND = {"note": NOTE} | dict.fromkeys(("file", "url", "code"), KNOWLEDGE_ITEM)
