"""``python -m replay ...`` runs the ``router-replay`` command."""

from .cli import main

main()
