"""The per-host agent: the only long-lived art-mega process on each host.

An authenticated HTTP server (`app`: Starlette on uvicorn) with signed routes (`routes`: the
`Route` record both ends share; HMAC signing in `auth`), child-process supervision
(`supervisor`), listening-socket facts (`listeners`), its lease on the controller (`lease`), the
controller's signed client (`client`), free ports (`ports`) and the agent's own bodies and routes
(`protocol`: identity, health, lease, shutdown, free port). It imports no service: each service
adds its routes with its own `register(router, supervisor)`, and a service imports only
`routes`, `supervisor`, `client`, `protocol` and `ports` from here.

Heavy modules (starlette, uvicorn) are imported by `app` and `routes` only; import submodules
directly (nothing is imported here).
"""
