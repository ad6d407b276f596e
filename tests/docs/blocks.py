"""The shell blocks of README.md and docs/*.md, and how the suite runs them.

Every ```` ```sh ````, ```` ```bash ````, ```` ```shell ```` and ```` ```console ```` block
carries a marker: an HTML comment on the line just before its opening fence (blank lines
between are allowed). A block without one fails the suite with its file and line, so none is
forgotten.

Markers::

    <!-- doc-test: run -->                       run the block as written
    <!-- doc-test: run slow timeout=240 -->      a slow test (``make test`` runs it); seconds
    <!-- doc-test: run sub="--steps 60=>--steps 3" sub="a=>b" -->   text substituted first
    <!-- doc-test: run broker -->                SRL_BOOTSTRAP_SERVERS = the suite's broker
    <!-- doc-test: run model -->                 runs/models/strops-s0 holds a demo model
    <!-- doc-test: skip reason="needs Docker" -->  not runnable here, and why

How a runnable block runs (``tests/docs/test_doc_blocks.py``):

* in a fresh temporary folder that looks like a clone's root (a symlink to each of the
  repository's top-level tracked entries: ``deploy/``, ``docs/``, …; what the block writes,
  ``runs/`` and ``.srl/`` included, stays in the temporary folder);
* by ``bash -e`` as a real subprocess in a session of its own, with the venv's ``bin`` first on
  PATH (``srl``, ``python`` …) and no ``SRL_*`` variable of the caller;
* with a free port instead of the documented 9092: ``127.0.0.1:9092`` in the text becomes
  ``127.0.0.1:PORT``, ``SRL_BROKER_PORT`` points ``srl broker start`` at it, and in a block
  that runs ``srl broker start`` ``SRL_BOOTSTRAP_SERVERS`` points every command at it
  (``broker`` points them at the suite's broker instead, with a random topic prefix);
* ``model``: ``runs/models/strops-s0`` holds what ``srl init-model --steps 1`` builds (built
  once for the whole session; with ``sub="srl init-model=>srl init-model --steps 1"`` the
  block's own ``srl init-model`` finds it cached instead of warm-starting for ~3 minutes);
* a ``console`` block runs its ``$ `` lines, and each other non-empty line (the shown output)
  must appear in what they print;
* bounded in time (``timeout``, default 120 s); afterwards what it left running is stopped:
  its process group (by the pid of its shell), then a broker it started under ``.srl/broker``
  (``srl broker stop`` of that folder).

Pages listed in ``PENDING`` are not collected (a page being rewritten; none now): whoever
finishes one marks its blocks and removes it from the list.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# pages being rewritten: marked, then removed from this list
PENDING: set[str] = set()

SHELL_LANGS = {"sh", "bash", "shell", "console"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*doc-test:(.*?)-->\s*$")
DEFAULT_TIMEOUT_S = 120.0


@dataclass
class Block:
    """One shell block of a page, with its marker (``None`` when it has none)."""

    path: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None
    action: str = ""  # run | skip | "" (no or bad marker)
    reason: str = ""  # skip: why; unmarked: what is wrong
    slow: bool = False
    broker: bool = False
    model: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    subs: list[tuple[str, str]] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def pages(root: Path = ROOT) -> list[Path]:
    """README.md, docs/*.md and docs/recipes/*.md, less the pending pages."""
    docs = root / "docs"
    found = [root / "README.md", *sorted(docs.glob("*.md")), *sorted(docs.glob("recipes/*.md"))]
    return [p for p in found if p.relative_to(root).as_posix() not in PENDING]


def parse_marker(block: Block) -> None:
    """Fill the block's action and options from its marker; a bad one leaves action ''."""
    if block.marker is None:
        block.reason = "no <!-- doc-test: run|skip … --> marker before this block"
        return
    try:
        words = shlex.split(block.marker)
    except ValueError as e:
        block.reason = f"marker does not parse: {e}"
        return
    if not words or words[0] not in ("run", "skip"):
        block.reason = "marker must start with run or skip"
        return
    block.action = words[0]
    for word in words[1:]:
        key, _, value = word.partition("=")
        if key == "reason":
            block.reason = value
        elif key == "slow":
            block.slow = True
        elif key == "broker":
            block.broker = True
        elif key == "model":
            block.model = True
        elif key == "timeout":
            block.timeout_s = float(value)
        elif key == "sub" and "=>" in value:
            old, new = value.split("=>", 1)
            block.subs.append((old, new))
        else:
            block.action, block.reason = "", f"unknown marker word {word!r}"
            return
    if block.action == "skip" and not block.reason:
        block.action, block.reason = "", 'skip needs reason="…"'


def blocks_of(path: Path, root: Path = ROOT) -> list[Block]:
    """The shell blocks of one page, in order."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(2), m.group(3).lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if lang in SHELL_LANGS:
            indent = len(m.group(1))
            body = "\n".join(s[indent:] if s[:indent].isspace() else s for s in lines[i + 1 : end])
            j = i - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            mm = MARKER.match(lines[j]) if j >= 0 else None
            block = Block(
                path=path.relative_to(root).as_posix(),
                line=i + 1,
                lang=lang,
                text=body + "\n",
                marker=mm.group(1) if mm else None,
            )
            parse_marker(block)
            out.append(block)
        i = end + 1
    return out


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [b for p in pages(root) for b in blocks_of(p, root)]


def script(block: Block, port: int) -> tuple[str, list[str]]:
    """The bash script a block runs as, and (console blocks) the output lines it must print."""
    text = block.text
    for old, new in block.subs:
        if old not in text:
            raise ValueError(f"{block.id}: substitution {old!r} matches nothing")
        text = text.replace(old, new)
    text = text.replace("127.0.0.1:9092", f"127.0.0.1:{port}")
    if block.lang != "console":
        return text, []
    commands: list[str] = []
    expected: list[str] = []
    continuing = False
    for line in text.splitlines():
        if continuing or line.startswith("$ "):
            commands.append(line if continuing else line[2:])
            continuing = line.endswith("\\")
        elif line.strip():
            expected.append(line.strip())
    # a console block shows each command's output, failures included: no -e here
    return "set +e\n" + "\n".join(commands) + "\n", expected
