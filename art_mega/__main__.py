"""`python -m art_mega` is the `art-mega` command."""

from art_mega.launch.cli import main

main()
