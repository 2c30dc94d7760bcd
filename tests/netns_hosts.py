"""Test hosts on this machine that differ as real hosts do: each in its own network namespace, with
its own address on a private bridge and its own host name, running one Monarch worker (`meshrl
worker`, over mutual TLS with certificates from `meshrl certs`, or plain TCP with `--insecure`). The
controller attaches to them with `--job.kind workers`. Needs root and iproute2. Everything made (namespaces, links, /etc/netns files, the workers and every process
they started) is removed on the way out, also when the test fails."""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

PORT = 26600


@dataclass
class NamespaceHosts:
    names: list[str]  # the hosts' names, as `hostname` prints them there
    namespaces: list[str]
    addresses: list[str]  # the workers', in host order: --job.workers
    bind: str  # where the workers reach the controller: --job.bind
    workers: list[subprocess.Popen]
    job_args: list[str]  # the controller's --job.* arguments to attach to them (its TLS files, or insecure)


def usable() -> str:
    """'' when this machine can make such hosts, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if not shutil.which("ip") or not shutil.which("unshare"):
        return "needs iproute2 and util-linux (ip, unshare)"
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _live_in_sessions(sessions: set[int]) -> list[int]:
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.getsid(int(entry)) in sessions:
                state = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[0]
                if state not in ("Z", "X"):
                    pids.append(int(entry))
    return pids


def _stop_workers(workers: list[subprocess.Popen]) -> None:
    """Every process of the workers' sessions: the workers and the actor processes they started."""
    sessions = {w.pid for w in workers}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _live_in_sessions(sessions):
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 3
        while _live_in_sessions(sessions) and time.monotonic() < deadline:
            time.sleep(0.1)
    for w in workers:
        with contextlib.suppress(Exception):
            w.wait(timeout=5)


def _wait_listening(address: str, seconds: float = 60) -> None:
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no Monarch worker listening at {address}")
        time.sleep(0.2)


@contextlib.contextmanager
def namespace_hosts(count: int, log_dir, tls: bool = True, env: dict | None = None):
    """`count` hosts on a bridge of their own; yields NamespaceHosts. With `tls`, `meshrl certs` makes a CA
    and a certificate for every host and the controller (in log_dir/tls), and the workers accept only
    clients holding it. Worker logs go to `log_dir`; `env` is added to the workers' environment."""
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.213.{os.getpid() % 250}"
    bridge = f"mrb{tag}"
    names = [f"mrl{tag}h{i}" for i in range(count)]
    made_links, made_namespaces, workers = [], [], []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made_links.append(bridge)
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{subnet}.{10 + i} {n}\n" for i, n in enumerate(names))
        for i, name in enumerate(names):
            _ip("netns", "add", name)
            made_namespaces.append(name)
            veth = f"mrv{tag}h{i}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            made_links.append(veth)
            _ip("link", "set", veth, "master", bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", name, "addr", "add", f"{subnet}.{10 + i}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "route", "add", "default", "via", f"{subnet}.1")
            os.makedirs(f"/etc/netns/{name}", exist_ok=True)
            with open(f"/etc/netns/{name}/hosts", "w") as f:
                f.write(hosts_file)
        scheme, certs = ("tls", os.path.join(log_dir, "tls")) if tls else ("tcp", None)
        addresses = [f"{scheme}://{subnet}.{10 + i}:{PORT}" for i in range(count)]
        if certs:
            ips = [f"{subnet}.{10 + i}" for i in range(count)]
            hosts = [*names, *ips, f"{subnet}.1", socket.gethostname(), "localhost", "127.0.0.1"]
            subprocess.run([sys.executable, "-m", "meshrl", "certs", certs, "--hosts", ",".join(hosts)], check=True,
                           capture_output=True)
        security = f"--tls {certs}" if certs else "--insecure"
        for name, address in zip(names, addresses):
            log = open(os.path.join(log_dir, f"{name}.log"), "w")
            command = f"hostname {name} && exec {sys.executable} -m meshrl worker --address {address} {security}"
            workers.append(subprocess.Popen(["ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c", command],
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            start_new_session=True, env={**os.environ, **(env or {})}))
        for address in addresses:
            _wait_listening(address)
        job_args = (["--job.tls.ca", f"{certs}/ca.crt", "--job.tls.cert", f"{certs}/tls.crt", "--job.tls.key",
                     f"{certs}/tls.key"] if certs else ["--job.tls.insecure", "true"])
        yield NamespaceHosts(names, made_namespaces, addresses, f"{scheme}://{subnet}.1:0", workers, job_args)
    finally:
        _stop_workers(workers)
        for name in made_namespaces:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        for link in reversed(made_links):  # a veth goes with its namespace; the bridge is ours to delete
            subprocess.run(["ip", "link", "del", link], capture_output=True)


def leftovers(hosts: NamespaceHosts) -> list[str]:
    """What of `hosts` is still there: namespaces, links, /etc/netns entries, worker processes."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found = [n for n in hosts.namespaces if n in namespaces or os.path.exists(f"/etc/netns/{n}")]
    tag = hosts.names[0].removeprefix("mrl").split("h")[0]
    found += [f"link {w}" for w in links.split() if w.startswith((f"mrb{tag}", f"mrv{tag}"))]
    found += [f"pid {p}" for p in _live_in_sessions({w.pid for w in hosts.workers})]
    return found
