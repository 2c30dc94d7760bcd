"""The GPU plan (pure logic): which GPUs each generator replica and trainer rank takes on hosts of
several shapes (one GPU shared by every role, 8 GPUs per host the usual ways, groups of hosts with their
own GPU counts), what a process is given, and that a CPU run is planned as before."""

import os

import pytest
import torch

from meshrl.actors.distributed import join
from meshrl.configs.named import load_config
from meshrl.runtime.gpu_plan import plan_gpus
from meshrl.runtime.jobs import group_gpus, plan


def gpus(gpus_per_host: int, **overrides):
    args = [a for k, v in overrides.items() for a in (f"--{k.replace('__', '.')}", str(v))]
    config = load_config("smoke", args)
    return config, plan_gpus(config, plan(config), gpus_per_host)


def test_eight_gpus_host_eight_replicas_of_tp1_or_two_of_tp4():
    hosts = dict(job__kind="process", job__hosts="t:1,g:1", trainer__hosts="t", generator__hosts="g")
    _, p = gpus(8, generator__replicas=8, **hosts)
    assert p.generators == [str(g) for g in range(8)]
    _, p = gpus(8, generator__replicas=2, generator__tensor_parallel_size=4, **hosts)
    assert p.generators == ["0,1,2,3", "4,5,6,7"]
    assert p.trainer == [0]  # alone on its own host


def test_a_shared_host_gives_the_trainer_the_gpus_the_replicas_leave():
    config, p = gpus(8, generator__replicas=2, generator__tensor_parallel_size=2, trainer__ranks=4)
    assert p.generators == ["0,1", "2,3"] and p.trainer == [4, 5, 6, 7]
    planned = p.apply(config)
    assert planned.generator.devices == "0,1;2,3" and planned.trainer.device == "cuda:4;cuda:5;cuda:6;cuda:7"
    assert config.generator.devices == "" and config.trainer.device == "auto"  # the run's own config unchanged
    # with a KL penalty the reference's ranks come after the trainer's
    _, p = gpus(8, generator__replicas=2, trainer__ranks=2, trainer__loss__kl_coef=0.1, reference__ranks=2)
    assert (p.generators, p.trainer, p.reference) == (["0", "1"], [2, 3], [4, 5])


def test_replicas_round_robin_over_hosts_take_the_same_gpus_on_each():
    _, p = gpus(4, job__kind="process", job__hosts="t:1,g:2", trainer__hosts="t", generator__hosts="g",
                generator__replicas=4, generator__tensor_parallel_size=2)
    # replicas 0 and 2 on host 0, 1 and 3 on host 1: each host's GPUs 0-1 then 2-3
    assert p.generators == ["0,1", "0,1", "2,3", "2,3"]
    _, p = gpus(2, job__kind="process", job__hosts="all:2", trainer__hosts="all", generator__hosts="all",
                trainer__ranks=2, generator__replicas=2)
    assert p.generators == ["0", "0"] and p.trainer == [1]  # one replica and one rank per host


def test_too_few_gpus_is_one_clear_error_and_a_users_own_devices_win():
    with pytest.raises(ValueError, match="each host of the controller's host has 4 GPUs; the processes placed there need 6"):
        gpus(4, generator__replicas=2, generator__tensor_parallel_size=2, trainer__ranks=2, job__gpu_sharing="off")
    # where even sharing cannot work: a replica's GPUs, and a role's ranks, must be GPUs of their own
    with pytest.raises(ValueError, match="generator.tensor_parallel_size 4: a replica needs 4 GPUs of one host, and "
                                         "each host of the controller's host has 2"):
        gpus(2, generator__tensor_parallel_size=4)
    with pytest.raises(ValueError, match="has 2 GPUs and 1 generator replica x tensor_parallel_size 1, 4 trainer ranks: "
                                         "the trainer's 4 need GPUs of their own"):
        gpus(2, trainer__ranks=4)
    config, p = gpus(8, generator__replicas=2, generator__devices="6;7", trainer__device="cuda:0")
    planned = p.apply(config)
    assert planned.generator.devices == "6;7" and planned.trainer.device == "cuda:0"


def test_hosts_without_gpus_plan_nothing_and_a_cpu_run_is_unchanged():
    config, p = gpus(0, generator__replicas=2, trainer__ranks=2)
    assert (p.generators, p.trainer, p.reference) == ([], [], [])
    assert p.apply(config) == config
    assert p.describe() == ["gpus: none (every role on the CPU)"]


def test_a_rank_takes_the_device_of_its_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)  # no GPU here: record what it would set
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    try:
        assert join("cpu;cuda:5", cpus, torch.get_num_threads()).device == torch.device("cuda", 5)
        assert chosen == [torch.device("cuda", 5)]
    finally:
        os.sched_setaffinity(0, set(map(int, cpus.split(","))))


