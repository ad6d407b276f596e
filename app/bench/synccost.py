"""What a real-size weights version costs the simulated pipeline: publish, fetch, verify, load.

``srl bench pipeline --model-bytes N --sync-rates SPEC``: a version of ``N`` bytes (default the
workload's 7B policy in bf16, :data:`MODEL_BYTES`) is charged at four rates, in bytes per
second of real time, which the pipeline counts as simulated seconds (the rates are a real
machine's):

* ``publish``: the trainer's upload (files, sha256, fsync'd puts, manifest; the announcement
  follows), in its background thread: the step does not wait for it, the next publish does;
* ``fetch`` and ``verify``: a generator's follower reads the files and checks every sha256, in
  its own thread (off the decode loop);
* ``load``: the generator's swap (``engine.load_weights``): decoding stops for it.

``SPEC`` is ``measure`` (``srl bench weights`` on this machine at one size, once per command:
publish, fetch + verify and load timed as that bench does, verify split out by a sha256 pass
over the same bytes) or ``publish=G,fetch=G,verify=G,load=G`` in GB/s (any left out: not
charged). ``colocated`` is charged ``load`` only: its weights stay on the devices that trained
them (verl reshards in memory), nothing goes through the store. Called by ``app.bench.cli``
and ``app.bench.pipeline`` (``Workload.sync``: what each mode is charged).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.bench.weights import SIZES, bench_size
from srl.errors import ConfigError

PARAMS_7B = 7.6e9  # the workload's 7B policy (Qwen2.5-7B: 7.6e9 parameters)
MODEL_BYTES = int(PARAMS_7B * 2)  # bf16: 15.2e9 bytes
PARTS = ("publish", "fetch", "verify", "load")
MEASURE_SIZE = "100M"  # the weights bench's size measured for --sync-rates measure


@dataclass(frozen=True)
class SyncRates:
    """Bytes per second of each part (0: not charged), and where they came from."""

    publish: float = 0.0
    fetch: float = 0.0
    verify: float = 0.0
    load: float = 0.0
    source: str = "given"

    def seconds(self, model_bytes: float) -> dict[str, float]:
        """Each part's seconds for a version of ``model_bytes`` (simulated seconds)."""
        return {p: (model_bytes / r if r > 0 else 0.0) for p in PARTS for r in [getattr(self, p)]}


def parse_rates(spec: str) -> SyncRates | None:
    """``publish=G,fetch=G,verify=G,load=G`` (GB/s) as rates; ``measure``: None (measure)."""
    if spec.strip() == "measure":
        return None
    rates: dict[str, float] = {}
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        name, _, value = item.partition("=")
        if name not in PARTS or name in rates:
            raise ConfigError(f"--sync-rates {spec!r}: parts are {', '.join(PARTS)}, each once")
        try:
            gbps = float(value)
        except ValueError:
            gbps = -1.0
        if gbps <= 0:
            raise ConfigError(f"--sync-rates {spec!r}: {name} needs a rate in GB/s above 0")
        rates[name] = gbps * 1e9
    if not rates:
        raise ConfigError(f"--sync-rates {spec!r}: 'measure' or publish=G,fetch=G,verify=G,load=G")
    return SyncRates(
        publish=rates.get("publish", 0.0),
        fetch=rates.get("fetch", 0.0),
        verify=rates.get("verify", 0.0),
        load=rates.get("load", 0.0),
    )


def sha256_rate(nbytes: int = 256 << 20) -> float:
    """Bytes per second of one sha256 stream over ``nbytes`` in memory (the verify pass)."""
    data = bytes(nbytes)
    t0 = time.perf_counter()
    hashlib.sha256(data).digest()
    return nbytes / (time.perf_counter() - t0)


def measure_rates(size: str = MEASURE_SIZE) -> SyncRates:
    """The four rates on this machine: ``app.bench.weights.bench_size`` at ``size``
    (publish, fetch + verify, load), verify split out by :func:`sha256_rate`."""

    work = Path(tempfile.mkdtemp(prefix="srl-bench-syncrates-"))
    try:
        row = bench_size(size, SIZES[size], work, repeats=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rates_from_row(row, sha256_rate(), f"measured: srl bench weights --sizes {size}")


def rates_from_row(row: dict[str, Any], verify_rate: float, source: str) -> SyncRates:
    """Rates from one ``srl bench weights`` size row; its fetch + verify time split into a
    verify pass at ``verify_rate`` and the rest (at least a tenth) as fetch."""
    nbytes = float(row["bytes"])
    fv = float(row["fetch_verify_s"])
    verify_s = min(nbytes / verify_rate, 0.9 * fv)
    return SyncRates(
        publish=nbytes / float(row["publish_s"]),
        fetch=nbytes / (fv - verify_s),
        verify=nbytes / verify_s,
        load=nbytes / float(row["load_s"]),
        source=source,
    )


def settings(model_bytes: float, rates: SyncRates) -> dict[str, Any]:
    """The setting as the JSON carries it: bytes, rates in GB/s, seconds per part."""
    r = asdict(rates)
    return {
        "model_bytes": int(model_bytes),
        "rates_gb_per_s": {p: round(r[p] / 1e9, 4) for p in PARTS},
        "rates_source": rates.source,
        "seconds_per_version": {p: round(v, 3) for p, v in rates.seconds(model_bytes).items()},
        "colocated": "load only (weights stay on the devices that trained them)",
    }
