"""Where the roles run. Monarch's job API gives host meshes; each role's proc mesh is spawned on the
hosts its config names. meshrl starts no remote process itself: Slurm, Kubernetes or Monarch's local
process job start Monarch's workers, and `workers` attaches to workers started some other way
(ssh, a cluster's own launcher, the test's hosts in network namespaces).

`job.hosts` names groups of hosts and their sizes ("trainer:1,generators:2"); each role's `hosts`
field picks its group ("": the controller's own host). Trainer and reference ranks are spread evenly
over their group's hosts; generator and grader replicas go round-robin over theirs, one process each.
A host that can no longer start a process is lost: the replicas that would go there go to the group's
next host instead (`Hosts.slot`, `Hosts.lose`).
"""

import asyncio
import logging
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from monarch.actor import Actor, attach_to_workers, enable_transport, endpoint, this_host
from monarch.job import JobState, JobTrait, LocalJob, ProcessJob, SlurmJob

from meshrl.configs.job import JobConfig

logger = logging.getLogger(__name__)

KINDS = ("local", "process", "workers", "slurm", "kubernetes")
PLACED = ("trainer", "reference", "replay_buffer", "generator", "grader")  # the roles with a `hosts` field


def host_groups(job: JobConfig) -> dict[str, int]:
    """ "trainer:1,generators:2" -> {"trainer": 1, "generators": 2}."""
    groups = {}
    for part in filter(None, (p.strip() for p in job.hosts.split(","))):
        name, _, count = part.partition(":")
        if not name.isidentifier() or not count.isdigit() or int(count) < 1 or name in groups:
            raise ValueError(f"job.hosts {job.hosts!r}: each group is NAME:COUNT with a new name and a count "
                             "of at least 1, e.g. trainer:1,generators:2")
        groups[name] = int(count)
    return groups


@dataclass(frozen=True)
class RolePlacement:
    group: str  # "": the controller's host
    hosts: int  # hosts in the group
    procs_per_host: int


