"""Where replicas go once a host of their group is lost (meshrl/runtime/jobs.py, `Hosts.slot` and `Hosts.lose`),
without Monarch: a fake group of three hosts. The lost host itself, on real workers in network namespaces, is
tested in test_multihost.py."""

import logging

from assertions import log_messages

from meshrl.runtime.jobs import Hosts, RolePlacement


class FakeGroup:
    """A host mesh of `count` hosts: `slice(hosts=i)` names host i."""

    def __init__(self, count: int):
        self.sizes = {"hosts": count}

    def slice(self, hosts: int) -> str:
        return f"host{hosts}"


def hosts_of(count: int) -> Hosts:
    hosts = Hosts.__new__(Hosts)  # no job: the meshes are the fake's
    hosts.placement = {"generator": RolePlacement("generators", count, 1)}
    hosts.meshes, hosts.lost, hosts.placed = {"generators": FakeGroup(count)}, {}, {}
    return hosts


def test_replicas_of_a_lost_host_go_to_the_groups_next_host_and_the_last_host_is_never_lost(caplog):
    hosts = hosts_of(3)
    assert [hosts.host("generator", i) for i in range(6)] == ["host0", "host1", "host2"] * 2
    caplog.set_level(logging.WARNING)
    assert hosts.lose("generator", 4, RuntimeError("error spawning proc mesh: Timeout(30s)"))  # replica 4: host 1
    assert [hosts.host("generator", i) for i in range(6)] == ["host0", "host2", "host2", "host0", "host2", "host2"]
    assert hosts.lose("generator", 1, RuntimeError("again"), slot=1)  # found lost by another start: no new line
    assert log_messages(caplog) == [
        "host 1 of group generators is lost (error spawning proc mesh: Timeout(30s)): what ran there starts on "
        "the group's other hosts"]
    assert hosts.lose("generator", 2, RuntimeError("gone"))  # replica 2 was last given host 2
    assert [hosts.host("generator", i) for i in range(3)] == ["host0"] * 3
    assert not hosts.lose("generator", 0, RuntimeError("gone"))  # the last host: nowhere else to go
    assert hosts.host("generator", 5) == "host0" and hosts.lost == {"generators": {1, 2}}
