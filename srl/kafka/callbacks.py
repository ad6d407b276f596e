"""``callback``: a function handed to confluent-kafka whose error comes out as itself.

confluent-kafka 2.16 keeps an exception raised in a callback (a rebalance callback, a
delivery report) and raises it again from the client call that served the callback
(``poll``, ``consume``, ``close``, ``flush``). On Python < 3.12 it does so with
``PyErr_Fetch``/``PyErr_SetObject``, which only works for an exception that Python has
already normalized. One raised by the client's own C code inside the callback (a
``committed()`` that timed out inside ``on_assign``) is not: it comes back as a bare
``KafkaError`` object, which is not an exception, so no ``except`` clause matches it (not
``BaseException``, not pytest's) and it ends whatever was running. Caught and raised again
in Python, the exception is normalized before the client keeps it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def callback(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn``, whose exceptions reach the client normalized (see the module doc)."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except BaseException:  # caught and raised again: that normalizes it
            raise

    return call
