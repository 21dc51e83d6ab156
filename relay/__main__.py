"""`python -m relay` is the `relay` command."""

from relay.cli import main

if __name__ == "__main__":
    main(prog_name="relay")