def plan(config) -> dict[str, RolePlacement]:
    """Each placed role's group, hosts and processes per host; ValueError (one line) if the config's
    placement cannot work. Checks the job's own settings too (`check_job`), without starting anything."""
    job = config.job
    if job.kind not in KINDS:
        raise ValueError(f"unknown job.kind {job.kind!r}; known: {', '.join(KINDS)}")
    groups = host_groups(job) if job.kind != "local" else {}
    if job.kind != "local" and not groups:
        raise ValueError(f"job.kind {job.kind} needs job.hosts, the host groups the roles go on "
                         "(e.g. trainer:1,generators:1)")
    roles = [r for r in PLACED if r != "reference" or config.trainer.loss.kl_coef > 0]
    placements = {}
    for role in roles:
        section = getattr(config, role)
        group = section.hosts if job.kind != "local" else ""
        if group and group not in groups:
            raise ValueError(f"{role}.hosts {group!r} is not a group of job.hosts ({job.hosts or 'none'})")
        hosts = groups.get(group, 1)
        if role in ("trainer", "reference"):
            if section.ranks % hosts:
                raise ValueError(f"{role}.ranks ({section.ranks}) must be a multiple of the hosts in its group "
                                 f"{group!r} ({hosts}): each host runs as many ranks")
            per_host = section.ranks // hosts
        elif role == "replay_buffer":  # one process, on the group's first host
            per_host = 1
        else:  # generator, grader
            per_host = -(-section.replicas // hosts)
        placements[role] = RolePlacement(group, hosts, per_host)
    check_job(job, groups)
    return placements


def describe(config, placement: dict[str, RolePlacement]) -> list[str]:
    """The plan in words, one line per role (`meshrl train --dry-run` prints it)."""
    job = config.job
    groups = host_groups(job) if job.kind != "local" else {}
    lines = [f"job: {job.kind}" + (", host groups " + ", ".join(f"{g} ({_n(n, 'host')})" for g, n in groups.items())
                                   if groups else " (every role on this host)")]
    for role, p in placement.items():
        where = f"group {p.group} ({_n(p.hosts, 'host')})" if p.group else "the controller's host"
        if role in ("trainer", "reference"):
            what = f"{_n(getattr(config, role).ranks, 'rank')}, {p.procs_per_host} per host"
        elif role == "replay_buffer":
            what = f"{config.replay_buffer.impl}, one process"
        else:
            what = f"{_n(getattr(config, role).replicas, 'replica')} (one process each, round-robin over the hosts)"
        lines.append(f"{role}: {what} on {where}")
    return lines


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' if count != 1 else ''}"


def gpus_per_host(job: JobConfig) -> int | None:
    """The GPUs each host gives the roles: `job.gpus_per_host`, else what the job asks its hosts for
    (Slurm's gpus_per_node, Kubernetes' gpus_per_pod), else this host's own (local and process jobs,
    whose hosts are this machine); None for workers started elsewhere unless set: a run asks them once
    they are attached (`host_gpus`)."""
    if job.gpus_per_host:
        return job.gpus_per_host
    if job.kind == "slurm":
        return job.slurm.gpus_per_node
    if job.kind == "kubernetes":
        return job.kubernetes.gpus_per_pod
    if job.kind in ("local", "process"):
        import torch

        return torch.cuda.device_count()
    return None


class GpuCount(Actor):
    """Spawned once on each host of a group: how many GPUs the host has."""

    @endpoint
    async def count(self) -> int:
        import torch

        return torch.cuda.device_count()  # through NVML: no CUDA context, nothing a later fork would inherit


async def host_gpus(hosts: "Hosts") -> dict[str, int]:
    """The GPUs of each group's hosts, asked of the hosts themselves (`GpuCount`, one process a host,
    stopped after); the controller's own host ("") is counted here. `group_gpus` says what a group of
    hosts that differ gives."""
    import torch

    async def ask(mesh) -> list[int]:
        procs = mesh.spawn_procs(per_host={"procs": 1}, name="gpu_count")
        try:
            return [n for _, n in (await procs.spawn("gpu_count", GpuCount).count.call()).items()]
        finally:
            await procs.stop()

    groups = [group for group in hosts.meshes if group]
    counts = await asyncio.gather(*(ask(hosts.meshes[group]) for group in groups))  # every group at once
    return group_gpus({"": [torch.cuda.device_count()], **dict(zip(groups, counts))})


def group_gpus(reports: dict[str, list[int]]) -> dict[str, int]:
    """Each group's GPUs per host from what its hosts reported; ValueError (one line) for a group whose
    hosts differ: a placement is the same on every host of a group, and the fewest GPUs would leave
    the others idle unseen, so the user says how many to use (job.gpus_per_host)."""
    for group, counts in reports.items():
        if len(set(counts)) > 1:
            raise ValueError(f"the hosts of group {group!r} report different GPU counts ({', '.join(map(str, counts))}, "
                             f"in host order): set job.gpus_per_host to the GPUs each host of it should use")
    return {group: counts[0] for group, counts in reports.items() if counts}


def check_job(job: JobConfig, groups: dict[str, int]) -> None:
    """The kind's own settings, as far as they can be checked without a cluster."""
    if job.kind == "workers" and len(_addresses(job)) != sum(groups.values()):
        raise ValueError(f"job.workers names {len(_addresses(job))} worker addresses; job.hosts "
                         f"({job.hosts}) needs {sum(groups.values())}, one per host")
    if job.kind == "workers":
        check_tls(job)
    if job.kind == "kubernetes":
        bad = [g for g in groups if not (g.isalnum() and g.islower() and g[0].isalpha())]
        if bad:
            raise ValueError(f"job.hosts group {bad[0]!r}: Kubernetes meshes need lowercase letters and digits only")
    if job.kind == "slurm" and job.slurm.time_limit and not all(p.isdigit() for p in job.slurm.time_limit.split(":")):
        raise ValueError(f"job.slurm.time_limit {job.slurm.time_limit!r} is not HH:MM:SS")


def check_tls(job: JobConfig) -> None:
    """Workers are attached over mutual TLS (job.tls: its files there, every address tls://), or over
    plain TCP only when job.tls.insecure says so."""
    scheme = "tcp://" if job.tls.insecure else "tls://"
    addresses = _addresses(job) + ([job.bind] if job.bind else [])
    if bad := [a for a in addresses if not a.startswith(scheme)]:
        if job.tls.insecure:
            raise ValueError(f"job.tls.insecure attaches over plain TCP: {bad[0]} is not a tcp:// address")
        raise ValueError(f"{bad[0]} is not a TLS address: start workers with `meshrl worker --address "
                         "tls://HOST:PORT --tls DIR` (or set job.tls.insecure true to trust every connection)")
    if job.tls.insecure:
        return
    files = {"job.tls.ca": job.tls.ca, "job.tls.cert": job.tls.cert, "job.tls.key": job.tls.key}
    if unset := [name for name, path in files.items() if not path]:
        raise ValueError(f"job.kind workers attaches over mutual TLS: set {', '.join(unset)} (`meshrl certs DIR` "
                         "makes them), or job.tls.insecure true to trust every connection")
    if missing := [f"{name} {path}" for name, path in files.items() if not Path(path).is_file()]:
        raise ValueError(f"{missing[0]} does not exist")


def _use_tls(job: JobConfig) -> str:
    """Point Monarch's TLS transport at job.tls's files (before any Monarch call); the transport to use."""
    if job.tls.insecure:
        print("meshrl: warning: job.tls.insecure: the workers run whatever any client that reaches their ports "
              "asks, and nothing between them and this controller is encrypted", file=sys.stderr, flush=True)
        return "tcp"
    from monarch._rust_bindings.monarch_hyperactor.config import reload_config_from_env

    from meshrl.runtime.certs import tls_files_environment

    os.environ.update(tls_files_environment(*(Path(p).resolve() for p in (job.tls.ca, job.tls.cert, job.tls.key))))
    reload_config_from_env()  # Monarch read its environment when it was imported
    return "tls"


def _addresses(job: JobConfig) -> list[str]:
    return [a.strip() for a in job.workers.split(",") if a.strip()]


def make_job(job: JobConfig, log_dir: Path):
    """The Monarch job object for `job` (nothing is launched until its `state()` is asked for). Slurm,
    Kubernetes and `workers` switch this process to Monarch's TCP transport, so call it before any
    other Monarch call."""
    groups = host_groups(job)
    if job.kind == "local":
        return LocalJob(hosts=tuple(groups) or ("hosts",))
    if job.kind == "process":
        return ProcessJob(groups)
    if job.kind == "workers":
        transport = _use_tls(job)
        enable_transport(job.bind or transport)
        return AttachedWorkers(groups, _addresses(job))
    if job.kind == "slurm":
        s = job.slurm
        return SlurmJob(groups, python_exe=s.python_exe, slurm_args=tuple(shlex.split(s.sbatch_args)),
                        monarch_port=s.port, job_name=s.job_name, time_limit=s.time_limit or None,
                        partition=s.partition or None, log_dir=str(log_dir), exclusive=s.exclusive,
                        gpus_per_node=s.gpus_per_node or None, cpus_per_task=s.cpus_per_task or None,
                        mem=s.mem or None, job_start_timeout=s.start_timeout_s or None,
                        account=s.account or None, qos=s.qos or None)
    try:
        from monarch.job.kubernetes import ImageSpec, KubeConfig, KubernetesJob
    except ImportError as e:
        raise ValueError(f"job.kind kubernetes needs the kubernetes package ({e}): pip install kubernetes") from None
    k = job.kubernetes
    kube = KubernetesJob(k.namespace, timeout=k.start_timeout_s or None,
                         kubeconfig=KubeConfig.from_path(k.kubeconfig) if k.kubeconfig else None)
    resources = {"nvidia.com/gpu": k.gpus_per_pod} if k.gpus_per_pod else None
    for name, count in groups.items():
        kube.add_mesh(name, count, port=k.port, image_spec=ImageSpec(k.image, resources=resources) if k.image else None)
    return kube


class AttachedWorkers(JobTrait):
    """Monarch workers already running (`run_worker_loop_forever` at known addresses), the groups'
    hosts in order. Whoever started them stops them: `kill` only lets go."""

    def __init__(self, groups: dict[str, int], addresses: list[str]):
        super().__init__()
        self.groups, self.addresses = groups, addresses

    def _create(self, client_script):
        if client_script is not None:
            raise RuntimeError("attached workers cannot run a batch script")

    def _state(self):
        meshes, start = {}, 0
        for name, count in self.groups.items():
            meshes[name] = attach_to_workers(name=name, ca="trust_all_connections",
                                             workers=self.addresses[start:start + count])
            start += count
        return JobState(meshes)

    def can_run(self, spec) -> bool:
        return False

    def _kill(self):
        pass


class Hosts:
    """A running job's host meshes, found by role: each role's group, or the controller's own host."""

    def __init__(self, job, placement: dict[str, RolePlacement]):
        self.job, self.placement = job, placement
        groups = sorted({p.group for p in placement.values() if p.group})
        logging.getLogger("monarch._src.job.job").setLevel(logging.WARNING)  # its progress lines, on stderr
        state = job.state(cached_path=None) if groups else None  # never reuse another run's job
        self.meshes = {name: getattr(state, name) for name in groups} | {"": this_host()}
        self.lost: dict[str, set[int]] = {}  # group -> its hosts that could no longer start a process (`lose`)
        self.placed: dict[tuple[str, int], int] = {}  # (role, replica index) -> the host it was last given

    async def connected(self) -> None:
        """Wait until every group's hosts answer; raises (Monarch gives up after about a minute) if not."""
        await asyncio.gather(*(mesh.initialized for name, mesh in self.meshes.items() if name))

    def of(self, role: str):
        """The role's whole group, for ranks spread over its hosts."""
        return self.meshes[self.placement[role].group]

    def slot(self, role: str, index: int) -> int:
        """Which host of the role's group replica `index` goes on: host index % hosts, or, if that host is
        lost, the next one of the group that is not. RuntimeError (one line) if every host of it is lost."""
        count, lost = self.of(role).sizes.get("hosts", 1), self.lost.get(self.placement[role].group, set())
        for k in range(count):
            if (index + k) % count not in lost:
                return (index + k) % count
        raise RuntimeError(f"every host of group {self.placement[role].group!r} is lost")

    def host(self, role: str, index: int):
        """One host of the role's group for replica `index` (`slot`, remembered for `lose`)."""
        if "hosts" not in self.of(role).sizes:
            return self.of(role)
        self.placed[(role, index)] = self.slot(role, index)
        return self.on(role, self.placed[(role, index)])

    def on(self, role: str, slot: int):
        """Host `slot` of the role's group (a host mesh of one host)."""
        mesh = self.of(role)
        return mesh.slice(hosts=slot) if "hosts" in mesh.sizes else mesh

    def lose(self, role: str, index: int, error: BaseException, slot: int | None = None) -> bool:
        """The host that replica `index` of `role` was last given (or host `slot` of its group) could not start a
        process (`error`): True if it is taken as lost, the replicas (and a generator host's relay) that would go
        there going to the group's other hosts from then on, said in one warning line; False if it is the
        group's last host, with nowhere else to go."""
        group = self.placement[role].group
        slot = self.placed.get((role, index), index) if slot is None else slot
        lost = self.lost.setdefault(group, set())
        if slot in lost:  # another start found it lost first
            return True
        if not group or len(lost) + 1 >= self.of(role).sizes.get("hosts", 1):
            return False
        lost.add(slot)
        why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        logger.warning("host %d of group %s is lost (%s): what ran there starts on the group's other hosts", slot,
                       group, why)
        return True

    def kill(self) -> None:
        self.job.kill()
