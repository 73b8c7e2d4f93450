"""``python -m vramplan``: the same command line as the ``vramplan`` script."""

from .cli import main

if __name__ == "__main__":
    main(prog_name="vramplan")
