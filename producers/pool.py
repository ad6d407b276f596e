"""Pool epochs: a generator pool assigns its partitions itself, so no broker can wedge it.

A broker that never evicts a dead member (the embedded noida-db) keeps a SIGKILLed
generator in its pool's consumer group for good, and sometimes never answers a joining
member (docs/reliability.md, "Wedged pools"). So a pool's workers do not join a consumer
group on the broker at all: they decide their membership and their partitions among
themselves, in *epochs*, and commit their positions to the pool's group
(``{prefix}.gen.{pool}``) as a group without members, which every broker accepts. This
module is the pure part: records in, decisions out. ``producers.pool_member`` does the
Kafka I/O in a thread; the worker only releases and takes partitions when told.

Records, JSON, key = pool:

* on ``{prefix}.pool.beats`` every member says every ``beat_s`` which epoch it is in and in
  which state: ``member`` (holds its partitions of that epoch), ``ready`` (holds nothing;
  waits for that epoch to open) or ``left`` (gone for good);
* on ``{prefix}.pool.epochs`` the *leader* (the smallest live member key) announces epoch
  ``N+1`` whenever the live members differ from the current epoch's (one joined, left, or
  has been silent for ``session_s``): its assignment of every task partition to the live
  members, and the members it waits for (those holding partitions now); it opens the epoch
  once each of them has released its partitions (handed off its in-flight trajectories,
  committed what was finished) and said it is ready.

What must hold:

* the first announcement of an epoch number wins (the topic has one partition, so every
  member sees the same first one); an epoch is opened only by its announcer, only after
  every member it waits for is ready: no partition is ever worked on by two members;
  a member it waits for that goes silent instead makes the leader announce again without it;
* an announcement waits only for the members of the newest *opened* epoch; a member that
  still holds partitions of an older one (it was silent: SIGSTOPped, cut off, and the pool
  went on without it), or that an announcement did not wait for, is *fenced*: it drops its
  work without publishing or committing (the new owners already resume it from the
  published prefix) and waits to be given partitions again. What it had queued before it
  learnt that still reaches the log; its chunks carry its epoch and every reader drops them
  (``srl.lineage``);
* a member is dead after ``session_s`` without a beat (Kafka's ``session.timeout.ms``
  contract); its partitions' unfinished tasks are redelivered from the committed positions
  and resumed from their published prefixes (``producers.recovery``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

State = Literal["member", "ready", "left"]
TopicPart = tuple[str, int]


def assign(members: list[str], partitions: list[TopicPart]) -> dict[str, tuple[TopicPart, ...]]:
    """Every partition to one member, round-robin over the sorted members and partitions
    (each member gets at most one more than any other)."""
    keys, parts = sorted(members), sorted(partitions)
    if not keys:
        return {}
    return {k: tuple(parts[i :: len(keys)]) for i, k in enumerate(keys)}


@dataclass(frozen=True)
class Beat:
    key: str  # worker name and incarnation: a restarted worker is a new member
    epoch: int
    state: State
    seen: float  # monotonic time it was sent (as far as the reader can tell)


@dataclass(frozen=True)
class Epoch:
    epoch: int
    assignment: dict[str, tuple[TopicPart, ...]]
    waits: tuple[str, ...]  # the members holding partitions when it was announced
    by: str  # the announcer, the only one who opens it
    opened: bool = False


@dataclass(frozen=True)
class Release:
    """Release every partition (hand off, commit; ``fenced``: drop the work unpublished)."""

    epoch: int
    fenced: bool


@dataclass(frozen=True)
class Take:
    """Assign these partitions: this member's share of the open ``epoch``."""

    epoch: int
    partitions: tuple[TopicPart, ...]


