"""``python -m lightning_slsam.cli``: the ``lightning-slsam`` command."""

from lightning_slsam.cli.command import main

if __name__ == "__main__":
    main()
