"""The exceptions kidx raises, so that callers can tell what retrying would do.

    KidxError
    ├── ConfigError              the settings are wrong; nothing will work until they change
    ├── InvalidInput             bad input (an empty note, an unreadable file)
    ├── ItemNotFound             no item with that id
    ├── WrongTaskKind            a task of the wrong kind for its item
    ├── StoreError               the database cannot do what was asked
    │   └── StaleConfig          another embedding model now indexes this database
    ├── SourceUnavailable        a URL could not be fetched now (timeout, 5xx): retry later
    ├── BrokerUnavailable        the broker did not take a task: nothing was sent
    ├── KeyConflict              a key kidx uses in Redis holds another program's value
    ├── ProviderError            an embedding or chat provider failed
    │   ├── TransientProviderError   retrying later may help: 408/409/429/5xx, timeouts, resets
    │   │   ├── TimedOut             no answer within the timeout (a batch may be too large)
    │   │   └── ProviderDown         failed too often in a row: not asked until its cool-down
    │   ├── OutOfTime                the caller's time for the call ran out
    │   └── PermanentProviderError   retrying cannot help: 400/401/403, exhausted quota
    │       └── BadAnswer            the answer was unusable: wrong count, dimension, non-finite
    └── IndexAborted             too many vectors failed in a row; the previous index is intact

    Cancelled                    not a failure: a task was revoked; nothing was written

`Cancelled` is deliberately outside `KidxError`, so `except KidxError` never swallows it.
"""

from __future__ import annotations


class KidxError(Exception):
    """Base of every error kidx raises on purpose."""


class ConfigError(KidxError):
    """The settings are invalid or incomplete."""


class InvalidInput(KidxError):
    """Input that kidx refuses, with the reason."""


class ItemNotFound(KidxError):
    """No knowledge item has that id."""

    def __init__(self, item_id: int) -> None:
        super().__init__(f"no item with id {item_id}")
        self.item_id = item_id


class WrongTaskKind(KidxError):
    """A task was sent for an item of a kind it does not handle."""


class StoreError(KidxError):
    """The database could not do what was asked."""


class StaleConfig(StoreError):
    """The index is kept for another embedding model than this process's (a model switch by
    a process started since, worker.store.vec.config_conflict): it writes no vector."""


class SourceUnavailable(KidxError):
    """An item's source could not be read now (a timeout, a 5xx): a later retry may work."""


class BrokerUnavailable(KidxError):
    """The broker did not take a task within the patience; nothing was sent (`item_id`: the
    item whose row was written, for the reconcile sweep to send once the broker is back)."""

    def __init__(self, message: str, *, item_id: int | None = None) -> None:
        super().__init__(message)
        self.item_id = item_id


class KeyConflict(KidxError):
    """A key kidx keeps a lock or a request in (in the broker's Redis) holds a value of another
    type, which another program wrote: kidx neither uses nor deletes it, and says which key."""


class ProviderError(KidxError):
    """An embedding or chat provider failed."""


class TransientProviderError(ProviderError):
    """The provider failed in a way that may pass: retry later."""


class TimedOut(TransientProviderError):
    """The provider did not answer within the timeout: it may pass, and a batch may be more
    than it embeds in that time (sent again in halves)."""


class ProviderDown(TransientProviderError):
    """The provider failed too often in a row and is not asked until its cool-down ends."""


class OutOfTime(ProviderError):
    """The time its caller gave a call ran out. `unanswered`: the provider had the request (or
    failed an attempt) and did not answer in that time, which says it is slow or down; else
    no request was made."""

    def __init__(self, message: str, *, unanswered: bool) -> None:
        super().__init__(message)
        self.unanswered = unanswered


class PermanentProviderError(ProviderError):
    """The provider refused in a way that retrying will not change.

    `per_input`: the refusal may concern one text of the batch (a 400 for an over-long input,
    a NaN in one vector), so each text is worth trying alone; otherwise (401, exhausted quota,
    the wrong dimension) every text would fail the same way.
    """

    def __init__(self, message: str, *, per_input: bool = False) -> None:
        super().__init__(message)
        self.per_input = per_input


class BadAnswer(PermanentProviderError):
    """The provider answered, but the answer cannot be used."""


class IndexAborted(KidxError):
    """The item's run was abandoned and rolled back (three vectors failed in a row, or the
    provider refused outright); `transient` when a later retry may succeed; `provider_down`
    when the provider's requests failed N times in a row (counted across a batch's runs)."""

    def __init__(
        self,
        message: str,
        *,
        transient: bool = False,
        retry_after: float | None = None,
        provider_down: bool = False,
    ) -> None:
        super().__init__(message)
        self.transient = transient
        self.retry_after = retry_after
        self.provider_down = provider_down


class Cancelled(Exception):
    """The run was cancelled (revoked); it rolled back and is not a failure."""


# Python's errors that code raises on input it cannot handle (a parser, a model, a bug an input
# triggers), subclasses defined anywhere included (json's JSONDecodeError, binascii.Error).
INPUT_ERRORS: tuple[type[Exception], ...] = (
    ValueError,  # UnicodeError, json's JSONDecodeError
    TypeError,
    LookupError,  # KeyError, IndexError
    ArithmeticError,
    AttributeError,
    AssertionError,
    RuntimeError,  # RecursionError; torch's own failures
    OSError,
    EOFError,
)


def input_failure(error: BaseException, *packages: str) -> bool:
    """Whether `error` is a failure of the code that ran on some input: kidx's (KidxError),
    Python's (INPUT_ERRORS and their subclasses, or any other class `builtins` defines: a Rust
    extension raises a bare Exception), or one a library of `packages` defines (top-level
    names: "pypdf"). MemoryError is one too (builtins): on one input it is mostly that
    input's size (a bomb, a huge answer), which the fallback or the refusal lets go of.

    Anything else is an interruption raised wherever the code happened to be, above all
    Celery's soft time limit (billiard's SoftTimeLimitExceeded, an Exception subclass its
    signal handler raises): an `except Exception` that turns failures into a fallback or a
    refusal must re-raise it, or the run goes on towards the hard kill. The engine cannot name
    it (it imports no Celery), hence the list of what may be caught rather than of what not."""
    if isinstance(error, (KidxError, *INPUT_ERRORS)):
        return True
    return type(error).__module__.partition(".")[0] in {"builtins", *packages}
