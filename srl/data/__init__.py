"""Data files shipped with srl (package data), found without a relative path."""

from pathlib import Path

# StreamRL's output-length histogram (Fig. 7, 20K max length, digitised from the figure):
# the default workload of the simulations (``srl.workload``), the pipeline benchmark and the
# ranker's simulation
STREAMRL_LENGTHS = Path(__file__).resolve().parent / "streamrl_output_length_hist.csv"
