"""Headless command-line interface (``hearth --cli ...``)."""
