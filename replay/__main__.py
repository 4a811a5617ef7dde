"""``python -m replay ...`` runs the ``router-replay`` command."""

from replay.cli import main

main()
