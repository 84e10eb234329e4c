"""Training of the bundled demo model (not part of the installed hearth package; see README.md)."""
