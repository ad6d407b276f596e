"""Topic naming and the bucket → partition layout."""

from __future__ import annotations

import pytest

from srl.topics import Layout


def test_names_and_buckets() -> None:
    layout = Layout("srl", (256, 1024), partitions_per_bucket=3)
    assert layout.buckets == ["le256", "le1024", "gt1024"]
    assert [layout.bucket_for(n) for n in (1, 256, 257, 1024, 5000)] == [
        "le256",
        "le256",
        "le1024",
        "le1024",
        "gt1024",
    ]
    assert layout.prompts("le1024") == "srl.prompts.le1024"
    assert (layout.trajectories, layout.weights, layout.metrics, layout.dlq) == (
        "srl.trajectories",
        "srl.weights",
        "srl.metrics",
        "srl.dlq",
    )
    with pytest.raises(ValueError, match="unknown bucket"):
        layout.prompts("huge")


def test_trajectory_partitions_are_grouped_by_bucket_and_stable() -> None:
    layout = Layout("x", (256, 1024), partitions_per_bucket=3)
    assert layout.trajectory_partition_count == 9
    assert list(layout.trajectory_partitions("le1024")) == [3, 4, 5]
    for i in range(200):
        tid = f"traj-{i}"
        for bucket in layout.buckets:
            p = layout.partition_for(bucket, tid)
            assert p in layout.trajectory_partitions(bucket)
            assert p == layout.partition_for(bucket, tid)
            assert layout.bucket_of_partition(p) == bucket
    used = {layout.partition_for("le256", f"t{i}") for i in range(100)}
    assert used == {0, 1, 2}


def test_specs_cover_every_topic_and_compact_weights() -> None:
    specs = {s.name: s for s in Layout("p").specs()}
    assert set(specs) == {
        "p.prompts.le256",
        "p.prompts.le1024",
        "p.prompts.le4096",
        "p.prompts.gt4096",
        "p.resume.le256",
        "p.resume.le1024",
        "p.resume.le4096",
        "p.resume.gt4096",
        "p.trajectories",
        "p.weights",
        "p.feedback",
        "p.metrics",
        "p.dlq",
        "p.pool.epochs",
        "p.pool.beats",
    }
    assert specs["p.weights"].config["cleanup.policy"] == "compact"
    assert specs["p.trajectories"].partitions == 8


def test_retention_bounds_the_data_topics_and_never_the_dispatchers_log() -> None:
    assert all("retention.ms" not in s.config for s in Layout("p").specs()[:-2])
    specs = {s.name: s.config for s in Layout("p", retention_ms=600_000).specs()}
    for topic in ("p.trajectories", "p.resume.le256", "p.metrics", "p.feedback", "p.dlq"):
        assert specs[topic]["retention.ms"] == "600000"
        assert specs[topic]["segment.ms"] == "150000"  # deleted by whole segments
    assert specs["p.trajectories"]["max.message.bytes"] == "1048576"
    for topic in ("p.prompts.le256", "p.prompts.gt4096", "p.weights", "p.pool.epochs"):
        assert specs[topic].get("retention.ms") in (None, "-1")
    assert specs["p.pool.beats"] == {"retention.ms": "600000", "segment.ms": "600000"}