def test_one_gpu_is_shared_by_the_generator_the_trainer_and_the_reference():
    """A smoke run on a 1-GPU host (tests/test_devices.py::test_smoke_trains_on_the_gpu): every role on GPU 0,
    vLLM taking 0.9 / 3 processes of it and sleeping while the synchronous step trains."""
    config, p = gpus(1, trainer__loss__kl_coef=0.1)
    assert (p.generators, p.trainer, p.reference) == (["0"], [0], [0])
    assert p.memory_fraction == 0.3 and p.sleep
    planned = p.apply(config)
    assert planned.generator.devices == "0" and planned.generator.memory_fraction == 0.3
    assert planned.generator.engine.sleep == "on"  # smoke trains synchronously (max_policy_age 0)
    assert (planned.trainer.device, planned.reference.device) == ("cuda:0", "cuda:0")
    assert p.describe()[-3:] == [
        "gpus: shared (job.gpu_sharing auto): each host of the controller's host has 1 GPU for 1 generator replica "
        "x tensor_parallel_size 1, 1 trainer rank, 1 reference rank",
        "gpus: vLLM takes 0.30 of each GPU it shares (generator.memory_fraction unless set); it sleeps while a "
        "synchronous step trains (generator.engine.sleep auto)",
        "gpus: the weight ring's slots in the trainer's GPU memory, read by the generators by CUDA IPC "
        "(weight_sync.memory)"]
    assert planned.weight_sync.memory == "device"  # the trainer and the generator on one host's GPU
    # two GPUs: the trainer gets one to itself, the reference wraps around to the generator's
    config, p = gpus(2, trainer__loss__kl_coef=0.1)
    assert (p.generators, p.trainer, p.reference, p.memory_fraction) == (["0"], [1], [0], 0.45)
    # one step ahead (max_policy_age 1) the engine generates while the step trains: no sleep; a user's settings win
    config, p = gpus(1, controller__max_policy_age=1, generator__memory_fraction=0.25)
    planned = p.apply(config)
    assert planned.generator.engine.sleep == "off" and planned.generator.memory_fraction == 0.25
    assert p.memory_fraction == 0.45  # generator and trainer


def test_eight_gpus_per_host_the_usual_ways():
    """Disaggregated on one host: replicas x tensor_parallel_size, then the trainer's ranks, then the
    reference's, each GPU to one process, vLLM taking 0.9 of its own; and on two hosts, the generators on
    one group's host and the trainer's 8 ranks on the other's."""
    config, p = gpus(8, generator__replicas=4, trainer__ranks=4)
    assert (p.generators, p.trainer, p.memory_fraction, p.sleep, p.shared) == (["0", "1", "2", "3"], [4, 5, 6, 7],
                                                                                 0.9, False, [])
    assert p.apply(config).generator.engine.sleep == "off"
    _, p = gpus(8, generator__replicas=2, generator__tensor_parallel_size=2, trainer__ranks=2,
                trainer__loss__kl_coef=0.1, reference__ranks=2)
    assert (p.generators, p.trainer, p.reference) == (["0,1", "2,3"], [4, 5], [6, 7])
    _, p = gpus(8, job__kind="process", job__hosts="trainer:1,generators:1", trainer__hosts="trainer",
                generator__hosts="generators", generator__replicas=4, generator__tensor_parallel_size=2,
                trainer__ranks=8)
    assert p.generators == ["0,1", "2,3", "4,5", "6,7"] and p.trainer == list(range(8)) and not p.shared
    # two trainer hosts of 8 ranks each beside a generator host: each host's ranks on its GPUs 0-7
    _, p = gpus(8, job__kind="process", job__hosts="trainer:2,generators:1", trainer__hosts="trainer",
                generator__hosts="generators", generator__replicas=8, trainer__ranks=16)
    assert p.generators == [str(g) for g in range(8)] and p.trainer == list(range(8))


def test_each_group_is_planned_with_its_own_hosts_gpus():
    """Counts per group, as `workers` hosts report them: a group without GPUs plans none for its roles."""
    config = load_config("smoke", ["--job.kind", "process", "--job.hosts", "t:1,g:1", "--trainer.hosts", "t",
                                   "--generator.hosts", "g", "--generator.replicas", "2",
                                   "--generator.tensor_parallel_size", "2"])
    p = plan_gpus(config, plan(config), {"": 0, "t": 8, "g": 4})
    assert (p.generators, p.trainer) == (["0,1", "2,3"], [0])
    p = plan_gpus(config, plan(config), {"": 0, "t": 0, "g": 4})
    assert (p.generators, p.trainer) == (["0,1", "2,3"], [])
    assert p.apply(config).trainer.device == "auto"  # the trainer's host has none: its CPU
    with pytest.raises(ValueError, match="each host of group 'g' has 2 GPUs and 2 generator replicas"):
        plan_gpus(config, plan(config), {"": 0, "t": 8, "g": 2})


def test_hosts_of_a_group_that_report_different_gpu_counts_are_one_clear_error():
    assert group_gpus({"": [0], "trainer": [8, 8], "generators": [4]}) == {"": 0, "trainer": 8, "generators": 4}
    with pytest.raises(ValueError, match=r"the hosts of group 'trainer' report different GPU counts \(8, 7, in host "
                                         r"order\): set job.gpus_per_host"):
        group_gpus({"": [0], "trainer": [8, 7]})
