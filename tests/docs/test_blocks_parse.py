"""The marker convention of tests/docs/blocks.py: what a page's shell blocks become."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.blocks import blocks_of, script

PAGE = """# A page

```sh
srl topics create
```

<!-- doc-test: run slow timeout=30 sub="--steps 60=>--steps 3" -->
```bash
srl demo --steps 60 --bootstrap 127.0.0.1:9092
```

  <!-- doc-test: skip reason="needs Docker" -->
  ```sh
  docker compose up
  ```

<!-- doc-test: run -->
```console
$ srl broker status
not running (data dir .srl/broker)
```

<!-- doc-test: skip -->
```sh
make test
```

```python
print("not a shell block")
```
"""


@pytest.fixture
def blocks(tmp_path: Path):  # type: ignore[no-untyped-def]
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text(PAGE)
    return blocks_of(page, tmp_path)


def test_each_shell_block_with_its_marker(blocks) -> None:  # type: ignore[no-untyped-def]
    assert [(b.id, b.lang, b.action) for b in blocks] == [
        ("docs/page.md:3", "sh", ""),
        ("docs/page.md:8", "bash", "run"),
        ("docs/page.md:13", "sh", "skip"),
        ("docs/page.md:18", "console", "run"),
        ("docs/page.md:24", "sh", ""),
    ]
    unmarked, slow, docker, _, no_reason = blocks
    assert "no <!-- doc-test" in unmarked.reason
    assert slow.slow and slow.timeout_s == 30 and slow.subs == [("--steps 60", "--steps 3")]
    assert docker.reason == "needs Docker" and docker.text == "docker compose up\n"
    assert no_reason.reason == 'skip needs reason="…"'


def test_script_substitutes_and_moves_the_port(blocks) -> None:  # type: ignore[no-untyped-def]
    text, expected = script(blocks[1], 4242)
    assert text == "srl demo --steps 3 --bootstrap 127.0.0.1:4242\n" and expected == []


def test_console_runs_its_commands_and_expects_the_rest(blocks) -> None:  # type: ignore[no-untyped-def]
    text, expected = script(blocks[3], 4242)
    assert text == "set +e\nsrl broker status\n"
    assert expected == ["not running (data dir .srl/broker)"]


def test_a_substitution_that_matches_nothing_is_an_error(blocks) -> None:  # type: ignore[no-untyped-def]
    blocks[1].subs.append(("--nothing", "x"))
    with pytest.raises(ValueError, match="matches nothing"):
        script(blocks[1], 4242)
