"""What crosses between the HTTP side and the engine thread of ``srl serve``.

A :class:`Job` is one request (its ``n`` choices are ``n`` trajectories of one group). The
HTTP side builds it and hands it to the engine thread; the engine thread answers with
events, in this order for each job: :class:`Accepted` or :class:`Rejected` first; then, per
choice, any number of :class:`Delta` and exactly one :class:`Finished`. :class:`Failed` ends a
job early when the engine itself fails. ``mailbox`` belongs to the HTTP side (its queue);
the engine thread never touches it, it only passes ``(job, event)`` pairs to its sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.serve.protocol import Kind, Sampling


@dataclass(eq=False)
class Job:
    completion_id: str
    kind: Kind
    prompt: str | list[int]  # text (tokenized by the engine thread) or token ids
    sampling: Sampling
    request: dict[str, Any] = field(default_factory=dict)  # what the log keeps of the request
    mailbox: Any = None  # the HTTP side's queue of events

    @property
    def chat(self) -> bool:
        return self.kind == "chat"


@dataclass(frozen=True)
class Accepted:
    prompt_tokens: int


@dataclass(frozen=True)
class Rejected:
    message: str  # a user error: the request can never run (400)


@dataclass(frozen=True)
class Delta:
    index: int
    text: str


@dataclass(frozen=True)
class Finished:
    index: int
    text: str  # the last piece of text (may be empty)
    reason: str  # stop | length (| abort when the server stops under it)
    tokens: int  # completion tokens of this choice
    version: int  # policy version of its last token


@dataclass(frozen=True)
class Failed:
    message: str  # the engine failed; the job ends here (500)


Event = Accepted | Rejected | Delta | Finished | Failed
