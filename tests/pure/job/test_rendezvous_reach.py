"""A rendezvous address the other ranks reach: the choice of rank 0's store address (pure, with a fake resolver
and interface table), the refusal of loopback when ranks span hosts, the socket interface handed to NCCL and
gloo, and the connect timeout (real sockets: a rank dialling a closed port fails within
parallel.connect_timeout_s, naming address and port, not after the collective timeout). Two real ranks on two
"nodes" publishing a reachable address are tests/multiproc/job/test_rendezvous_two_nodes.py's.

    .venv/bin/python -m pytest tests/pure/job/test_rendezvous_reach.py -q
"""
from __future__ import annotations

import json
import re
import socket
import time

import pytest
from faults import record

from hpctrain.job import netaddr, rendezvous
from hpctrain.job.netaddr import check_reachable, feed_socket_ifname, store_address
from hpctrain.job.rendezvous import Identity

DEBIAN = lambda: ("node7.cluster", "127.0.1.1")  # noqa: E731 -- /etc/hosts maps the host name to loopback
RESOLVES = lambda: ("node7.cluster", "10.1.0.7")  # noqa: E731
UNRESOLVED = lambda: ("node7.cluster", None)  # noqa: E731
NICS = lambda: {"lo": "127.0.0.1", "docker0": "172.17.0.1", "eno1": "10.1.0.7", "ib0": "10.2.0.7"}  # noqa: E731
ONLY_LO = lambda: {"lo": "127.0.0.1"}  # noqa: E731


def refused(fn, *fragments, **kw) -> str:
    with pytest.raises(ValueError) as info:
        fn(**kw)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg


# --- the address rank 0 publishes --------------------------------------------------------------------------

@pytest.mark.parametrize("kw, expected", [
    # parallel.master_addr wins over everything
    ({"master_addr": "10.9.9.9", "interface": "ib0", "spans_hosts": True}, ("10.9.9.9", "parallel.master_addr")),
    ({"master_addr": "10.9.9.9", "spans_hosts": False}, ("10.9.9.9", "parallel.master_addr")),
    # then the configured interface's own address
    ({"interface": "ib0", "spans_hosts": True}, ("10.2.0.7", "parallel.interface = 'ib0'")),
    ({"interface": "ib0", "spans_hosts": False}, ("10.2.0.7", "parallel.interface = 'ib0'")),
    # every rank on this host: loopback, never exposed
    ({"spans_hosts": False}, ("127.0.0.1", "every rank on one host")),
    # several hosts: the host name's address, unless it is loopback or nothing
    ({"spans_hosts": True, "resolve": RESOLVES}, ("10.1.0.7", "host name 'node7.cluster'")),
    ({"spans_hosts": True}, ("10.1.0.7", "interface eno1 (host name 'node7.cluster' resolves to 127.0.1.1)")),
    ({"spans_hosts": True, "resolve": UNRESOLVED}, ("10.1.0.7", "interface eno1 (host name 'node7.cluster' "
                                                                "resolves to nothing)")),
], ids=["master_addr", "master_addr_one_host", "interface", "interface_one_host", "one_host", "resolves",
        "debian_loopback", "unresolved"])
def test_store_address(kw, expected):
    kw = {"resolve": DEBIAN, "interfaces": NICS} | kw
    assert store_address(**kw) == expected


def test_unknown_interface_lists_the_real_ones():
    refused(store_address, "parallel.interface = 'ib1'", "eno1 10.1.0.7", "ib0 10.2.0.7", spans_hosts=True,
            interface="ib1", resolve=DEBIAN, interfaces=NICS)


def test_no_reachable_address_is_refused():
    """Host name on loopback and no other interface up: refused, not a silent 127.0.0.1."""
    refused(store_address, "127.0.1.1", "parallel.interface", "parallel.master_addr", spans_hosts=True,
            resolve=DEBIAN, interfaces=ONLY_LO)
    refused(store_address, "resolves to nothing", spans_hosts=True, resolve=UNRESOLVED, interfaces=ONLY_LO)


