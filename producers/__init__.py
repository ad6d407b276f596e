"""Producer side: the dispatcher, generator workers, engines (hf, vllm, sim), the chunker and
the weight follower. Entry point: ``srl-producer``."""
