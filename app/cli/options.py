"""Command-line options generated from the config classes: the model is the CLI.

Owns how a config class (:class:`srl.config.Settings`) becomes click options and how the given
options become that config. ``@with_config("module:Class")`` on a command of a
:class:`ConfigGroup` gives it ``--config FILE`` and, for each field of the class:

* an option ``--field-name`` (underscores become dashes), plus the spellings the field's
  ``json_schema_extra`` adds (``--bootstrap`` for ``bootstrap_servers``, ``-X`` for ``kafka``);
* its type from the annotation: int, float, str; ``Literal`` → a choice; ``bool`` →
  ``--x/--no-x``; a tuple → one comma-separated value; ``kafka`` → repeatable ``-X key=value``;
* ``default=None``, so an option not given leaves the file and ``SRL_*`` values in force
  (precedence is :func:`srl.config.load_config`'s); the help is the field's description,
  its default and its variable.

The command is then called with the validated config as its first argument, ``cfg``, and its
own (non-config) options as keyword arguments. What must hold: a command's options are
exactly its config's fields plus what it declares by hand (``tests/unit/test_cli_options.py``).

The options are made when the command is first parsed or its help shown
(:class:`ConfigCommand`), and the config class is named by a string: so a group's ``--help``
imports neither pydantic nor any config module, and a command's imports only its own config.
Used by every command module.
"""

from __future__ import annotations

import functools
import importlib
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import click

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

    from srl.config import Settings

F = Callable[..., Any]
CONFIG_ATTR = "srl_config"  # "module:Class" of a command callback's config


def config_class(spec: str) -> type[Settings]:
    """The class ``"module:Class"`` names."""
    module, _, name = spec.partition(":")
    cls: type[Settings] = getattr(importlib.import_module(module), name)
    return cls


def config_of(cmd: click.Command) -> type[Settings] | None:
    """The config class of a command made with :func:`with_config`; None for the others."""
    spec = getattr(cmd.callback, CONFIG_ATTR, None)
    return None if spec is None else config_class(spec)


def ordered_fields(cls: type[Settings]) -> list[str]:
    """``cls``'s fields in help order: its own (most derived class first), then the shared
    groups in :data:`srl.config.GROUPS` order."""
    from srl.config import GROUPS, Settings

    shared = [n for g in GROUPS for n in vars(g).get("__annotations__", {}) if n in g.model_fields]
    own: dict[str, None] = {}
    for klass in cls.__mro__:
        if klass in GROUPS or not issubclass(klass, Settings):
            continue
        own |= {n: None for n in vars(klass).get("__annotations__", {}) if n in cls.model_fields}
    order = [n for n in own if n not in shared] + [n for n in shared if n in cls.model_fields]
    return order


def option_names(name: str, field: FieldInfo) -> list[str]:
    """Every spelling of field ``name``: its aliases, then ``--field-name``."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    aliases = [str(a) for a in typing.cast(list[Any], extra.get("aliases", []))]
    return [*aliases, "--" + name.replace("_", "-")]


def _metavar(field: FieldInfo, kind: str) -> str | None:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if "metavar" in extra:
        return str(extra["metavar"])
    if kind == "seq":
        items = typing.get_args(_unoptional(field.annotation))
        return "N,N…" if items and items[0] is int else "NAME,NAME…"
    return None


def _unoptional(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return (
        args[0] if typing.get_origin(annotation) is not Literal and len(args) == 1 else annotation
    )


def _click_type(annotation: Any) -> click.ParamType:
    t = _unoptional(annotation)
    if typing.get_origin(t) is Literal:
        return click.Choice([str(v) for v in typing.get_args(t)])
    if t is int:
        return click.INT
    return click.FLOAT if t is float else click.STRING


def _shown(value: Any) -> str | None:
    """A default as a user types it; None where there is nothing to show."""
    if value is None or value in ((), {}, ""):
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def help_text(cls: type[Settings], name: str) -> str:
    """The field's description, then its default and its environment variable."""
    from srl.config import default_of

    field = cls.model_fields[name]
    shown = _shown(default_of(cls, name))
    facts = ([f"default: {shown}"] if shown is not None else []) + [f"env: SRL_{name.upper()}"]
    return f"{field.description or ''} [{'; '.join(facts)}]".strip()


