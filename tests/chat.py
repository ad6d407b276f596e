"""A model directory whose tokenizer has a chat template, for the ``--chat-template`` tests.

The suite's tiny model (``srl.tinymodel``) has none; ``with_chat_template`` copies a model
directory and writes a small Jinja template into the copy's ``tokenizer_config.json`` (no
download: the template is ``TEMPLATE`` below).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>"
    "\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def with_chat_template(model_dir: Path, out: Path, template: str = TEMPLATE) -> Path:
    """A copy of ``model_dir`` at ``out`` whose tokenizer renders chats with ``template``."""
    shutil.copytree(model_dir, out)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = template
    config_file.write_text(json.dumps(config))
    return out
