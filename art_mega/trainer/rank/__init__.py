"""The trainer rank process (`python -m art_mega.trainer.rank.main`): its jobs, engine, loss, LoRA,
logprobs, attention and parallel state.

Only the rank imports this package (tests/unit/project/test_import_graph.py), and the family files' rank-side
builders, inside their functions; the controller and the agent talk to a rank through
`trainer.protocol` only.
"""
