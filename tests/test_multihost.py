"""`meshrl train` across hosts (real Monarch workers over mutual TLS, vLLM, torchtitan, tiny model):
the trainer on one host and the generator on another pull weights over RDMA (the TCP fallback here)
to the last step; a controller whose key the workers' CA did not sign spawns nothing on them; and
calls that stall end as timeouts (a replica replaced, the trainer restarted), never as a hang,
with no process left behind."""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest
from assertions import assert_final_policy_is_the_trained_one, assert_staleness_bound, read_jsonl
from netns_hosts import leftovers, namespace_hosts, usable

from meshrl.actors import resolve_device
from meshrl.actors.dtypes import bf16_choice
from meshrl.tools.chaos import steps_logged

pytestmark = pytest.mark.processes

STEPS_LOST_HOST = 100  # to outlast the replacement starting on the host left (~1 s a step; a new vLLM: 30-60 s)
TWO_HOSTS = ["--job.hosts", "trainer:1,generators:1", "--trainer.hosts", "trainer", "--generator.hosts", "generators"]


@pytest.mark.skipif(bool(usable()), reason=usable())
def test_training_across_hosts_in_their_own_network_namespaces_pulls_weights_over_rdma(tmp_path):
    """Two trainer ranks on two hosts (FSDP2 over gloo between them), the generator on a third reading
    both ranks' rings."""
    run_dir = tmp_path / "run"
    with namespace_hosts(3, tmp_path) as hosts:
        result = subprocess.run(
            [sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
             "--controller.steps", "3", "--weight_sync.checksums", "true", "--job.kind", "workers",
             "--job.workers", ",".join(hosts.addresses), "--job.bind", hosts.bind, *hosts.job_args, *TWO_HOSTS,
             "--job.hosts", "trainer:2,generators:1", "--trainer.ranks", "2", "--trainer.num_threads", "1"],
            capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    assert not leftovers(hosts), leftovers(hosts)  # namespaces, links, workers and their actors all gone
    placement = json.loads((run_dir / "placement.json").read_text())
    *trainer_hosts, generator_host = hosts.names
    assert placement["trainer"] == {"host": trainer_hosts}  # rank r on host r
    assert placement["generator"] == {"host": generator_host, "weight_transport": "rdma"}
    assert placement["grader"]["host"] not in hosts.names  # the controller's
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["policy_version"] == 3
    # each step trained completions sampled from the version before it: pulled across the hosts
    # (checksums on: every pulled version was verified before vLLM loaded it)
    assert_staleness_bound(rows, read_jsonl(run_dir / "rollouts.jsonl"), 0)
    spans = read_jsonl(run_dir / "trace.jsonl")  # the generator pulled every version the final eval needs
    assert sorted(s["policy_version"] for s in spans if s["what"] == "pull") == [1, 2, 3]
    assert_final_policy_is_the_trained_one(run_dir)


@pytest.mark.skipif(bool(usable()), reason=usable())
def test_a_controller_the_workers_ca_did_not_sign_spawns_nothing_on_them(tmp_path):
    marker = tmp_path / "spawned"
    with namespace_hosts(1, tmp_path, env={"MESHRL_TEST_MARKER": str(marker)}) as hosts:
        stranger = tmp_path / "stranger"  # a CA and key of its own, for the same host names
        subprocess.run([sys.executable, "-m", "meshrl", "certs", str(stranger), "--hosts",
                        ",".join(hosts.names + [hosts.bind.split("://")[1].rsplit(":", 1)[0]])], check=True)
        tls = ["--job.tls.ca", f"{stranger}/ca.crt", "--job.tls.cert", f"{stranger}/tls.crt", "--job.tls.key",
               f"{stranger}/tls.key"]
        result = subprocess.run(
            [sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(tmp_path / "run"),
             "--job.kind", "workers", "--job.workers", hosts.addresses[0], "--job.bind", hosts.bind, *tls,
             "--job.hosts", "generators:1", "--generator.hosts", "generators", "--job.connect_timeout_s", "10",
             "--generator.impl", "faulty_actors:MarkingGenerator"], capture_output=True, text=True, timeout=300)
        worker_children = psutil.Process(hosts.workers[0].pid).children(recursive=True)
        assert [p for p in worker_children if "meshrl" not in " ".join(p.cmdline())] == []  # no proc spawned
    assert result.returncode != 0 and not marker.exists()
    errors = [line for line in result.stderr.splitlines() if line.startswith("meshrl: error:")]
    assert len(errors) == 1 and "did not start: no answer from its workers within job.connect_timeout_s" in errors[0]
    assert not leftovers(hosts), leftovers(hosts)



@pytest.mark.skipif(bool(usable()), reason=usable())
@pytest.mark.skipif(not os.environ.get("MESHRL_TEST_LOST_HOST"), reason="run alone: MESHRL_TEST_LOST_HOST=1 (under "
                    "the whole suite's load a spawn on the live host ran past the 10 s limit and the run failed)")
def test_a_generator_host_lost_with_everything_on_it_moves_its_replica_and_the_run_ends_whole(tmp_path):
    """The trainer on one namespace host, a generator replica and a weight relay on each of two others; once two
    steps are logged one generator host's worker and every process under it are SIGKILLed at once. The
    replica is found dead (Monarch's supervision, or its call's generator.timeout_s); its replacement cannot
    start on the lost host (one line: the host is lost) and starts on the other generator host, and so does
    the lost host's relay; the run ends by itself with every step once and the restart counted."""
    run_dir = tmp_path / "run"
    with namespace_hosts(3, tmp_path) as hosts:
        run = subprocess.Popen(
            [sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
             "--controller.steps", str(STEPS_LOST_HOST), "--job.kind", "workers", "--job.workers",
             ",".join(hosts.addresses), "--job.bind", hosts.bind, *hosts.job_args, *TWO_HOSTS,
             "--job.hosts", "trainer:1,generators:2", "--generator.replicas", "2", "--weight_sync.relay", "on",
             "--generator.timeout_s", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE": "10s"})  # a spawn on the lost host gives up
        try:
            deadline = time.monotonic() + 300
            while steps_logged(run_dir) < 2 and run.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert run.poll() is None and steps_logged(run_dir) >= 2, run.communicate()[1][-3000:]
            before, before_pids = (json.loads((run_dir / name).read_text()) for name in ("placement.json",
                                                                                        "processes.json"))
            lost_name = before["generator1"]["host"]
            worker = psutil.Process(hosts.workers[hosts.names.index(lost_name)].pid)
            for victim in [worker, *worker.children(recursive=True)]:  # the host's every process, at once
                victim.kill()
            _, stderr = run.communicate(timeout=400)
        finally:
            if run.poll() is None:
                run.kill()
        assert run.returncode == 0, stderr[-3000:]
    assert not leftovers(hosts), leftovers(hosts)
    trainer_host, kept_host, lost_host = hosts.names
    assert lost_name == lost_host and before["relay1"]["host"] == lost_host and before["relay0"]["host"] == kept_host
    assert [line for line in stderr.splitlines() if "generator 1 (pid" in line and "); replacing it" in line]
    assert stderr.count("host 1 of group generators is lost (") == 1, stderr[-3000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS_LOST_HOST + 1))
    assert rows[-1]["generator_restarts"] >= 1 and rows[0]["generator_restarts"] == 0
    # the replacement runs on the generator host left, beside its relay, and reads that relay's ring
    placement, pids = (json.loads((run_dir / name).read_text()) for name in ("placement.json", "processes.json"))
    assert placement["generator1"]["host"] == placement["generator0"]["host"] == kept_host, placement
    assert placement["relay0"]["host"] == placement["relay1"]["host"] == kept_host, placement
    assert pids["relay1"] != before_pids["relay1"] and pids["generator1"] != before_pids["generator1"]
    assert placement["generator1"]["weight_transport"] == placement["generator0"]["weight_transport"]
    assert placement["trainer"]["host"] == trainer_host


def test_a_stalled_pull_replaces_the_replica_and_a_stalled_trainer_is_restarted(tmp_path):
    """On Monarch's local process job (trainer and generator on worker processes of their own)."""
    stall_dir = tmp_path / "stall"
    stall_dir.mkdir()
    run = subprocess.Popen(
        [sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(tmp_path / "run"),
         "--controller.steps", "4", "--job.kind", "process", *TWO_HOSTS,
         "--generator.impl", "faulty_actors:StallingPullGenerator", "--weight_sync.timeout_s", "5",
         "--trainer.impl", "faulty_actors:StallingTrainer", "--trainer.timeout_s", "15"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "MESHRL_TEST_STALL_DIR": str(stall_dir)})
    actors = []
    try:
        deadline = time.monotonic() + 300
        while not (stall_dir / "pull-stalled").exists() and run.poll() is None and time.monotonic() < deadline:
            actors = psutil.Process(run.pid).children(recursive=True) or actors
            time.sleep(0.5)
        _, stderr = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    run_dir = tmp_path / "run"
    # the generator's hung pull broke its replica within weight_sync.timeout_s: the group waiting for it
    # was redone on the replacement, which loaded the version
    assert "generator 0 (pid" in stderr and ("its weight pull did not finish within 5 s (weight_sync.timeout_s)); "
                                            "replacing it") in stderr, stderr[-3000:]
    spans = read_jsonl(run_dir / "trace.jsonl")
    assert any(5 <= s["end"] - s["start"] < 8 for s in spans if s["what"] == "generate")
    pulls = [s for s in spans if s["what"] == "pull"]
    assert pulls and pulls[0]["policy_version"] == 1, pulls
    # the trainer's stalled optimizer step (step 2's) was a failure named in one line; the trainer was
    # restarted on its host from the initial policy, trained step 1's batch again, and the run went on
    assert run.returncode == 0, stderr[-3000:]
    assert ("the trainer failed (trainer did not answer its optim_step call within 15 s (trainer.timeout_s)); "
            "restarting it from the initial policy and training again the 1 step(s) since") in stderr
    assert "Traceback" not in stderr
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["policy_version"] for r in rows] == [1, 2, 3, 4]
    assert [r["trainer_restarts"] for r in rows] == [0, 1, 1, 1]
    assert json.loads((run_dir / "placement.json").read_text())["generator"]["weight_transport"] == "shm"
    # the generator's and the trainer's dtypes were decided on their own hosts (a probe actor each), by the rule
    chosen, rule = json.loads((run_dir / "summary.json").read_text())["dtypes"], bf16_choice(resolve_device("auto"), 1)
    assert chosen["generator"]["reason"] == chosen["trainer"]["reason"] == rule.reason
    time.sleep(1)
    assert actors and not [p for p in actors if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
