"""``python -m consumers …`` (what ``torchrun -m consumers train …`` runs on every rank)."""

from consumers.cli import main

main()