@dataclass
class PoolView:
    """What one member knows of its pool: the current epoch, the last beat of every member."""

    pool: str
    session_s: float
    current: Epoch = field(default_factory=lambda: Epoch(0, {}, (), "", opened=True))
    beats: dict[str, Beat] = field(default_factory=dict)
    last_opened: int = 0  # the newest opened epoch: the only one whose members hold partitions
    holders: frozenset[str] = frozenset()  # its members: they hold, or may take, its partitions

    # -- records ---------------------------------------------------------------------------
    def on_epoch(self, rec: dict[str, Any]) -> bool:
        """Apply an epochs record of this pool; True if it changed the current epoch."""
        if rec.get("pool") != self.pool:
            return False
        n = int(rec["epoch"])
        if rec.get("phase") == "announce" and n > self.current.epoch:
            assignment = {
                str(k): tuple((str(t), int(p)) for t, p in parts)
                for k, parts in rec["assignment"].items()
            }
            self.current = Epoch(n, assignment, tuple(rec["waits"]), str(rec["by"]))
            return True
        if (
            rec.get("phase") == "open"
            and n == self.current.epoch
            and rec.get("by") == self.current.by
            and not self.current.opened
        ):
            self.current = replace(self.current, opened=True)
            self.last_opened, self.holders = n, frozenset(self.current.assignment)
            return True
        return False

    def on_beat(self, rec: dict[str, Any], seen: float) -> None:
        if rec.get("pool") != self.pool:
            return
        key = str(rec["key"])
        old = self.beats.get(key)
        if old is None or old.seen <= seen:
            self.beats[key] = Beat(key, int(rec["epoch"]), rec["state"], seen)

    # -- liveness ----------------------------------------------------------------------------
    def live(self, now: float) -> dict[str, Beat]:
        """Members heard from within ``session_s`` that have not left."""
        return {
            k: b
            for k, b in self.beats.items()
            if b.state != "left" and now - b.seen <= self.session_s
        }

    def leader(self, now: float) -> str | None:
        live = self.live(now)
        return min(live) if live else None

    # -- the leader's decisions ------------------------------------------------------------
    def changed(self, now: float) -> bool:
        """The open epoch's members are not the live ones (a join, a leave, a death), or one
        of them dropped its share and waits for a newer epoch (it fenced itself: the chunks
        it left must be fenced by a newer epoch than theirs)."""
        if not self.current.opened:
            return False
        live = self.live(now)
        newer = any(b.state == "ready" and b.epoch > self.current.epoch for b in live.values())
        return newer or set(live) != set(self.current.assignment)

    def announcement(self, me: str, now: float, partitions: list[TopicPart]) -> dict[str, Any]:
        """The record of the next epoch: every partition to the live members; it waits for
        the live members of the newest opened epoch, whether they say they hold its
        partitions yet or not (one may be taking them as this is announced); one that says it
        holds an older epoch's is a zombie: its partitions went on without it, it is fenced."""
        live = self.live(now)
        opened = self.last_opened
        holders = [
            k
            for k, b in live.items()
            if k in self.holders and not (b.state == "member" and b.epoch < opened)
        ]
        return {
            "pool": self.pool,
            "phase": "announce",
            "epoch": self.current.epoch + 1,
            "assignment": {
                k: [list(tp) for tp in v] for k, v in assign([*live], partitions).items()
            },
            "waits": sorted(holders),
            "by": me,
        }

    def barrier(self, now: float) -> str:
        """'done' when every member the current (unopened) epoch waits for is ready for it,
        'lost' when one of them went silent (announce again without it), else 'wait'."""
        live = self.live(now)
        for key in self.current.waits:
            b = live.get(key)
            if b is None:
                return "lost"
            if not (b.state == "ready" and b.epoch >= self.current.epoch):
                return "wait"
        return "done"

    def announcer_lost(self, now: float) -> bool:
        """The current epoch is not open and its announcer went silent: announce again."""
        return not self.current.opened and self.current.by not in self.live(now)

    # -- a member's orders -----------------------------------------------------------------
    def order(self, me: str, my_epoch: int, my_state: State) -> Release | Take | None:
        """What a member must do now: release what it holds for a newer epoch (fenced when
        that epoch did not wait for it), or take its share of an open epoch."""
        cur = self.current
        if my_state == "member" and cur.epoch > my_epoch:
            return Release(cur.epoch, fenced=me not in cur.waits)
        if my_state == "ready" and cur.opened and cur.epoch >= my_epoch and me in cur.assignment:
            return Take(cur.epoch, cur.assignment[me])
        return None
