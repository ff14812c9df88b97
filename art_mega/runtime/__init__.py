"""The per-host agent, its authenticated client, and the runtime that sequences them.

Heavy modules (starlette, uvicorn) are imported by the agent only; import submodules directly.
"""
