"""Celery tasks (`tasks.index`), cancellation (`tasks.cancel`) and the producer API
(`tasks.producer`). Importing this package imports no Celery app."""

NOTE = "GenerateEmbedding"
KNOWLEDGE_ITEM = "GenerateKnowledgeItemEmbedding"
TASK_FOR_KIND = {"note": NOTE} | dict.fromkeys(("file", "url", "code"), KNOWLEDGE_ITEM)
