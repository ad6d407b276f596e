"""The one Kafka seam: every Kafka client srl makes, and the Kafka types it passes around.

confluent_kafka is imported in this package and nowhere else (a ruff rule, TID251, enforces
it). Roles and the app layer import from ``srl.kafka``:

* ``settings``: librdkafka settings for producers, consumers and admin clients, one place;
* ``probe``: the first contact with a broker (``wait_for_broker``), and which kind it is;
* ``producer``: ``Producer``, idempotent with counted deliveries;
* ``consumer``: ``Consumer`` (typed; ``commit_sync`` checks each partition), ``make_consumer``
  for group members, ``reader`` for assigned-only clients, ``QuietTail``, shared positions;
* ``ranges``: ``read_range``, the one "read these partitions back" loop;
* ``admin``: topics, watermarks, committed offsets and ``Lag``, the one lag computation;
* ``topiccheck``: a role's topics looked up, created where allowed, checked against the layout.

Kafka errors reach users as one line: ``describe(e)``, used by the CLI runner.
"""

from __future__ import annotations

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from srl.kafka.admin import (
    GroupState,
    Lag,
    Member,
    PartitionLag,
    PartitionReplicas,
    admin,
    committed_offsets,
    create_topics,
    describe_groups,
    lag,
    replicas,
    start_group_at,
    topic_config,
    topic_watermarks,
    watermarks,
)
from srl.kafka.consumer import (
    POSITION_SUFFIX,
    Consumer,
    QuietTail,
    commit_sync,
    make_consumer,
    position_group,
    produced_ms,
    reader,
    share_positions,
)
from srl.kafka.probe import (
    BrokerRefused,
    broker_answers,
    broker_count,
    embedded_broker,
    forgets_acknowledged,
    idle_fetches_spin,
    srl_started,
    wait_for_broker,
)
from srl.kafka.producer import DeliveryCallback, Producer, Throttle, start_over
from srl.kafka.ranges import read_range
from srl.kafka.settings import (
    SESSION_TIMEOUT_MS,
    base_settings,
    check_settings,
    client_id,
    consumer_settings,
    describe,
    for_group_protocol,
    producer_settings,
    reader_group,
    user_settings,
)
from srl.kafka.topiccheck import LayoutMismatch, ensure_topics, find_topics

__all__ = [
    "OFFSET_BEGINNING",
    "OFFSET_END",
    "POSITION_SUFFIX",
    "BrokerRefused",
    "SESSION_TIMEOUT_MS",
    "Consumer",
    "DeliveryCallback",
    "GroupState",
    "KafkaError",
    "KafkaException",
    "LayoutMismatch",
    "Lag",
    "Member",
    "Message",
    "PartitionLag",
    "PartitionReplicas",
    "Producer",
    "QuietTail",
    "Throttle",
    "TopicPartition",
    "admin",
    "base_settings",
    "broker_answers",
    "broker_count",
    "check_settings",
    "client_id",
    "commit_sync",
    "committed_offsets",
    "consumer_settings",
    "create_topics",
    "describe",
    "embedded_broker",
    "ensure_topics",
    "find_topics",
    "for_group_protocol",
    "forgets_acknowledged",
    "idle_fetches_spin",
    "describe_groups",
    "lag",
    "make_consumer",
    "position_group",
    "produced_ms",
    "producer_settings",
    "reader",
    "reader_group",
    "read_range",
    "replicas",
    "share_positions",
    "srl_started",
    "start_over",
    "start_group_at",
    "topic_config",
    "topic_watermarks",
    "user_settings",
    "wait_for_broker",
    "watermarks",
]
