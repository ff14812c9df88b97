"""Preflight: everything proved about the hosts before a trainer rank or a replica starts.

Host admission over the facts every agent reports (`admission`, `host_facts`), the shared
filesystem probe (`fs_probe`), the managed etcd metadata store (`etcd`), the collective over
every participating host (`collective`, controller side; `probe`, the per-host process), the
network-interface checks (`netif`), and the agent's preflight routes (`routes`) with their bodies
(`protocol`). Import submodules directly (nothing is imported here).
"""