@pytest.mark.faults
@pytest.mark.parametrize("master_addr", ["127.0.0.1", "127.0.1.1", "localhost"])
def test_loopback_refused_when_ranks_span_hosts(master_addr):
    """Ranks on several hosts (known under MPI): a loopback master_addr is refused at once, naming the address,
    where it came from and the fix."""
    msg = refused(store_address, master_addr, "parallel.master_addr", "loopback", "3 hosts", "parallel.interface",
                  spans_hosts=True, master_addr=master_addr, num_hosts=3, resolve=DEBIAN, interfaces=NICS)
    assert store_address(False, master_addr) == (master_addr, "parallel.master_addr")  # one host: fine
    record(f"parallel.master_addr = {master_addr!r} with ranks on 3 hosts", f"ValueError before any rank dials: "
           f"{msg[:80]}...", None, "unit")


@pytest.mark.faults
def test_receiver_refuses_loopback_of_another_host():
    """Launchers without MPI: a rank learns rank 0's host with the address and refuses a loopback one at once,
    instead of dialling itself until the timeout."""
    info = {"addr": "127.0.1.1", "port": 4242, "host": "node1", "source": "parallel.master_addr"}
    msg = refused(check_reachable, "127.0.1.1:4242", "node1", "parallel.master_addr", "parallel.interface",
                  info=info, rank=5, host="node2")
    check_reachable(info, 5, "node1")  # the same host reaches its own loopback
    check_reachable(info | {"addr": "10.1.0.7"}, 5, "node2")
    record("rank 0 on another host publishes a loopback address (no MPI)", f"ValueError on the receiving rank at "
           f"once: {msg[:80]}...", None, "unit")


# --- the interface NCCL and gloo use -------------------------------------------------------------------------

def test_interface_feeds_nccl_and_gloo_unless_set():
    env: dict[str, str] = {"NCCL_SOCKET_IFNAME": "=ib1"}
    assert feed_socket_ifname("ib0", True, env, DEBIAN, NICS) == {"GLOO_SOCKET_IFNAME": "ib0"}
    assert env == {"NCCL_SOCKET_IFNAME": "=ib1", "GLOO_SOCKET_IFNAME": "ib0"}
    env = {}
    assert feed_socket_ifname("ib0", False, env, DEBIAN, NICS) == {"NCCL_SOCKET_IFNAME": "ib0",
                                                                  "GLOO_SOCKET_IFNAME": "ib0"}


def test_gloo_kept_off_loopback_without_an_interface():
    """gloo binds the address the host name resolves to: on a loopback host name that is 127.0.1.1, which no
    other host reaches. Several hosts: gloo gets the interface the store address came from; NCCL picks its own."""
    env: dict[str, str] = {}
    assert feed_socket_ifname("", True, env, DEBIAN, NICS) == {"GLOO_SOCKET_IFNAME": "eno1"} and env
    for resolve, spans, preset in [(RESOLVES, True, {}), (DEBIAN, False, {}), (DEBIAN, True,
                                                                                {"GLOO_SOCKET_IFNAME": "ib0"})]:
        env = dict(preset)
        assert feed_socket_ifname("", spans, env, resolve, NICS) == {} and env == preset


def test_host_interfaces_reads_this_host():
    table = netaddr.host_interfaces()
    assert table.get("lo") == "127.0.0.1", table
    assert all(socket.inet_aton(a) for a in table.values())


def test_mpi_identity_counts_hosts():
    names, hosts = ["n1", "n1", "n2", "n2"], ["h", "h", "h", "h"]  # two Slurm nodes on one host
    assert rendezvous.identity_from_node_names(2, names, "mpi", "j", hosts).num_hosts == 1
    assert rendezvous.identity_from_node_names(2, names, "mpi", "j", ["a", "a", "b", "b"]).num_hosts == 2
    assert rendezvous.identity_from_node_names(2, names, "mpi", "j").num_hosts == 0  # unknown