def field_option(cls: type[Settings], name: str) -> click.Option:
    """The click option of field ``name`` of ``cls`` (its value None when not given)."""
    from srl.config import field_kind

    field = cls.model_fields[name]
    kind = field_kind(field.annotation)
    names, text = option_names(name, field), help_text(cls, name)
    if kind == "flag":
        flag = names[-1]
        return click.Option([f"{flag}/--no-{flag[2:]}", name], default=None, help=text)
    return click.Option(
        [*names, name],
        type=None if kind in ("seq", "map") else _click_type(field.annotation),
        multiple=kind == "map",
        default=None,
        metavar=_metavar(field, kind),
        help=text,
    )


def cli_values(cls: type[Settings], given: dict[str, Any]) -> dict[str, Any]:
    """Option values → ``load_config``'s ``cli`` dict: lists split, ``-X`` parsed, not given
    (None, no ``-X``) left out."""
    from srl.config import field_kind, parse_kv, parse_seq

    out: dict[str, Any] = {}
    for name, value in given.items():
        kind = field_kind(cls.model_fields[name].annotation)
        if value is None or (kind == "map" and not value):
            continue
        out[name] = (
            parse_kv(list(value)) if kind == "map" else parse_seq(value) if kind == "seq" else value
        )
    return out


def load(cls: type[Settings], file: str | None, given: dict[str, Any]) -> Any:
    """The config from the options given (precedence: :func:`srl.config.load_config`); its
    librdkafka settings (``-X``) checked, so a bad one fails before the command's work."""
    from srl.config import KafkaSettings, RegistrySettings, load_config

    cfg = load_config(cls, file=file, cli=cli_values(cls, given))
    if isinstance(cfg, KafkaSettings):
        from srl.kafka import check_settings

        check_settings(cfg)
    if isinstance(cfg, RegistrySettings):
        from srl.codecs import use_schema_registry

        use_schema_registry(cfg)  # records use Confluent framing from here on, if configured
    return cfg


def config_file_option(cls: type[Settings]) -> click.Option:
    table = f", then its [{cls.section}] table over them" if cls.section else ""
    return click.Option(
        ["--config", "config"],
        type=click.Path(dir_okay=False),
        default=None,
        metavar="FILE",
        help=f"TOML config file: top-level keys{table}. [env: SRL_CONFIG]",
    )


def config_options(cls: type[Settings]) -> list[click.Option]:
    """``--config`` and one option per field, in help order."""
    return [config_file_option(cls), *(field_option(cls, n) for n in ordered_fields(cls))]


def with_config(spec: str) -> Callable[[F], F]:
    """Decorator: the command (of a :class:`ConfigGroup`) gets ``--config`` and an option per
    field of the class ``spec`` ("module:Class") names, and is called as
    ``f(cfg, **own_options)`` with the validated config."""

    def decorate(f: F) -> F:
        @functools.wraps(f)
        def command(**kw: Any) -> Any:
            cls = config_class(spec)
            file = kw.pop("config")
            cfg = load(cls, file, {name: kw.pop(name) for name in cls.model_fields})
            return f(cfg, **kw)

        setattr(command, CONFIG_ATTR, spec)
        return command

    return decorate


class ConfigCommand(click.Command):
    """A command whose config options are made on first use: its parse or its help."""

    config_added = False

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        cls = None if self.config_added else config_of(self)
        if cls is not None:
            clash = {p.name for p in self.params} & {*cls.model_fields, "config"}
            assert not clash, f"{self.name}: hand-written options {clash} shadow config fields"
            self.params = [*config_options(cls), *self.params]
        self.config_added = True
        return super().get_params(ctx)


class ConfigGroup(click.Group):
    """A group whose commands are :class:`ConfigCommand` s and whose subgroups are its kind."""

    command_class = ConfigCommand
    group_class = type
