"""`python -m experiments.bench <suite> ...` (see `experiments.bench`)."""

from experiments.bench.cli import main

main()
