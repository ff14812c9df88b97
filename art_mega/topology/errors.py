"""The error raised when a topology cannot be compiled into processes.

A `TopologyError` is a `UserError`: one sentence naming the field, the value and the fix.
"""

from __future__ import annotations

from art_mega.errors import UserError


class TopologyError(UserError):
    """A topology that is valid field by field but cannot be placed as a whole.

    Raised by `compile_topology` (unknown host ids, GPU overlap, port collisions, sizes that do
    not divide the world, missing multi-host transport) and by lookups such as
    `ClusterSpec.host` for an unknown host id. Exit code 2.
    """
