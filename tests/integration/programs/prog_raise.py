"""The program itself raises: exit 1 with the traceback."""


async def main(launch):
    raise RuntimeError("program bug 42")
