"""The per-host agent: the only long-lived art-mega process on each host.

An authenticated HTTP server (`app`: Starlette on uvicorn) with signed routes (`routes`, HMAC
signing in `auth`, shared with the controller's client), child-process supervision
(`supervisor`), listening-socket facts (`listeners`) and its lease on the controller (`lease`).

Heavy modules (starlette, uvicorn) are imported by `app` and `routes` only; import submodules
directly (nothing is imported here).
"""
