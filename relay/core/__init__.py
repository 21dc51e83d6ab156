"""The protocol core: pure, deterministic, no I/O."""
