"""Placement without a cluster: the plan each config makes of its roles (pure logic), the Slurm and
Kubernetes configs checked by `meshrl train --dry-run`, and the weight ring's same-host decision,
which must follow the machine and its namespaces, not the host name."""

import json
import mmap
import os
import socket
import subprocess
import sys
import textwrap

import psutil
import pytest
from netns_hosts import namespace_hosts, usable

from meshrl.configs.named import load_config
from meshrl.runtime.jobs import RolePlacement, host_groups, plan
from meshrl.weight_sync.ring import host_id, same_host


def placed(**overrides) -> dict:
    args = [a for k, v in overrides.items() for a in (f"--{k.replace('__', '.')}", str(v))]
    return plan(load_config("smoke", args))


def test_local_jobs_put_every_role_on_the_controllers_host():
    assert set(placed().values()) == {RolePlacement("", 1, 1)}
    # a local job ignores host groups: one machine
    assert placed(trainer__hosts="trainer")["trainer"] == RolePlacement("", 1, 1)


def test_ranks_spread_over_their_group_and_replicas_go_round_robin():
    p = placed(job__kind="process", job__hosts="trainer:2,gen:3", trainer__hosts="trainer", trainer__ranks=4,
               generator__hosts="gen", generator__replicas=4)
    assert p["trainer"] == RolePlacement("trainer", 2, 2)
    assert p["generator"] == RolePlacement("gen", 3, 2)  # 4 replicas over 3 hosts: at most 2 on one
    assert p["grader"] == RolePlacement("", 1, 1)
    assert "reference" not in p  # no KL penalty, no reference model
    assert placed(job__kind="process", job__hosts="a:1", trainer__loss__kl_coef=0.1, reference__hosts="a")[
        "reference"] == RolePlacement("a", 1, 1)
    assert host_groups(load_config("smoke", ["--job.hosts", " a:1, b:12 "]).job) == {"a": 1, "b": 12}


@pytest.mark.parametrize("overrides, message", [
    (dict(job__kind="mpi"), "unknown job.kind 'mpi'"),
    (dict(job__kind="process"), "job.kind process needs job.hosts"),
    (dict(job__kind="process", job__hosts="trainer"), "each group is NAME:COUNT"),
    (dict(job__kind="process", job__hosts="a:1,a:2"), "each group is NAME:COUNT"),
    (dict(job__kind="process", job__hosts="a:0"), "each group is NAME:COUNT"),
    (dict(job__kind="process", job__hosts="a:1", trainer__hosts="b"), "trainer.hosts 'b' is not a group of job.hosts"),
    (dict(job__kind="process", job__hosts="a:2", trainer__hosts="a", trainer__ranks=3),
     "trainer.ranks (3) must be a multiple of the hosts in its group 'a' (2)"),
    (dict(job__kind="workers", job__hosts="a:2", job__workers="tls://x:1"), "job.workers names 1 worker addresses"),
    (dict(job__kind="workers", job__hosts="a:1", job__workers="tcp://x:1"),
     "tcp://x:1 is not a TLS address: start workers with `meshrl worker --address tls://HOST:PORT --tls DIR` (or set "
     "job.tls.insecure true to trust every connection)"),
    (dict(job__kind="workers", job__hosts="a:1", job__workers="tls://x:1"),
     "job.kind workers attaches over mutual TLS: set job.tls.ca, job.tls.cert, job.tls.key (`meshrl certs DIR` "
     "makes them), or job.tls.insecure true to trust every connection"),
    (dict(job__kind="workers", job__hosts="a:1", job__workers="tls://x:1", job__tls__ca="/nope/ca.crt",
          job__tls__cert="/nope/tls.crt", job__tls__key="/nope/tls.key"), "job.tls.ca /nope/ca.crt does not exist"),
    (dict(job__kind="workers", job__hosts="a:1", job__workers="tls://x:1", job__tls__insecure=True),
     "job.tls.insecure attaches over plain TCP: tls://x:1 is not a tcp:// address"),
    (dict(job__kind="kubernetes", job__hosts="gen_hosts:1"), "Kubernetes meshes need lowercase letters and digits"),
    (dict(job__kind="slurm", job__hosts="a:1", job__slurm__time_limit="1 hour"), "is not HH:MM:SS"),
])
def test_placements_that_cannot_work_are_one_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        placed(**overrides)


@pytest.mark.processes
@pytest.mark.parametrize("config, kind", [("sum_digits_smollm2_slurm", "slurm"),
                                          ("sum_digits_smollm2_kubernetes", "kubernetes")])
