"""Trivial rollouts for the benchmarks; top level and async so that rollout workers can import them."""


async def noop(x):
    """Return `x` unchanged: measures the executor's round trip, not the rollout."""
    return x
