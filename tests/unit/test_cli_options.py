"""Config is the CLI: every command's options are generated from its config class, and that
class holds exactly what the command reads.

For every command of ``srl`` (ranker and bench included), ``srl-producer`` and
``srl-consumer``:

* its ``--help`` lists exactly the options of its config class (each field as
  ``--field-name`` plus its aliases, and ``--config``) and the non-config options it declares
  by hand (:data:`OWN`, checked here so that a setting cannot sneak in as a hand-written option);
* every field of its config class is read (``.field``, or through a property or method of the
  class that reads it) by code the command can reach: its body, and the functions and classes
  of its imports' closure (grimp) that it uses by name, transitively. Reads inside the config
  classes themselves (validators) do not count; the registry URL counts where records are
  encoded or decoded (the loader hands it to that codec). Names are matched, not types, so the
  check is loose for common attribute names (``.run``, ``.model``);
* the other direction, that no command's code reads a field its config lacks, is mypy's: the
  functions a command calls are annotated with the narrow groups of ``srl.config``
  (``KafkaSettings``, ``StoreSettings`` …) or the command's class, so reading a field the
  class does not have is a type error in ``make test``.

Together: each config field appears in exactly the commands that read it. Also here: the
adapter's type mapping (a table), and precedence through a real command.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import click
import grimp
import pytest
from click.testing import CliRunner

from app.cli import consumer, main, producer
from app.cli.options import ConfigCommand, cli_values, config_of, field_option, with_config
from srl.config import CommonConfig, Settings, TopicsConfig
from srl.errors import ConfigError
from tests.conftest import ROOT

PACKAGES = ("schemas", "srl", "producers", "consumers", "ranker", "app")
ROOTS = {"srl": main.cli, "srl-producer": producer.cli, "srl-consumer": consumer.cli}

# The options each command declares by hand: not settings (sizes of a benchmark, output
# format, what to do), so they are neither in a config file nor in SRL_* variables.
OWN: dict[str, set[str]] = {
    "srl bench dataplane": {
        "--trajectories",
        "--mean-tokens",
        "--chunk-tokens",
        "--batch",
        "--pace",
        "--repeats",
        "--paced-seconds",
        "--warmup-seconds",
        "--broker",
        "--json",
    },
    "srl bench idle": {"--partitions", "--records", "--bursts", "--seconds", "--broker", "--json"},
    "srl bench intake": {
        "--trajectories",
        "--tokens",
        "--chunk-tokens",
        "--reward-ms",
        "--reward-workers",  # the bench's own processes, not the trainer's setting
        "--json",
    },
    "srl bench pipeline": {
        "--lengths",
        "--scale",
        "--devices",
        "--instances",
        "--b-max",
        "--groups",
        "--group-size",
        "--iterations",
        "--compression",  # time compression of the simulation, not Kafka's
        "--max-staleness",
        "--modes",
        "--design",
        "--model-bytes",
        "--sync-rates",
        "--plot",
        "--bootstrap",  # handed to the simulated roles' configs, which the bench builds itself
        "--broker",
        "--json",
    },
    "srl bench serve": {
        "--max-tokens",
        "--requests",
        "--concurrency",
        "--repeats",
        "--control",
        "--broker",
        "--json",
    },
    "srl bench trainer": {
        "--backends",
        "--ranks",
        "--steps",
        "--rows",
        "--budget",
        "--spec",
        "--json",
    },
    "srl bench weights": {"--sizes", "--repeats", "--swaps", "--work-dir", "--json"},
    "srl broker fetch": {"--version"},
    "srl broker start": {"--engine", "--nodes", "--port", "--kafka-home", "--data-dir"},
    "srl broker status": {"--data-dir", "--json"},
    "srl broker stop": {"--data-dir"},
    "srl broker tool": {"--kafka-home"},
    "srl chaos": {"--json", "--soak"},
    "srl demo": {"--json"},
    "srl eval": {"--json", "--out", "--per-prompt"},
    "srl init-model": {"--out", "--seed", "--steps", "--force"},
    "srl ranker eval": {"--version", "--demo", "--seed", "--pairs-out", "--json"},
    "srl ranker plan": {"--instances", "--b-max", "--batch", "--alpha", "--always-split", "--json"},
    "srl ranker simulate": {
        "--lengths",
        "--scale",
        "--pairs",
        "--instances",
        "--b-max",
        "--batch",
        "--alpha",
        "--iterations",
        "--seed",
        "--always-split",
        "--migrate-factor",
        "--json",
    },
    "srl ranker train": {"--demo", "--online", "--max-versions", "--idle-timeout", "--seed"},
    "srl serve": set(),
    "srl smoke": {"--trajectories"},
    "srl store init": set(),
    "srl top": {
        "--once",
        "--json",
        "--prometheus",
        "--listen",
        "--interval",
        "--window",
        "--stall-after",
    },
    "srl topics check": {"--json"},
    "srl topics create": set(),
    "srl topics describe": {"--json"},
    "srl topics plan": {"--format", "--strimzi-cluster", "--principal", "--pools"},
    # what-ifs of a memory plan, not settings of a running trainer
    "srl-consumer plan": {
        "--model",
        "--ranks",
        "--gpu-memory",
        "--dtype",
        "--backend",
        "--activation-checkpointing",
        "--micro-batch-tokens",
        "--kl-coef",
        "--json",
    },
    "srl-consumer train": {"--json"},
    "srl-producer bench": {"--requests", "--max-new-tokens", "--repeats", "--swaps", "--json"},
    "srl-producer dispatch": {"--unpaced", "--json"},
    "srl-producer generate": {"--json"},
}


def commands() -> Iterator[tuple[str, click.Command, tuple[click.Group, list[str]]]]:
    """(name, command, (root group, argv to the command)) for every leaf command."""

    def walk(group: click.Group, path: list[str]) -> Iterator[tuple[list[str], click.Command]]:
        for name, cmd in sorted(group.commands.items()):
            if isinstance(cmd, click.Group):
                yield from walk(cmd, [*path, name])
            else:
                yield [*path, name], cmd

    for script, group in ROOTS.items():
        for path, cmd in walk(group, []):
            yield " ".join([script, *path]), cmd, (group, path)


ALL = list(commands())


def config_commands() -> list[tuple[str, click.Command, type[Settings]]]:
    return [(n, c, cls) for n, c, _ in ALL if (cls := config_of(c)) is not None]


def expected_options(cls: type[Settings]) -> set[str]:
    """The spec of the adapter: ``--field-name`` and the field's aliases; ``--no-x`` for flags."""
    out = {"--config"}
    for name, field in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        out |= {flag, *extra.get("aliases", [])}  # type: ignore[arg-type]
        if field.annotation is bool:
            out.add("--no-" + flag[2:])
    return out


