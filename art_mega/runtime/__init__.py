"""The per-host agent, its authenticated client, and the runtime that sequences them.

Heavy modules (fastapi, uvicorn) are imported by the agent only; import submodules directly.
"""
