"""What every srl CLI shares besides its options: logging, error translation, JSON output.

* ``run_main(group)`` runs a click group and turns user errors into one line on stderr and a
  non-zero exit; anything else is a bug and keeps its traceback.
* The options themselves are generated from each command's config class
  (``app/cli/options.py``).

Nothing heavy is imported here, so ``--help`` answers at once.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import click


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
    from srl.secrets import Scrubber  # light: no Kafka client

    for handler in logging.getLogger().handlers:  # no secret srl has seen reaches a log line
        if not any(isinstance(f, Scrubber) for f in handler.filters):
            handler.addFilter(Scrubber())


# every command group: -h as well as --help, help text up to 100 columns
GROUP_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def run_main(group: click.Group, prog: str) -> Callable[[], None]:
    """A console-script entry point for ``group`` with srl's error translation."""

    @functools.wraps(group)
    def main() -> None:
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
        except BrokenPipeError:
            sys.exit(1)
        except Exception as e:
            sys.exit(user_error(prog, e))

    return main


def user_error(prog: str, e: Exception) -> int:
    """Print a user's error (an ``SrlError``, a ``SchemaError``, a Kafka client's error such
    as a bad ``-X`` setting) as one line and return the exit code; re-raise anything else, a
    bug, with its traceback. Imported here, not at start-up, so ``--help`` stays light."""
    from srl.errors import SchemaError, SrlError
    from srl.kafka import KafkaException, describe
    from srl.secrets import scrub

    if isinstance(e, SrlError | SchemaError):
        click.echo(f"{prog}: error: {scrub(str(e))}", err=True)
        return e.exit_code
    if isinstance(e, KafkaException):
        click.echo(f"{prog}: error: kafka: {describe(e)}", err=True)
        return 1
    raise e


def echo_json(obj: Any) -> None:
    import orjson

    click.echo(orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode())


LENGTHS_SHOWN = "StreamRL's histogram, srl/data/streamrl_output_length_hist.csv"


def default_lengths() -> str:
    """The default ``--lengths``: StreamRL's output-length histogram, shipped with srl
    (imported when asked, so that ``--help`` imports nothing of the core)."""
    from srl.data import STREAMRL_LENGTHS

    return str(STREAMRL_LENGTHS)
