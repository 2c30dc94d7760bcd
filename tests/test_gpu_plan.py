"""The GPU plan (pure logic): which GPUs each generator replica and trainer rank takes on hosts of
several shapes, what a process is given, and that a CPU run is planned as before."""

import os

import pytest
import torch

from meshrl.actors.distributed import join
from meshrl.configs import load_config
from meshrl.runtime.gpu_plan import plan_gpus
from meshrl.runtime.jobs import plan


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
        gpus(4, generator__replicas=2, generator__tensor_parallel_size=2, trainer__ranks=2)
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
