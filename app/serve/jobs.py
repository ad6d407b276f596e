"""What crosses between the HTTP side and the engine thread of ``srl serve``.

A :class:`Job` is one request (its ``n`` choices are ``n`` trajectories of one group), its
prompt already rendered, tokenized and checked by the HTTP side (``ServeEngine.prepare``, on
a worker thread). The engine thread answers with events, in this order for each job:
:class:`Accepted` once its first choice has a batch slot, or :class:`Overloaded` if none came
within the queue-wait bound; then, per choice, any number of :class:`Delta` and exactly one
:class:`Finished`. :class:`Failed` ends a job early (the engine failed, the server is stopping,
or the job broke on the engine thread). ``mailbox`` and ``overflowed`` belong to the HTTP side
(its queue, and whether that queue hit its bound); the engine thread never touches them, it
only passes ``(job, event)`` pairs to its sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.serve.protocol import Kind, Logprobs, Sampling


@dataclass(eq=False)
class Job:
    completion_id: str
    kind: Kind
    prompt_ids: list[int]  # the prompt as the engine sees it (chat: the rendered template)
    sampling: Sampling
    request: dict[str, Any] = field(default_factory=dict)  # what the log keeps of the request
    mailbox: Any = None  # the HTTP side's queue of events
    overflowed: bool = False  # the HTTP side: its client fell too far behind (cancelled)

    @property
    def chat(self) -> bool:
        return self.kind == "chat"


@dataclass(frozen=True)
class Accepted:
    prompt_tokens: int


@dataclass(frozen=True)
class Overloaded:
    message: str  # no batch slot within the queue-wait bound (503, Retry-After)


@dataclass(frozen=True)
class Delta:
    index: int
    text: str
    logprobs: Logprobs = None  # of the tokens this piece used (when the request asked)


@dataclass(frozen=True)
class Finished:
    index: int
    text: str  # the last piece of text (may be empty)
    reason: str  # stop | length: the same finish reason as the choice's last chunk in the log
    tokens: int  # completion tokens of this choice
    version: int  # policy version of its last token
    logprobs: Logprobs = None  # of the tokens this last piece used


@dataclass(frozen=True)
class Failed:
    message: str  # why the job ends here, for the client (no internal detail: that is logged)
    status: int = 500  # 503 when the server is stopping or failed (retry elsewhere, later)


Event = Accepted | Overloaded | Delta | Finished | Failed