# --- real sockets ----------------------------------------------------------------------------------------------

def _closed_port() -> socket.socket:
    """A port nobody listens on that stays ours while the test dials it: bound, never listening (a connect meets a
    reset). A port closed before the dial is free for any process's next ephemeral bind, and gloo listens on
    ephemeral ports: a rank of a test beside this one may take it, and the retried dials then reach that rank's gloo
    pair (the suspect of CI-30, where a 4-rank worker's gloo pairs were closed by a peer mid-training)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


@pytest.mark.faults
def test_closed_port_fails_within_connect_timeout(tmp_path):
    """Rank 1 finds rank 0's published address, but nothing listens there (rank 0 died): it gives up after
    parallel.connect_timeout_s (2 s), naming address and port, although the collective timeout is 600 s."""
    ident = Identity(1, 2, 1, 0, "n1", 1, "slurm", "reach", socket.gethostname())
    held = _closed_port()
    port = held.getsockname()[1]
    info = {"addr": "127.0.0.1", "port": port, "host": ident.host, "secret": "0" * 32, "source": "every rank on "
            "one host"}
    rendezvous._write_private(rendezvous._rendezvous_file(ident, tmp_path), json.dumps(info))
    import torch.distributed  # noqa: F401 -- imported before the clock starts (seconds of its own here)
    t0 = time.monotonic()
    with held, pytest.raises(TimeoutError) as e:
        rendezvous.init_distributed(ident, "gloo", 600, "", tmp_path, connect_timeout_s=2)
    took = time.monotonic() - t0
    assert 2 <= took < 5, took
    assert f"127.0.0.1:{port}" in str(e.value) and "parallel.connect_timeout_s = 2" in str(e.value), e.value
    record("rank 0's store port closed when rank 1 connects", "TimeoutError after parallel.connect_timeout_s "
           "(2 s), naming 127.0.0.1:port, not after the 600 s collective timeout", took, "unit")


@pytest.mark.faults
def test_refusal_reaches_every_rank(tmp_path, monkeypatch):
    """Rank 0 cannot choose an address (parallel.interface names one its host lacks): the refusal is published
    in the address's place, so every rank raises it at once instead of waiting for an address."""
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.setenv(var, "lo")  # set: left alone, and this process's gloo stays usable
    msgs = []
    t0 = time.monotonic()
    for rank in range(2):
        ident = Identity(rank, 2, 0, rank, f"n{rank}", 2, "slurm", "refusal", socket.gethostname())
        with pytest.raises(ValueError) as e:
            rendezvous.init_distributed(ident, "gloo", 600, "", tmp_path, interface="nosuch0")
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "parallel.interface = 'nosuch0'" in msgs[0], msgs
    record("parallel.interface names an interface rank 0's host lacks", "every rank raises rank 0's ValueError "
           "(published in the address's place), none waits for an address", time.monotonic() - t0, "unit")


@pytest.mark.parametrize("override, fragment", [
    ("parallel.interface='ib0,ib1'", "parallel.interface = 'ib0,ib1' must be one network interface name"),
    ("parallel.interface='^docker'", "parallel.interface = '^docker'"),
    ("parallel.interface='ib0 eth0'", "parallel.interface = 'ib0 eth0'"),
    ("parallel.interface='interface_name_16'", "one network interface name"),
    ("parallel.connect_timeout_s=0", "parallel.connect_timeout_s = 0 must be >= 1"),
])
def test_config_checks(override, fragment):
    from hpctrain.config import load_config

    assert load_config(None, ["parallel.interface='bond0.12'"]).parallel.interface == "bond0.12"
    with pytest.raises(ValueError, match=re.escape(fragment)):
        load_config(None, [override])
