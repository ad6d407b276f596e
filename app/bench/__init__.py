"""``srl bench``: the benchmarks behind docs/benchmarks.md (data plane, weights, pipeline).

Each submodule owns one benchmark and returns a plain dict (the ``--json`` output); the CLI
in ``app.bench.cli`` prints it. Benchmarks measure; tests only check their shape.
"""
