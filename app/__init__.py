"""The app layer: the only code that wires roles together.

Demo, report, benchmarks, monitor, rlcheck, the demo task, warm start and every CLI live
here; they may import any role (``producers``, ``consumers``, ``ranker``) and the core
(``srl``, ``schemas``), and nothing imports them back (docs/architecture.md).
"""
