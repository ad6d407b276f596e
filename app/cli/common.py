"""What every srl CLI shares: the common options, config loading and error translation.

* ``common_options`` adds ``--config``, ``--bootstrap``, ``--topic-prefix``, ``--run``,
  ``--store`` and ``-X key=value`` once, for every command that talks to Kafka.
* ``config_from(cls, kwargs)`` turns those options (plus the command's own) into a validated
  config: defaults < file < ``SRL_*`` < options.
* ``run_main(group)`` runs a click group and turns user errors into one line on stderr and a
  non-zero exit; anything else is a bug and keeps its traceback.

Nothing heavy is imported here, so ``--help`` answers at once.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from srl.config import CommonConfig

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound="CommonConfig")

# option name -> config key
COMMON_KEYS = {
    "config": None,
    "bootstrap": "bootstrap_servers",
    "topic_prefix": "topic_prefix",
    "run": "run",
    "store": "store",
    "kafka_setting": "kafka",
}


def common_options(f: F) -> F:
    """The options every Kafka-facing command takes, defined once."""
    options = [
        click.option(
            "--config",
            "config",
            type=click.Path(dir_okay=False),
            default=None,
            help="TOML config file (top-level keys, plus this command's table). Env: SRL_CONFIG.",
        ),
        click.option(
            "--bootstrap",
            "bootstrap",
            default=None,
            metavar="HOST:PORT",
            help="Kafka bootstrap servers. Env: SRL_BOOTSTRAP_SERVERS. Default 127.0.0.1:9092.",
        ),
        click.option(
            "--topic-prefix",
            "topic_prefix",
            default=None,
            help="Topic name prefix. Env: SRL_TOPIC_PREFIX. Default srl.",
        ),
        click.option(
            "--run", "run", default=None, help="Run name (weights namespace). Env: SRL_RUN."
        ),
        click.option(
            "--store",
            "store",
            default=None,
            metavar="URL",
            help="Object store: file://DIR or s3://bucket/prefix. Env: SRL_STORE.",
        ),
        click.option(
            "-X",
            "kafka_setting",
            multiple=True,
            metavar="KEY=VALUE",
            help="Any librdkafka setting, passed through (repeatable), as in kcat.",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def config_from(cls: type[C], kwargs: dict[str, Any], **extra: Any) -> C:
    """Build ``cls`` from the common options in ``kwargs`` plus ``extra`` CLI values."""
    from srl.config import load_config, parse_kv

    cli: dict[str, Any] = {}
    for opt, key in COMMON_KEYS.items():
        if key is None or kwargs.get(opt) in (None, ()):
            continue
        cli[key] = parse_kv(list(kwargs[opt])) if key == "kafka" else kwargs[opt]
    cli.update({k: v for k, v in extra.items() if v is not None})
    cfg = load_config(cls, file=kwargs.get("config"), cli=cli)
    if cfg.schema_registry_url:  # records use Confluent framing from here on
        from schemas.codec import Codec
        from schemas.records import set_default_codec
        from schemas.registry import HttpRegistry

        set_default_codec(Codec(registry=HttpRegistry(cfg.schema_registry_url)))
    return cfg


def setup_logging(verbose: int = 0) -> None:
    level = (
        logging.DEBUG
        if verbose > 1
        else logging.INFO
        if verbose or os.environ.get("SRL_VERBOSE")
        else logging.WARNING
    )
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    logging.getLogger("srl").setLevel(min(level, logging.INFO))


def run_main(group: click.Group, prog: str) -> Callable[[], None]:
    """A console-script entry point for ``group`` with srl's error translation."""

    @functools.wraps(group)
    def main() -> None:
        from srl.errors import SchemaError, SrlError
        from srl.kafka import KafkaException, describe

        try:
            rc = group.main(prog_name=prog, standalone_mode=False)
            sys.exit(rc if isinstance(rc, int) else 0)  # click returns Exit codes here
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except (click.exceptions.Abort, KeyboardInterrupt):
            click.echo(f"{prog}: interrupted", err=True)
            sys.exit(130)
        except (SrlError, SchemaError) as e:
            click.echo(f"{prog}: error: {e}", err=True)
            sys.exit(e.exit_code)
        except KafkaException as e:  # e.g. a bad -X setting, refused by librdkafka
            click.echo(f"{prog}: error: kafka: {describe(e)}", err=True)
            sys.exit(1)
        except BrokenPipeError:
            sys.exit(1)

    return main


def echo_json(obj: Any) -> None:
    import orjson

    click.echo(orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode())
