"""The command lines: ``srl`` (main), ``srl-producer``, ``srl-consumer``, ``srl ranker``.

Each command turns its options into a config and calls one role function.
"""
