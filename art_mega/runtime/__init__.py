"""The controller's runtime: `ArtRuntime` (connects to or starts the agents and sequences the
services), the signed agent client (`client`), heartbeats (`monitor`), free ports (`ports`), the
loopback agent (`local_agent`) and the control plane's bodies (`protocol`).

The agent itself is `art_mega.agent`; import submodules directly.
"""
