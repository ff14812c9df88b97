"""`main` is not async: refused before anything starts."""


def main(launch):
    return launch
