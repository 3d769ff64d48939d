"""The base of kidx's tasks: a call that takes any keyword a message holds.

Celery's worker calls a task through `Task.__call__`, whose first parameter is named `self`
(its stack protection marks every task as having a custom `__call__`), so a host's message
with a keyword argument named `self` failed with Python's TypeError before any kidx code ran:
no job row, nothing recorded. The tasks take `self` positional-only and refuse such an
argument themselves (`tasks.run.bind_arguments`)."""

from __future__ import annotations

from typing import Any

from celery import Task


class KidxTask(Task):
    """Celery's task, with `self` positional-only in its call."""

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if "self" in kwargs:  # only Celery's own `__call__` cannot take it
            return self.run(*args, **kwargs)
        return super().__call__(*args, **kwargs)
