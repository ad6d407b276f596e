"""Consumer side: assembler, rewards, staleness gate, dynamic batcher, losses, trainer and
weights publisher. Entry point: ``srl-consumer``."""
