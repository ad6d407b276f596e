"""The locally built tiny model loads back as a normal Hugging Face checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from srl.tinymodel import TinyModelSpec, build_tiny_model, load_model, load_tokenizer


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_model_round_trips_through_hf_format(tmp_path: Path, arch: str) -> None:
    spec = TinyModelSpec(
        arch=arch,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    out = build_tiny_model(tmp_path / arch, spec, seed=1)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    tok = load_tokenizer(out)
    text = "count 3..7: 3 4 5 6 7"
    ids = tok(text).input_ids
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    model = load_model(out)
    assert model.config.model_type == arch
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok))
    again = load_model(build_tiny_model(tmp_path / "again", spec, seed=1))
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True)
    )
