"""The controller's runtime: `ArtRuntime` (connects to or starts the agents and sequences the
services), heartbeats (`monitor`) and the loopback agent (`local_agent`).

The agent, its client and its own bodies are `art_mega.agent`; import submodules directly.
"""
