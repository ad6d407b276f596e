"""srl: streaming RL post-training of LLMs over Kafka and an object store.

The shared core: config, Kafka client factory and topic layout, embedded broker, object
store, weights protocol, metrics, and the ``srl`` umbrella CLI. Roles live beside it:
``producers/`` (dispatcher, generator workers), ``consumers/`` (trainer), ``ranker/``.
"""

__version__ = "0.1.0"
