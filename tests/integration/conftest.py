"""Fixtures for integration tests that need real hosts: network namespaces with private sshds.

`netns_cluster` (function scope) is a factory `make(n=3, **kw) -> NetnsCluster`; `netns3` (module
scope) is a ready 3-host cluster. Both skip when not root, when `ip netns add` is refused, or when
sshd is missing, and every test using them is marked `root`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.integration.netns import NetnsCluster, netns_unavailable_reason

NETNS_FIXTURES = ("netns_cluster", "netns3")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses a namespace fixture with `root`."""
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in NETNS_FIXTURES):
            item.add_marker(pytest.mark.root)


def require_netns() -> None:
    """Skip the current test unless namespace clusters can run here (probed once per process)."""
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def netns_cluster() -> Iterator[Callable[..., NetnsCluster]]:
    """Factory `make(n=3, **kw)`: a started NetnsCluster, closed when the test ends (pass or fail)."""
    require_netns()
    made: list[NetnsCluster] = []

    def make(n: int = 3, **kw) -> NetnsCluster:
        cluster = NetnsCluster(n, **kw)
        made.append(cluster)
        return cluster.start()

    yield make
    errors = []
    for cluster in reversed(made):
        try:
            cluster.close()
        except Exception as e:
            errors.append(e)
    if errors:
        raise errors[0]


@pytest.fixture(scope="module")
def netns3() -> Iterator[NetnsCluster]:
    """Three hosts h0..h2 with sshd, shared by the tests of one module."""
    require_netns()
    with NetnsCluster(3) as cluster:
        yield cluster