def test_cluster_configs_are_checked_by_a_dry_run_without_a_cluster(config, kind, tmp_path):
    """In a process of its own: a Slurm or Kubernetes job object switches its process to Monarch's TCP
    transport (meshrl/runtime/jobs.py's make_job), which later actors spawned in this one could not use."""
    run = [sys.executable, "-m", "meshrl", "train", "--config", config, "--run-dir", str(tmp_path),
           "--model.source", "tiny", "--dry-run"]
    result = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0] == f"job: {kind}, host groups trainer (1 host), generators (1 host)"
    assert "trainer: 1 rank, 1 per host on group trainer (1 host)" in lines
    assert any(line.startswith("generator: 1 replica") and line.endswith("on group generators (1 host)")
               for line in lines)
    assert "replay_buffer: fifo, one process on the controller's host" in lines
    assert lines[-1] == "checked; nothing started (--dry-run)"
    assert not list(tmp_path.iterdir())  # nothing written, nothing launched
    # the same check refuses a placement that cannot work, in one line
    bad = subprocess.run(run + ["--job.hosts", "trainer:1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "meshrl: error: generator.hosts 'generators' is not a group of job.hosts (trainer:1)"


@pytest.mark.processes
@pytest.mark.skipif(bool(usable()), reason=usable())
def test_workers_hosts_report_their_gpus_by_group(tmp_path):
    """`job.kind workers` asks each attached host how many GPUs it has (one short-lived process a host);
    these hosts, in network namespaces of this CPU machine, have none. In a process of its own: attaching
    switches its process to Monarch's TCP transport."""
    with namespace_hosts(2, tmp_path, tls=False) as hosts:
        args = ["--job.kind", "workers", "--job.workers", ",".join(hosts.addresses), "--job.bind", hosts.bind,
                *hosts.job_args, "--job.hosts", "trainer:1,generators:1", "--trainer.hosts", "trainer",
                "--generator.hosts", "generators"]
        ask = textwrap.dedent(f"""
            import asyncio, json
            from pathlib import Path
            from meshrl.configs.named import load_config
            from meshrl.runtime.gpu_plan import plan_gpus
            from meshrl.runtime.jobs import Hosts, gpus_per_host, host_gpus, make_job, plan

            async def main():
                config = load_config("smoke", {args!r})
                placement = plan(config)
                print(plan_gpus(config, placement, gpus_per_host(config.job)).describe()[0])
                job = make_job(config.job, Path({str(tmp_path)!r}))
                hosts = Hosts(job, placement)
                await hosts.connected()
                print(json.dumps(await host_gpus(hosts), sort_keys=True))
                job.kill()

            asyncio.run(main())
        """)
        result = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        before, reported = result.stdout.splitlines()[-2:]
        assert before == "gpus: planned at the start, from the GPUs each host reports (job.gpus_per_host sets them)"
        assert json.loads(reported) == {"": 0, "generators": 0, "trainer": 0}
        assert all(not psutil.Process(w.pid).children(recursive=True) for w in hosts.workers)  # the askers stopped


@pytest.mark.processes
def test_the_same_host_is_the_same_machine_and_namespaces_not_the_same_host_name():
    fd = os.memfd_create("ring")
    os.ftruncate(fd, 4096)
    memory = mmap.mmap(fd, 4096)  # noqa: F841 (kept mapped while the readers look)
    assert same_host(host_id(), os.getpid(), fd)
    assert not same_host("another-boot-id" + host_id()[36:], os.getpid(), fd)  # another machine
    assert not same_host(host_id(), os.getpid(), fd + 1000)  # no such ring in that process
    reader = textwrap.dedent(f"""
        import socket
        from meshrl.weight_sync.ring import same_host
        print(socket.gethostname(), same_host({host_id()!r}, {os.getpid()}, {fd}))
    """)
    here = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, timeout=60)
    assert here.stdout.split() == [socket.gethostname(), "True"], here.stderr
    if usable():
        pytest.skip(usable())
    # a reader in a network namespace of its own: another host with the same host name, the same
    # kernel and even the ring's file in reach; it must still read over RDMA
    there = subprocess.run(["unshare", "--net", sys.executable, "-c", reader], capture_output=True, text=True,
                           timeout=60)
    assert there.stdout.split() == [socket.gethostname(), "False"], there.stderr


@pytest.mark.processes
@pytest.mark.parametrize("config, model, generators", [
    ("qwen3_0_6b_gsm8k", "Qwen3-0.6B", "0 | 1 | 2 | 3 | 4 | 5 | 6 | 7"),
    ("qwen3_8b_gsm8k", "Qwen3-8B", "0,1 | 2,3 | 4,5 | 6,7")])
def test_the_qwen3_cluster_configs_plan_their_gpus_in_a_dry_run(config, model, generators, tmp_path):
    """The GPU examples, with a tiny Qwen3 and a small file standing in for the user's model and GSM8K."""
    files = {}
    for name, first in (("train", 0), ("validation", 10), ("test", 20)):  # prompts of their own
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(f'{{"question": "What is {i} + {i}?", "answer": "{2 * i}"}}\n'
                                       for i in range(first, first + 4)))
    data = ["--dataset.path", str(files["train"]), "--dataset.eval_path", str(files["validation"]),
            "--dataset.test_path", str(files["test"])]
    run = [sys.executable, "-m", "meshrl", "train", "--config", config, "--run-dir", str(tmp_path / "run"), "--dry-run"]
    result = subprocess.run(run + ["--model.source", "tiny_qwen3", *data], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"gpus: generator replicas' CUDA_VISIBLE_DEVICES, replica 0 first: {generators}" in result.stdout
    trainer = " ".join(f"cuda:{g}" for g in range(8))  # the trainer's node to itself
    assert f"gpus: trainer ranks on each host, local rank 0 first: {trainer}" in result.stdout
    # as shipped, the config points at the user's download: one line says what is missing
    missing = subprocess.run(run + data, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2
    assert missing.stderr.strip().startswith(f"meshrl: error: model {model!r} not found")