def help_options(group: click.Group, path: list[str]) -> set[str]:
    """Every option spelling in the Options section of the rendered ``--help``."""
    out = CliRunner().invoke(group, [*path, "--help"], terminal_width=200)
    assert out.exit_code == 0, out.output
    section = out.output.split("Options:", 1)[1]
    found = set()
    for line in section.splitlines():
        head = re.split(r"\s{2,}", line.strip())[0]
        for part in re.split(r", | / ", head):
            if part.startswith("-"):
                found.add(part.split(" ")[0])
    return found - {"-h", "--help"}


def test_every_command_is_accounted_for() -> None:
    assert sorted(OWN) == sorted(name for name, _, _ in ALL)


@pytest.mark.parametrize(("name", "cmd", "where"), ALL, ids=[n for n, _, _ in ALL])
def test_help_lists_exactly_the_config_fields_and_the_own_options(
    name: str, cmd: click.Command, where: tuple[click.Group, list[str]]
) -> None:
    cls = config_of(cmd)
    expected = (expected_options(cls) if cls is not None else set()) | OWN[name]
    assert help_options(*where) == expected


# -- what each command reads ------------------------------------------------------------------
@cache
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def settings_classes() -> set[type[Settings]]:
    out: set[type[Settings]] = set()
    todo: list[type[Settings]] = [Settings]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.add(sub)
                todo.append(sub)
    return out


