"""A tiny causal LM in Hugging Face format, built locally: no download, anywhere.

Owns the model every test and the demo start from when no ``--model`` directory is given:
a small Qwen2- (default) or Llama-architecture config with random init, and a byte-level
BPE tokenizer with no merges (one token per byte, plus ``<|pad|>``, ``<|bos|>``,
``<|eos|>``, ``<|endoftext|>``), saved with ``save_pretrained`` so ``AutoModelForCausalLM`` /
``AutoTokenizer.from_pretrained(dir)`` load it like any checkpoint. A byte-level tokenizer is
used because transformers re-derives the pre-tokenizer from the model type on load; the
byte-level one survives that unchanged.

Real checkpoints work the same way: every role takes ``--model DIR``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# ids 0..3; <|endoftext|> is what Qwen2Tokenizer adds as its unk token when none exists
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|endoftext|>")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model. Defaults: ~0.9M parameters, fast on 2 CPU cores."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True


def build_tokenizer() -> PreTrainedTokenizerBase:
    """Byte-level tokenizer: 4 specials (ids 0..3: pad, bos, eos, unk) + 256 byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=0,  # alphabet only: no merges, one token per byte
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([""], trainer=trainer)
    pad, bos, eos, unk = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token=eos, unk_token=unk
    )


def build_config(spec: TinyModelSpec, vocab_size: int) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    cls = Qwen2Config if spec.arch == "qwen2" else LlamaConfig
    kwargs = {k: v for k, v in asdict(spec).items() if k != "arch"}
    return cls(vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kwargs)


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None, seed: int = 0) -> Path:
    """Random-init model + tokenizer saved in Hugging Face format at ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(build_config(spec, len(tokenizer)))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def load_model(model_dir: str | Path, device: str = "cpu", dtype: Any = None) -> PreTrainedModel:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype or torch.float32)
    return model.to(device)
