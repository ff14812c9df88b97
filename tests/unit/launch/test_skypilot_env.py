import pytest

from art_mega.errors import UserError
from art_mega.launch.skypilot import launch_id_for, prepare, read_skypilot_env

GOOD = {
    "SKYPILOT_NODE_RANK": "1",
    "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2\n10.0.0.3\n",
    "SKYPILOT_NUM_NODES": "3",
}


def test_reads_newline_and_comma_separated_ips():
    node = read_skypilot_env(GOOD)
    assert node.rank == 1 and node.num_nodes == 3
    assert node.node_ips == ("10.0.0.1", "10.0.0.2", "10.0.0.3")
    comma = dict(GOOD, SKYPILOT_NODE_IPS="10.0.0.1, 10.0.0.2,10.0.0.3")
    assert read_skypilot_env(comma).node_ips == node.node_ips
    v6 = dict(GOOD, SKYPILOT_NODE_IPS="fd00::1,fd00::2,fd00::3")
    assert read_skypilot_env(v6).node_ips[2] == "fd00::3"


@pytest.mark.parametrize(
    "change,message",
    [
        ({"SKYPILOT_NODE_RANK": None}, "SKYPILOT_NODE_RANK is not set"),
        ({"SKYPILOT_NODE_IPS": None}, "SKYPILOT_NODE_IPS is not set"),
        ({"SKYPILOT_NUM_NODES": None}, "SKYPILOT_NUM_NODES is not set"),
        ({"SKYPILOT_NODE_RANK": "one"}, "SKYPILOT_NODE_RANK='one' is not a non-negative integer"),
        (
            {"SKYPILOT_NODE_RANK": "\u00b2"},
            "SKYPILOT_NODE_RANK='\u00b2' is not a non-negative integer in ASCII",
        ),
        (
            {"SKYPILOT_NODE_RANK": "\u0661"},
            "SKYPILOT_NODE_RANK='\u0661' is not a non-negative integer in ASCII",
        ),
        ({"SKYPILOT_NUM_NODES": "\u0663"}, "SKYPILOT_NUM_NODES='\u0663' is not a positive integer in ASCII"),
        (
            {"SKYPILOT_NODE_IPS": "10.0.0.1,127.0.0.1,10.0.0.3"},
            "lists 127.0.0.1, a loopback address, among 3",
        ),
        ({"SKYPILOT_NODE_RANK": "-1"}, "SKYPILOT_NODE_RANK='-1'"),
        ({"SKYPILOT_NODE_RANK": "3"}, "SKYPILOT_NODE_RANK=3 is out of range for 3 nodes"),
        ({"SKYPILOT_NUM_NODES": "x"}, "SKYPILOT_NUM_NODES='x' is not a positive integer"),
        ({"SKYPILOT_NUM_NODES": "0"}, "SKYPILOT_NUM_NODES='0'"),
        ({"SKYPILOT_NUM_NODES": "2"}, "SKYPILOT_NUM_NODES=2 but SKYPILOT_NODE_IPS lists 3"),
        ({"SKYPILOT_NODE_IPS": "10.0.0.1,10.0.0.1,10.0.0.3"}, "lists 10.0.0.1 more than once"),
        ({"SKYPILOT_NODE_IPS": "10.0.0.1,node-b,10.0.0.3"}, "'node-b', which is not an IP address"),
    ],
)
def test_every_rule_has_a_failing_case(change, message):
    env = dict(GOOD)
    for key, value in change.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = value
    with pytest.raises(UserError, match=message):
        read_skypilot_env(env)


def test_all_loopback_node_ips_are_one_machine_and_accepted():
    node = read_skypilot_env(dict(GOOD, SKYPILOT_NODE_IPS="127.0.0.1,127.0.0.2,127.0.0.3"))
    assert node.node_ips == ("127.0.0.1", "127.0.0.2", "127.0.0.3")


def test_prepare_hides_the_variables_and_requires_the_secret():
    env = dict(GOOD, ART_MEGA_SECRET="s" * 64, OTHER="kept")
    node, secret = prepare(env)
    assert secret == b"s" * 64 and node.rank == 1
    assert env == {"OTHER": "kept"}
    with pytest.raises(UserError, match="ART_MEGA_SECRET is not set.*secrets:"):
        prepare(dict(GOOD))


def test_launch_id_is_shared_by_all_ranks_and_depends_on_the_secret():
    a = read_skypilot_env(GOOD)
    b = read_skypilot_env(dict(GOOD, SKYPILOT_NODE_RANK="2"))
    assert launch_id_for(b"x" * 32, a) == launch_id_for(b"x" * 32, b)
    assert launch_id_for(b"x" * 32, a) != launch_id_for(b"y" * 32, a)