@cache
def tree(module: str) -> ast.Module:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    return ast.parse(Path(spec.origin).read_text())


def names_used(node: ast.AST) -> tuple[set[str], set[str]]:
    """(names read as ``x.name``, names read bare) under ``node``."""
    attrs = {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
    }
    bare = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return attrs, bare


Defs = dict[str, tuple[set[str], set[str]]]


@cache
def module_parts(module: str) -> tuple[set[str], set[str], Defs]:
    """A module's module-level attribute reads and bare names, and the same per top-level
    function or class; the config classes themselves are left out (their members are
    followed by :func:`through_members`)."""
    config_classes = {c.__name__ for c in settings_classes() if c.__module__ == module}
    reads: set[str] = set()
    bare: set[str] = set()
    defs: Defs = {}
    for stmt in tree(module).body:
        if isinstance(stmt, ast.ClassDef) and stmt.name in config_classes:
            continue
        r, b = names_used(stmt)
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defs[stmt.name] = (r, b)
        else:
            reads, bare = reads | r, bare | b
    return reads, bare, defs


def imported_modules(fn: ast.AST, module: str) -> set[str]:
    """Project modules imported inside ``fn``, and those of the module-level imports it uses."""
    modules = set(graph().modules)
    found: set[str] = set()

    def add(base: str, name: str) -> None:
        found.add(f"{base}.{name}" if f"{base}.{name}" in modules else base)

    used = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    for node in [*ast.walk(fn), *tree(module).body]:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if node in tree(module).body and (alias.asname or alias.name) not in used:
                    continue
                add(node.module, alias.name)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in modules}


def reads_of(cmd: click.Command) -> set[str]:
    """Attribute names read by the command's body and by the code it can reach: the functions
    and classes, in the import closure of what it imports, whose names it (transitively) uses."""
    fn = inspect.unwrap(cmd.callback)  # type: ignore[arg-type]
    body = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    start = imported_modules(body, fn.__module__) | {"app.cli.options"}  # options load the config
    reach = set(start)
    for m in start:
        reach |= graph().find_upstream_modules(m)
    reads, bare = names_used(body)
    defs: list[tuple[str, set[str], set[str]]] = []
    for m in sorted(reach):
        r, b, d = module_parts(m)
        reads, bare = reads | r, bare | b
        defs += [(name, dr, db) for name, (dr, db) in d.items()]
    live: set[int] = set()
    grew = True
    while grew:  # a function or class counts once something that counts names it
        grew = False
        for i, (name, dr, db) in enumerate(defs):
            if i not in live and name in reads | bare:
                live.add(i)
                reads, bare, grew = reads | dr, bare | db, True
    if not bare & {"encode", "decode", "decode_as"}:
        # the loader reads the registry URL of every command that has it, to set the codec of
        # schemas.records' encode/decode: it is used only where those are called
        reads.discard("schema_registry_url")
    return reads


def through_members(cls: type[Settings], reads: set[str]) -> set[str]:
    """Fields read through the class's own properties and methods that the code reads."""
    members: dict[str, set[str]] = {}
    for klass in cls.__mro__:
        if not (isinstance(klass, type) and issubclass(klass, Settings)):
            continue
        node = next(
            n
            for n in ast.walk(tree(klass.__module__))
            if isinstance(n, ast.ClassDef) and n.name == klass.__name__
        )
        for fn in node.body:
            validator = isinstance(fn, ast.FunctionDef) and any(
                "validator" in ast.unparse(d) for d in fn.decorator_list
            )
            if isinstance(fn, ast.FunctionDef) and not validator:
                members[fn.name] = {
                    n.attr
                    for n in ast.walk(fn)
                    if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "self"
                }
    out = set(reads)
    grew = True
    while grew:
        new = set().union(*(members[m] for m in members if m in out))
        grew = not new <= out
        out |= new
    return out


