"""Where processes run: Ray placement (`--use-ray`); torchrun needs nothing here."""
