"""Moving files between hosts: adapters over NIXL (UCX, metadata in the launch's etcd) and
artifact files through the agents, for host-local artifact roots.

Both halves live here: the agent's routes (`routes`, `files`), its NIXL process (`worker`,
`nixl`), the routes and bodies they exchange (`protocol`), and the controller side that drives a step's
adapter to every replica host (`adapters`). Import submodules directly (nothing is imported here).
"""