@pytest.mark.parametrize(
    ("name", "cmd", "cls"), config_commands(), ids=[n for n, _, _ in config_commands()]
)
def test_every_field_of_a_command_is_read_by_code_it_reaches(
    name: str, cmd: click.Command, cls: type[Settings]
) -> None:
    reads = through_members(cls, reads_of(cmd))
    unread = sorted(set(cls.model_fields) - reads)
    assert not unread, f"{name} offers settings it never reads: {unread}"


def test_every_field_of_a_command_class_is_some_commands_setting() -> None:
    """No dead settings: every field of the shared groups and of every command's class is an
    option of at least one command (a field no command reads would be caught above)."""
    offered = {f for _, _, cls in config_commands() for f in cls.model_fields}
    assert set(CommonConfig.model_fields) <= offered
    for _, _, cls in config_commands():
        for base in cls.__mro__:
            if isinstance(base, type) and issubclass(base, Settings):
                assert set(base.model_fields) <= offered, base


def test_read_only_commands_offer_no_producer_or_training_settings() -> None:
    """The cases named in the issue: the broker reads no Kafka settings, topics no store,
    ranker eval no training options, the commands that write nothing no producer tuning."""
    by_name = {n: set(cls.model_fields) for n, _, cls in config_commands()}
    assert all(config_of(c) is None for n, c, _ in ALL if n.startswith("srl broker"))
    assert not by_name["srl topics create"] & {"store", "run", "compression", "linger_ms"}
    assert by_name["srl ranker eval"] == by_name["srl ranker plan"]
    assert not by_name["srl ranker eval"] & {"window", "epochs", "hidden", "bootstrap_servers"}
    assert not by_name["srl top"] & {"compression", "linger_ms"}
    assert by_name["srl store init"] == {
        "store",
        "s3_endpoint_url",
        "s3_region",
        "s3_profile",
        "s3_addressing_style",
        "s3_create_only",
        "connect_timeout_s",
    }


# -- the adapter ---------------------------------------------------------------------------------
class Sample(Settings):
    section = "sample"
    count: int = 3
    ratio: float | None = None
    mode: str = "a"
    pick: Any = None
    flag: bool = False
    sizes: tuple[int, ...] = (1, 2)
    names: tuple[str, ...] = ()
    kafka: dict[str, str] = {}


@pytest.mark.parametrize(
    ("field", "opts", "type_name", "multiple", "is_flag"),
    [
        ("count", ["--count"], "integer", False, False),
        ("ratio", ["--ratio"], "float", False, False),
        ("mode", ["--mode"], "text", False, False),
        ("flag", ["--flag"], "boolean", False, True),
        ("sizes", ["--sizes"], "text", False, False),
        ("kafka", ["--kafka"], "text", True, False),
    ],
)
def test_field_types_become_click_types(
    field: str, opts: list[str], type_name: str, multiple: bool, is_flag: bool
) -> None:
    param = field_option(Sample, field)
    assert (param.opts, param.type.name, param.multiple, param.is_flag) == (
        opts,
        type_name,
        multiple,
        is_flag,
    )
    assert param.default is None  # not given: the file and SRL_* values stay in force
    assert f"env: SRL_{field.upper()}" in (param.help or "")


def test_literals_become_choices_and_aliases_come_first() -> None:
    from producers.config import GenerateConfig

    engine = field_option(GenerateConfig, "engine")
    scale = field_option(GenerateConfig, "length_scale")
    kafka = field_option(CommonConfig, "kafka")
    assert isinstance(engine.type, click.Choice) and list(engine.type.choices) == [
        "hf",
        "sim",
        "vllm",
    ]
    assert scale.opts == ["--scale", "--length-scale"] and kafka.opts == ["-X", "--kafka"]


