"""The `job` section: which kind of Monarch job places the roles, its host groups, and the settings of
Slurm and Kubernetes jobs (meshrl/runtime/jobs.py places the roles on them)."""

from dataclasses import dataclass, field


@dataclass
class SlurmConfig:
    """Monarch's SlurmJob: one sbatch allocation, its nodes split into the host groups in order."""

    partition: str = ""  # "": the cluster's default
    time_limit: str = ""  # HH:MM:SS; "": the partition's default
    account: str = ""  # "": the cluster's default
    qos: str = ""  # "": the cluster's default
    gpus_per_node: int = 0  # 0: none requested
    cpus_per_task: int = 0  # 0: Slurm's default
    mem: str = ""  # memory per node, e.g. "200G"; "": Slurm's default
    python_exe: str = "python"  # the nodes' Python, with meshrl installed
    job_name: str = "meshrl"
    port: int = 22222  # the port Monarch's workers listen on
    exclusive: bool = True  # whole nodes
    start_timeout_s: int = 0  # how long to wait in the queue; 0: as long as it takes
    sbatch_args: str = ""  # more sbatch arguments, e.g. "--constraint=h100 --reservation=rl"


@dataclass
class KubernetesConfig:
    """Monarch's KubernetesJob: one MonarchMesh (a set of pods) per host group."""

    namespace: str = "default"
    image: str = ""  # provision pods from this image (meshrl installed) through Monarch's operator; "": attach to running pods labelled monarch.pytorch.org/mesh-name=GROUP
    gpus_per_pod: int = 0  # nvidia.com/gpu per provisioned pod
    port: int = 26600  # the port Monarch's workers listen on
    kubeconfig: str = ""  # "": the in-cluster configuration
    start_timeout_s: int = 0  # how long to wait for the pods; 0: as long as it takes


@dataclass
class TlsConfig:
    """Mutual TLS between this controller and Monarch workers (`job.kind workers`): files from
    `meshrl certs DIR`. Workers spawn whatever a connecting client asks: without TLS, anyone who can
    reach their ports can run code on them."""

    ca: str = ""  # the CA certificate both sides check the other's certificate against (DIR/ca.crt)
    cert: str = ""  # this controller's certificate, signed by that CA (DIR/tls.crt)
    key: str = ""  # its private key (DIR/tls.key)
    insecure: bool = False  # attach to workers over plain TCP, trusting every connection (one warning line)


@dataclass
class JobConfig:
    """Where the roles run (meshrl/runtime/jobs.py): the kind of job, its host groups, and each kind's settings."""

    kind: str = "local"  # local (this host) | process (a local worker process per host) | workers (Monarch workers at job.workers) | slurm | kubernetes
    hosts: str = ""  # host groups and their host counts, e.g. "trainer:1,generators:2"; roles pick one with their `hosts`
    workers: str = ""  # kind workers: the workers' addresses, the groups' hosts in order ("tls://node1:26600,tls://node2:26600")
    gpus_per_host: int = 0  # GPUs of each host the roles share (meshrl/runtime/gpu_plan.py); 0: slurm.gpus_per_node, kubernetes.gpus_per_pod, this host's own for local and process jobs, what each host reports at start for workers (none: the CPU)
    gpu_memory_gib: float = 0.0  # each GPU's memory, which the memory plan (meshrl/runtime/memory_plan.py) checks every GPU's share against; 0: this host's own GPUs' for local and process jobs, else 80 (an H100's or A100's 80 GB)
    host_memory_gib: float = 0.0  # each host's memory the roles may take, which the memory plan checks each host against; 0: this host's own for local and process jobs, else 1024
    gpu_sharing: str = "auto"  # auto (roles share a host's GPUs, each with a memory share, only where it has too few for one per process) | on (the same; resolved.json's where auto shared) | off (one GPU per process, else an error)
    bind: str = ""  # kind workers: the address the workers reach this controller at ("tls://10.0.0.1:0"); "": on this host's name
    tls: TlsConfig = field(default_factory=TlsConfig)
    connect_timeout_s: float = 300.0  # kind workers: how long the workers may take to answer the attach (0: no limit)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)

    def check(self) -> None:
        """The memory plan's sizes (meshrl/runtime/jobs.py checks the kind's own settings when it places roles)."""
        for name in ("gpu_memory_gib", "host_memory_gib"):
            if getattr(self, name) < 0:
                raise ValueError(f"job.{name} must be 0 (this host's own) or above, not {getattr(self, name):g}")
