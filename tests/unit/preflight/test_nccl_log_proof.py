"""The NCCL log proof on recorded lines of both shapes (the network asked for, and another)."""

import pytest

from art_mega.preflight.probe import check_nccl_log

IB_LOG = """\
gpu-a:1234:1234 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>
gpu-a:1234:1234 [0] NCCL INFO NET/Plugin: No plugin found (libnccl-net.so)
gpu-a:1234:1290 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB eth0:10.0.0.1<0>
gpu-a:1234:1290 [0] NCCL INFO Using network IB
gpu-a:1234:1290 [0] NCCL INFO comm 0x55d0 rank 3 nranks 8 cudaDev 0 nvmlDev 0 busId 18000 commId 0x1 - Init START
"""

SOCKET_LOG = """\
gpu-b:99:99 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.2<0>
gpu-b:99:120 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>
gpu-b:99:120 [0] NCCL INFO Using network Socket
"""


def test_the_expected_network_passes():
    check_nccl_log(IB_LOG, "IB", rank=3, host="gpu-a")
    check_nccl_log(IB_LOG, "ib", rank=3, host="gpu-a")


def test_another_network_is_named():
    with pytest.raises(RuntimeError, match="expected network IB, rank 3 on host gpu-b selected Socket"):
        check_nccl_log(SOCKET_LOG, "IB", rank=3, host="gpu-b")


def test_no_line_or_two_lines_fail():
    with pytest.raises(RuntimeError, match="logged 0"):
        check_nccl_log("NCCL INFO Bootstrap : Using eth0\n", "IB", rank=0, host="h")
    with pytest.raises(RuntimeError, match="logged 2"):
        check_nccl_log(IB_LOG + SOCKET_LOG, "IB", rank=0, host="h")
