"""The inspector: what a turn changed that a recovery needs (skip, fs or full), with reasons."""
