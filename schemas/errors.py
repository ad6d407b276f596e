"""The one error the schemas package raises (it imports nothing of the project).

``srl.errors`` re-exports it, and the CLIs print it as one line like any ``SrlError``.
"""

from __future__ import annotations


class SchemaError(ValueError):
    """A record could not be encoded or decoded. The message is one line."""

    exit_code = 1
