"""The ranker's named interface: what other roles (the dispatcher, the generator's migration)
may use. Everything else in ``ranker/`` is internal; the import contract in pyproject.toml
allows ``producers`` to import this module and nothing else of the ranker.
"""

from __future__ import annotations

from ranker.dispatch import RankerPredictor, assign_buckets
from ranker.migrate import MigrationPolicy, Migrator, Running, migration_task
from ranker.predictor import BaselinePredictor, LengthPredictor, OraclePredictor

__all__ = [
    "BaselinePredictor",
    "LengthPredictor",
    "MigrationPolicy",
    "Migrator",
    "OraclePredictor",
    "RankerPredictor",
    "Running",
    "assign_buckets",
    "migration_task",
]
