"""``producers.pool``: the pure rules of pool epochs (records in, decisions out)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from producers.config import GenerateConfig
from producers.pool import PoolView, Release, Take, TopicPart, assign
from producers.pool_member import PoolMember

POOL = "p.gen.regular"
PARTS: list[TopicPart] = [("p.prompts.le256", 0), ("p.prompts.le256", 1), ("p.resume.le256", 0)]


def view(session_s: float = 6.0) -> PoolView:
    return PoolView(POOL, session_s)


def beat(key: str, epoch: int = 0, state: str = "member") -> dict[str, Any]:
    return {"pool": POOL, "key": key, "epoch": epoch, "state": state}


def announce(n: int, by: str, assignment: dict[str, list[Any]], waits: list[str]) -> dict[str, Any]:
    return {
        "pool": POOL,
        "phase": "announce",
        "epoch": n,
        "assignment": assignment,
        "waits": waits,
        "by": by,
    }


def opened(n: int, by: str) -> dict[str, Any]:
    return {"pool": POOL, "phase": "open", "epoch": n, "by": by}


@pytest.mark.parametrize(
    ("members", "expected"),
    [
        ([], {}),
        (["a"], {"a": tuple(sorted(PARTS))}),
        (
            ["b", "a"],
            {
                "a": (("p.prompts.le256", 0), ("p.resume.le256", 0)),
                "b": (("p.prompts.le256", 1),),
            },
        ),
        (["a", "b", "c", "d"], {"a": (PARTS[0],), "b": (PARTS[1],), "c": (PARTS[2],), "d": ()}),
    ],
)
def test_assign_round_robin(members: list[str], expected: dict[str, Any]) -> None:
    assert assign(members, PARTS) == expected


def test_epoch_zero_assigns_nothing_and_is_open() -> None:
    v = view()
    assert (v.current.epoch, v.current.assignment, v.current.opened) == (0, {}, True)


def test_the_first_announcement_of_an_epoch_wins_and_only_its_announcer_opens_it() -> None:
    v = view()
    assert v.on_epoch(announce(1, "a/1", {"a/1": [["t", 0]]}, []))
    assert not v.on_epoch(announce(1, "b/1", {"b/1": [["t", 0]]}, []))  # same number, later
    assert v.current.by == "a/1" and v.current.assignment == {"a/1": (("t", 0),)}
    assert not v.on_epoch(opened(1, "b/1"))  # not the announcer
    assert v.on_epoch(opened(1, "a/1")) and v.current.opened
    assert not v.on_epoch({**announce(2, "a/1", {}, []), "pool": "other"})  # another pool


@pytest.mark.parametrize(
    ("seen", "state", "live"),
    [(0.0, "member", False), (5.0, "member", True), (9.0, "ready", True), (9.0, "left", False)],
)
def test_liveness_is_a_beat_within_the_session_timeout(seen: float, state: str, live: bool) -> None:
    v = view(session_s=6.0)
    v.on_beat(beat("a/1", state=state), seen=seen)
    assert ("a/1" in v.live(now=10.0)) is live


def test_an_older_beat_never_replaces_a_newer_one() -> None:
    v = view()
    v.on_beat(beat("a/1", epoch=2), seen=5.0)
    v.on_beat(beat("a/1", epoch=1), seen=4.0)
    assert v.beats["a/1"].epoch == 2


def test_the_leader_is_the_smallest_live_key() -> None:
    v = view()
    v.on_beat(beat("a/1"), seen=0.0)  # silent by now
    v.on_beat(beat("c/1"), seen=9.0)
    v.on_beat(beat("b/1"), seen=9.0)
    assert v.leader(now=10.0) == "b/1"


def test_a_join_a_leave_and_a_death_each_change_the_pool() -> None:
    v = view(session_s=6.0)
    v.on_epoch(announce(1, "a/1", {"a/1": [], "b/1": []}, []))
    v.on_epoch(opened(1, "a/1"))
    v.on_beat(beat("a/1", 1), seen=9.0)
    v.on_beat(beat("b/1", 1), seen=9.0)
    assert not v.changed(now=10.0)
    v.on_beat(beat("c/1", 0, "ready"), seen=9.5)  # joined
    assert v.changed(now=10.0)
    v.on_beat(beat("c/1", 0, "left"), seen=9.6)  # left again
    assert not v.changed(now=10.0)
    assert v.changed(now=15.5)  # a/1 and b/1 silent for a session: dead


def test_announcement_assigns_everything_to_the_live_and_waits_for_the_holders() -> None:
    v = view()
    v.on_epoch(announce(1, "a/1", {"a/1": [], "m/1": [], "y/1": [], "z/1": []}, []))
    v.on_epoch(opened(1, "a/1"))
    v.on_beat(beat("a/1", 1, "member"), seen=9.0)
    v.on_beat(beat("b/1", 0, "ready"), seen=9.0)  # a newcomer holds nothing
    v.on_beat(beat("m/1", 1, "ready"), seen=9.0)  # of epoch 1, taking its share right now
    v.on_beat(beat("z/1", 1, "member"), seen=0.0)  # dead: neither assigned nor waited for
    v.on_beat(beat("y/1", 0, "member"), seen=9.0)  # a zombie of epoch 0: not waited for
    rec = v.announcement("a/1", now=10.0, partitions=PARTS)
    assert rec["epoch"] == 2 and rec["waits"] == ["a/1", "m/1"] and rec["by"] == "a/1"
    assert sorted(rec["assignment"]) == ["a/1", "b/1", "m/1", "y/1"]
    assert sorted(tuple(tp) for parts in rec["assignment"].values() for tp in parts) == PARTS


def test_the_barrier_waits_for_every_holder_and_is_lost_if_one_goes_silent() -> None:
    v = view(session_s=6.0)
    v.on_epoch(announce(2, "a/1", {"a/1": [], "b/1": []}, ["a/1", "b/1"]))
    v.on_beat(beat("a/1", 2, "ready"), seen=9.0)
    v.on_beat(beat("b/1", 1, "member"), seen=9.0)  # still releasing
    assert v.barrier(now=10.0) == "wait"
    v.on_beat(beat("b/1", 2, "ready"), seen=9.5)
    assert v.barrier(now=10.0) == "done"
    assert v.barrier(now=15.2) == "lost"  # a/1 silent since 9.0


def test_an_announcer_that_goes_silent_before_opening_is_replaced() -> None:
    v = view(session_s=6.0)
    v.on_epoch(announce(1, "a/1", {}, []))
    v.on_beat(beat("a/1", 1, "ready"), seen=1.0)
    assert not v.announcer_lost(now=5.0)
    assert v.announcer_lost(now=8.0)
    v.on_epoch(opened(1, "a/1"))
    assert not v.announcer_lost(now=8.0)


@pytest.mark.parametrize(
    ("waits", "is_open", "my_epoch", "my_state", "order"),
    [
        (["a/1"], False, 1, "member", Release(2, fenced=False)),  # release for the next epoch
        ([], False, 1, "member", Release(2, fenced=True)),  # it went on without us: a zombie
        (["a/1"], False, 2, "ready", None),  # released; not open yet
        (["a/1"], True, 2, "ready", Take(2, (("t", 1),))),  # open: take our share
        (["a/1"], True, 0, "ready", Take(2, (("t", 1),))),  # a newcomer
        (["a/1"], True, 2, "member", None),  # holding it already
    ],
)
def test_orders(
    waits: list[str], is_open: bool, my_epoch: int, my_state: Any, order: object
) -> None:
    v = view()
    v.on_epoch(announce(2, "b/1", {"a/1": [["t", 1]], "b/1": [["t", 0]]}, waits))
    if is_open:
        v.on_epoch(opened(2, "b/1"))
    assert v.order("a/1", my_epoch, my_state) == order


def test_a_member_left_out_of_the_assignment_waits_for_the_next_epoch() -> None:
    v = view()
    v.on_epoch(announce(1, "b/1", {"b/1": [["t", 0]]}, []))
    v.on_epoch(opened(1, "b/1"))
    assert v.order("new/1", 0, "ready") is None


def test_a_member_whose_lease_ran_out_fences_itself_and_waits_to_resync() -> None:
    cfg = GenerateConfig(engine="sim", topic_prefix="p", kafka={"session.timeout.ms": "6000"})
    m = PoolMember(cfg, ["p.prompts.le256"])  # not started: no Kafka here
    m.view.on_epoch(announce(2, m.key, {m.key: [["t", 0]]}, []))
    m.view.on_epoch(opened(2, m.key))
    m.state, m.epoch = "member", 2
    now = time.monotonic()
    m._lease_from = now - 1.0  # a beat acknowledged a second ago
    assert m.holds() and m.tick() is None
    m._lease_from = now - 7.0  # stopped for longer than the session: others may have taken over
    assert not m.holds()
    assert m.tick() == Release(3, fenced=True)  # it asks for a newer epoch than its own
    m.state, m.epoch = "ready", 3  # released (what the intake reports back)
    assert m.tick() is None  # no share again before a newer beat and a read since
    m._lease_from = time.monotonic()
    assert m.tick() is None
    m._synced_at = time.monotonic() + 1.0
    assert m.tick() is None  # nor of epoch 2 ever again: what it left there is fenced by 3
    m.view.on_beat({"pool": m.view.pool, "key": m.key, "epoch": 3, "state": "ready"}, now)
    assert m.view.changed(now)  # the leader announces epoch 3
    m.view.on_epoch(announce(3, m.key, {m.key: [["t", 0]]}, [m.key]))
    m.view.on_epoch(opened(3, m.key))
    assert m.tick() == Take(3, (("t", 0),))


def test_a_beat_after_a_silence_as_long_as_a_session_renews_no_lease() -> None:
    cfg = GenerateConfig(engine="sim", topic_prefix="p", kafka={"session.timeout.ms": "6000"})
    m = PoolMember(cfg, ["p.prompts.le256"])
    m.state, m.epoch = "member", 2
    sent: list[Any] = []
    m._producer = type("P", (), {"produce": lambda *a, **kw: sent.append(kw["on_delivery"])})()
    m._lease_from = time.monotonic() - 7.0  # SIGCONT after 7 s: the thread beats at once
    m._beat()
    sent[-1](None, None)  # acknowledged
    assert not m.holds()  # a zombie's commit waits for its fence, not for the next beat
    assert m.tick() == Release(3, fenced=True)
