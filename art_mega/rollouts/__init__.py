"""Rollouts: the executor that runs the user's async rollout functions on worker processes of any
host, the worker process itself, the agent's rollout routes (`routes`) and their bodies
(`protocol`), installed callables (import references pinned by source hash) and the JSON wire
format of arguments and results.

Import submodules directly (nothing is imported here).
"""