@pytest.mark.parametrize(
    ("given", "cli"),
    [
        ({"count": None, "flag": None, "kafka": ()}, {}),
        ({"count": 5, "flag": False}, {"count": 5, "flag": False}),
        ({"sizes": "4, 8,", "names": ""}, {"sizes": ["4", "8"], "names": []}),
        ({"kafka": ("a=1", "b = 2")}, {"kafka": {"a": "1", "b": "2"}}),
    ],
)
def test_option_values_become_load_config_values(given: dict, cli: dict) -> None:
    assert cli_values(Sample, given) == cli


def test_a_bad_x_setting_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="key=value"):
        cli_values(Sample, {"kafka": ("novalue",)})


def test_precedence_through_a_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """defaults < file (top level, then the table) < SRL_* < options, through ``with_config``."""
    for k in [k for k in __import__("os").environ if k.startswith("SRL_")]:
        monkeypatch.delenv(k)
    seen: list[TopicsConfig] = []

    @click.command(cls=ConfigCommand)
    @with_config("srl.config:TopicsConfig")
    @click.option("--json", "as_json", is_flag=True)
    def cmd(cfg: TopicsConfig, as_json: bool) -> None:
        seen.append(cfg)

    f = tmp_path / "srl.toml"
    f.write_text(
        'topic_prefix = "file"\nprompt_partitions = 3\nrun = "ignored"\n'
        '[kafka]\n"client.rack" = "r1"\n'  # real librdkafka settings: a command checks them
    )
    monkeypatch.setenv("SRL_PROMPT_PARTITIONS", "4")
    monkeypatch.setenv("SRL_LINGER_MS", "-1")  # not a setting of this command: not read
    args = [
        "--config",
        str(f),
        "--bootstrap",
        "h:1",
        "-X",
        "acks=all",
        "--json",
    ]
    out = CliRunner().invoke(cmd, args)
    assert out.exit_code == 0, out.output
    (cfg,) = seen
    assert (cfg.bootstrap_servers, cfg.topic_prefix, cfg.prompt_partitions) == ("h:1", "file", 4)
    assert cfg.kafka == {"client.rack": "r1", "acks": "all"}
    assert cfg.partitions_per_bucket == 2
    assert cfg.model_fields_set == {
        "bootstrap_servers",
        "topic_prefix",
        "prompt_partitions",
        "kafka",
    }


def test_a_hand_written_option_may_not_shadow_a_setting() -> None:
    @click.command(cls=ConfigCommand)
    @with_config("srl.config:TopicsConfig")
    @click.option("--topic-prefix")
    def cmd(cfg: TopicsConfig, topic_prefix: str) -> None: ...

    out = CliRunner().invoke(cmd, ["--help"])
    assert isinstance(out.exception, AssertionError) and "shadow" in str(out.exception)


def test_the_configuration_doc_is_generated_from_the_config_classes() -> None:
    from app.cli.configdoc import DOC, rewrite

    text = DOC.read_text()
    assert rewrite(text) == text, "docs/configuration.md is stale: python -m app.cli.configdoc"


def test_a_group_help_imports_no_config_class() -> None:
    """``srl --help`` stays instant: the options of a command are made on its first use, so a
    group's help imports neither pydantic nor a config module (nor torch)."""
    code = (
        "import sys; from click.testing import CliRunner; from app.cli import main, producer, "
        "consumer\nfor g in (main.cli, producer.cli, consumer.cli): "
        "assert CliRunner().invoke(g, ['--help']).exit_code == 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('pydantic', 'torch', 'srl', 'producers', 'consumers') or m.endswith('.config')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_no_command_help_imports_torch_or_a_client() -> None:
    """Every command's ``--help`` (which builds its options from its config class) imports no
    torch, transformers, Kafka or S3 client: those load inside the command when it runs."""
    code = (
        "import sys; from click.testing import CliRunner\n"
        "from tests.unit.test_cli_options import ALL\n"
        "for _, _, (group, path) in ALL: "
        "assert CliRunner().invoke(group, [*path, '--help']).exit_code == 0\n"
        "print(sorted(m for m in ('torch', 'transformers', 'confluent_kafka', 'boto3', "
        "'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout
