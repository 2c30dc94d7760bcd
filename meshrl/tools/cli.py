"""`meshrl` command line: train, eval, report, study, bench, check, prepare-model, configs."""

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from meshrl.configs import ConfigError
from meshrl.configs.named import CONFIGS, load_config
from meshrl.configs.overrides import help_text
from meshrl.models.model import ModelError, resolve_checkpoint
from meshrl.tools.checks import gpu as check_gpu

MODEL_HELP = "smollm2, a tiny stand-in (tiny, tiny_qwen3, tiny_qwen3_moe), or an HF checkpoint directory"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run RL training", add_help=False,
                           epilog="Any config field can be overridden: --trainer.lr 1e-5 --controller.steps=5; "
                                  "`meshrl train --config NAME --help` lists every field.")
    train.add_argument("--config", help=f"one of: {', '.join(sorted(CONFIGS))}")
    train.add_argument("--run-dir", type=Path, help="where metrics, plots and the final policy go "
                                                    "(default: runs/CONFIG-TIME)")
    train.add_argument("--resume", type=Path, metavar="RUN_DIR",
                       help="continue RUN_DIR from its newest complete checkpoint with its own config; overrides "
                            "only of what does not change the computation (controller.steps, placement, logging, "
                            "checkpoints, timeouts)")
    train.add_argument("--dry-run", action="store_true", help="check the config, the model and the placement "
                                                              "of every role, print the plan, start nothing")
    train.add_argument("--supervise", action="store_true", help="run the controller under a small parent process "
                       "that starts it again from its newest checkpoint if its process is killed (SIGKILL, a crash; "
                       "at most 3 times in a row); Ctrl-C and SIGTERM still stop the run (docs/running.md)")
    train.add_argument("--plan-only", action="store_true", help="print the placement, the GPU plan and each GPU's and "
                       "host's memory (docs/memory.md) without the checkpoint or a GPU; exit 1 if it cannot fit")
    prepare = sub.add_parser("prepare-model", help="convert the embedded model once (cached) and print its path")
    prepare.add_argument("--source", default="smollm2", help=MODEL_HELP)
    sub.add_parser("configs", help="list the named configs")
    report = sub.add_parser("report", help="summarize runs side by side and redraw their plots")
    report.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    chaos = sub.add_parser("chaos", help="SIGKILL the actor processes of a running train, every role in turn, to "
                                         "see that it survives each (processes on this machine)")
    chaos.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the running train's --run-dir")
    chaos.add_argument("--every-s", type=float, help="seconds after the previous victim's replacement served "
                                                     "(default 25, or 0 with --every-steps)")
    chaos.add_argument("--every-steps", type=int, default=0, help="or this many steps logged after it")
    chaos.add_argument("--kills", type=int, default=0, help="stop after this many kills (0: when the run ends)")
    chaos.add_argument("--seed", type=int, default=0, help="the order of the roles and the processes picked")
    study = sub.add_parser("study", help="run a named study (several training runs) and write its report.md")
    study.add_argument("name", nargs="?", help="the study (--list names them)")
    study.add_argument("--list", action="store_true", help="name the studies and what each answers")
    study.add_argument("--dir", type=Path, help="the study's directory (default: runs/study-NAME); started again, a "
                                                "study goes on from its first unfinished run")
    study.add_argument("--dry-run", action="store_true", help="print the runs' commands, run nothing")
    study.add_argument("--report-only", action="store_true", help="write report.md from the finished runs only")
    study.add_argument("--runs", metavar="PATTERNS", help="run only the runs whose names match these shell patterns, "
                                                          "comma separated (e.g. 'lr_*_seed0'); the report covers "
                                                          "every finished run")
    certs = sub.add_parser("certs", help="create a CA and a key and certificate for TLS between a controller "
                                         "and its workers")
    certs.add_argument("dir", type=Path, metavar="DIR", help="where ca.crt, ca.key, tls.crt and tls.key go (a CA "
                                                            "already there signs the new certificate)")
    certs.add_argument("--hosts", default="", help="host names and IP addresses the certificate is for, comma "
                                                   "separated: every worker's and the controller's (default: this "
                                                   "host's name, localhost and 127.0.0.1)")
    certs.add_argument("--days", type=int, default=365, help="how long the certificates are valid")
    worker = sub.add_parser("worker", help="run a Monarch worker that a controller attaches to (job.kind workers)")
    worker.add_argument("--address", required=True, help="where it listens: tls://HOST:PORT (HOST as the "
                                                         "controller reaches it, and in the certificate)")
    worker.add_argument("--tls", type=Path, metavar="DIR", help="the files of `meshrl certs DIR`: only clients "
                                                                "holding a key this CA signed may use the worker")
    worker.add_argument("--insecure", action="store_true", help="listen on tcp://HOST:PORT and run whatever any "
                                                                "client that reaches the port asks")
    evaluate = sub.add_parser("eval", help="score a run's policy on a held-out split of its task (validation or test)")
    evaluate.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory (its config.json and final/)")
    evaluate.add_argument("--split", default="test", choices=["validation", "test"], help="the held-out split")
    evaluate.add_argument("--policy", type=Path, help="an HF checkpoint or LoRA adapter to score (default RUN_DIR/final)")
    merge = sub.add_parser("merge", help="a LoRA run's adapter merged into its base, as an HF checkpoint")
    merge.add_argument("adapter", type=Path, help="the adapter directory (RUN_DIR/final of a trainer.lora run)")
    merge.add_argument("out", type=Path, help="where to write the merged checkpoint")
    bench = sub.add_parser("bench", help="run a benchmark").add_subparsers(dest="bench", required=True)
    weight_sync = bench.add_parser("weight-sync", help="the weight ring against memcpy and raw RDMA")
    weight_sync.add_argument("--json", type=Path, required=True, help="where to write the figures")
    weight_sync.add_argument("--model", default="smollm2", help=MODEL_HELP)
    weight_sync.add_argument("--repeats", type=int, default=5,
                             help="timings per figure (transfers: the best, warm; publish-to-loaded: the median)")
    weight_sync.add_argument("--stress-seconds", type=float, default=10.0,
                             help="length of the torn-read stress (0: none; more: from a repository checkout, "
                                  "whose tests/support/ holds the stress driver)")
    weight_sync.add_argument("--ranks", default="1,2", help="trainer rank counts to measure, comma separated")
    weight_sync.add_argument("--lora-rank", type=int, default=16, help="the rank of the LoRA adapter measured beside "
                                                                     "the whole model (0: none)")
    relay = bench.add_parser("relay", help="bytes from the trainer's ring and seconds to load a version: each "
                             "replica reading it, or one relay on their host (meshrl/tools/bench/relay.py)")
    relay.add_argument("--json", type=Path, required=True, help="where to write the figures")
    relay.add_argument("--model", default="smollm2", help=MODEL_HELP)
    relay.add_argument("--replicas", type=int, default=2, help="stand-in replicas on the host")
    relay.add_argument("--versions", type=int, default=3, help="versions published and loaded per arm")
    generation = bench.add_parser("generation", help="the raw engine against one generator replica and against N")
    generation.add_argument("--impl", choices=("vllm", "torch"), default="vllm",
                            help="the generator: vLLM, or the torch generator on the trainer's own model")
    generation.add_argument("--exact", action="store_true", help="with --impl torch: generator.exact (float32 "
                                                                 "weights, each completion re-scored)")
    generation.add_argument("--json", type=Path, required=True, help="where to write the figures")
    generation.add_argument("--model", default="smollm2", help=MODEL_HELP)
    generation.add_argument("--prompts", type=int, default=32, help="prompts (groups) per run")
    generation.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    generation.add_argument("--max-tokens", type=int, default=48, help="tokens per completion at most")
    generation.add_argument("--replicas", type=int, default=2, help="replicas of the last figure")
    generation.add_argument("--repeats", type=int, default=2, help="warm runs per figure (the best is reported)")
    trainer = bench.add_parser("trainer", help="the trainer actor against a plain torch loop, 1 and 2 ranks")
    trainer.add_argument("--json", type=Path, required=True, help="where to write the figures")
    trainer.add_argument("--model", default="smollm2", help=MODEL_HELP)
    trainer.add_argument("--ranks", default="1,2", help="rank counts to measure, comma separated")
    trainer.add_argument("--batch", type=int, default=8, help="sequences per step")
    trainer.add_argument("--prompt-tokens", type=int, default=32, help="prompt tokens per sequence (not trained)")
    trainer.add_argument("--response-tokens", type=int, default=96, help="trained tokens per sequence")
    trainer.add_argument("--repeats", type=int, default=3, help="timed steps per figure (the best is reported)")
    trainer.add_argument("--lora-rank", type=int, default=16, help="the rank of the LoRA adapter measured beside "
                                                                 "full fine-tuning (0: none)")
    trainer.add_argument("--memory", action="store_true", help="instead: peak memory against tokens per micro-batch "
                         "with the memory switches on and off, a fresh process per size (meshrl/tools/bench/trainer_memory.py)")
    trainer.add_argument("--tokens", default="512,1024,2048,4096", help="--memory: tokens per micro-batch, comma separated")
    buffer = bench.add_parser("buffer", help="groups a second through one replay buffer process: stage, add, sample "
                                             "(meshrl/tools/bench/buffer.py)")
    buffer.add_argument("--json", type=Path, required=True, help="where to write the figures")
    buffer.add_argument("--max-tokens", default="16,1024", help="tokens per completion, comma separated")
    buffer.add_argument("--batches", type=int, default=8, help="timed batches per length (after one untimed)")
    buffer.add_argument("--batch-size", type=int, default=256, help="groups per batch")
    buffer.add_argument("--group-size", type=int, default=8, help="completions per group")
    experts = bench.add_parser("experts", help="bytes each rank reads and memory its load adds, a tiny MoE sharded on "
                               "1, 2, 4 ranks: each reading only its experts, and every expert whole as before "
                               "(meshrl/tools/bench/experts.py)")
    experts.add_argument("--json", type=Path, required=True, help="where to write the figures")
    experts.add_argument("--ranks", default="1,2,4", help="rank counts, comma separated")
    control = bench.add_parser("controller", help="the controller's own cost with fake actors, and a placement's "
                                                  "predicted step time (from a repository checkout: the fakes "
                                                  "are its tests/support/)")
    control.add_argument("--json", type=Path, required=True, help="where to write the figures")
    control.add_argument("--replicas", default="1,8,64,512", help="generator replica counts, comma separated")
    control.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    control.add_argument("--max-tokens", default="32", help="tokens per completion, comma separated (e.g. 1024,8192)")
    control.add_argument("--groups", type=int, default=4096, help="groups routed per figure (at least)")
    control.add_argument("--placement", metavar="REPLICAS:RANKS:PROMPTS",
                         help="predict the step time of this placement, e.g. 8:4:64 (needs the cost model's times)")
    control.add_argument("--generate-s-per-token", type=float, default=0.0,
                         help="cost model: seconds per generated token of a group on a replica")
    control.add_argument("--train-s-per-token", type=float, default=0.0,
                         help="cost model: seconds per trained token on one trainer rank")
    control.add_argument("--publish-s", type=float, default=0.0, help="cost model: seconds per weight publish")
    control.add_argument("--pull-s", type=float, default=0.0, help="cost model: seconds per generator weight pull")
    control.add_argument("--tail", type=float, default=0.0,
                         help="cost model: the slowest groups take 1 + TAIL times as long as the fastest")
    control.add_argument("--time-scale", type=float, default=20.0, help="simulate this many times faster than real")
    control.add_argument("--real", action="store_true", help="instead: the real controller over stand-in actors in "
                         "Monarch processes, beside the in-process figures (meshrl/tools/bench/controller_real.py)")
    control.add_argument("--real-runs", default="", help="--real: ACTORSxTOKENS,... (default: every --replicas "
                                                         "at every --max-tokens)")
    control.add_argument("--processes", type=int, default=4, help="--real: generator processes (actors spread over them)")
    control.add_argument("--workers", default="", help="--real: Monarch workers (tcp://HOST:PORT,...) for the "
                                                       "generator processes (default: this machine's processes)")
    control.add_argument("--bind", default="", help="--real with --workers: where they reach this process (tcp://IP:0)")
    sync_async = bench.add_parser("sync-vs-async", help="one workload trained sync, async draining, async in flight",
                                  epilog="Config overrides apply to every run: --generator.max_tokens 32")
    sync_async.add_argument("--config", required=True, help="e.g. bench_smoke or bench_smollm2")
    sync_async.add_argument("--steps", type=int, required=True, help="optimizer steps in each mode")
    sync_async.add_argument("--json", type=Path, required=True, help="where to write the figures")
    sync_async.add_argument("--plot", type=Path, required=True, help="where to write the PNG")
    sync_async.add_argument("--run-dir", type=Path, help="where both runs go (default: runs/bench-CONFIG-TIME)")
    multiturn = bench.add_parser("multiturn", help="a multi-turn workload routed least-loaded and sticky",
                                 epilog="Config overrides apply to both runs: --generator.cpus '0;1'")
    multiturn.add_argument("--config", default="zorplex_smollm2", help="a multi-turn config")
    multiturn.add_argument("--steps", type=int, default=5, help="optimizer steps in each run")
    multiturn.add_argument("--replicas", type=int, default=2, help="generator replicas")
    multiturn.add_argument("--json", type=Path, required=True, help="where to write the figures")
    multiturn.add_argument("--run-dir", type=Path, help="where both runs go (default: runs/bench-multiturn-TIME)")
    check_gpu.add_parser(sub)  # meshrl check gpu
    parser.train = train  # its help, when no config is named
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "train" and getattr(args, "bench", None) not in ("sync-vs-async", "multiturn"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "train" and {"-h", "--help"} & set(rest):
        if not args.config:
            print(parser.train.format_help())
        elif args.config in CONFIGS:
            print(help_text(CONFIGS[args.config](), prog=f"meshrl train --config {args.config} [--run-dir DIR]"))
        return 0 if args.config in CONFIGS or not args.config else _error(f"unknown config {args.config!r}")
    if args.command == "train" and bool(args.config) == bool(args.resume):
        return _error("train --resume RUN_DIR goes on with the run's own config: drop --config" if args.config else
                      f"train needs --config NAME, one of: {', '.join(sorted(CONFIGS))}; or --resume RUN_DIR")
    if args.command == "train" and args.supervise and not (args.dry_run or args.plan_only):
        return _supervise(args, rest)
    try:
        if args.command == "configs":
            for name, fn in sorted(CONFIGS.items()):
                print(f"{name:24s} {fn.__doc__.strip().splitlines()[0]}")
        elif args.command == "report":
            from meshrl.tools.report import report

            print(report(args.run_dirs))
        elif args.command == "prepare-model":
            print(resolve_checkpoint(args.source))
        elif args.command == "certs":
            from meshrl.runtime.certs import make_certs

            hosts = [h.strip() for h in args.hosts.split(",") if h.strip()] or [socket.gethostname(), "localhost",
                                                                                "127.0.0.1"]
            for path in make_certs(args.dir, hosts, args.days):
                print(path)
        elif args.command == "merge":
            from meshrl.models.model import merge_adapter

            print(merge_adapter(args.adapter, args.out))
        elif args.command == "worker":
            return _worker(args)
        elif args.command == "eval":
            from meshrl.tools.evaluate import eval_command

            return eval_command(args.run_dir, args.split, args.policy)
        elif args.command == "study":
            return _study(args)
        elif args.command == "check":
            return check_gpu.command(args)
        elif args.command == "chaos":
            from meshrl.tools.chaos import chaos

            summary, start = args.run_dir / "summary.json", time.time()
            ended = lambda: summary.is_file() and summary.stat().st_mtime >= start  # noqa: E731 (this run's end)
            every_s = args.every_s if args.every_s is not None else 0.0 if args.every_steps else 25.0
            made = chaos(args.run_dir, every_s, args.every_steps, args.kills, args.seed, ended)
            print(f"{len(made)} processes killed; the run's restarts are in {args.run_dir / 'metrics.jsonl'}")
        elif args.command == "bench" and args.bench == "weight-sync":
            _bench_weight_sync(args)
        elif args.command == "bench" and args.bench == "relay":
            from meshrl.tools.bench import relay

            _write_bench(args.json, relay, relay.run(args.model, args.replicas, args.versions))
        elif args.command == "bench" and args.bench == "generation":
            _bench_generation(args)
        elif args.command == "bench" and args.bench == "trainer":
            _bench_trainer(args)
        elif args.command == "bench" and args.bench == "controller":
            _bench_controller(args)
        elif args.command == "bench" and args.bench == "buffer":
            from meshrl.tools.bench import buffer

            _write_bench(args.json, buffer, buffer.run([int(t) for t in args.max_tokens.split(",")], args.batches,
                                                       args.batch_size, args.group_size))
        elif args.command == "bench" and args.bench == "experts":
            from meshrl.tools.bench import experts

            _write_bench(args.json, experts, experts.run([int(r) for r in args.ranks.split(",")]))
        elif args.command == "bench" and args.bench == "multiturn":
            _bench_multiturn(args, rest)
        elif args.command == "bench":
            _bench_sync_vs_async(args, rest)
        elif args.plan_only:  # train: the plans alone, from the checkpoint's published shape if it is not here
            from meshrl.runtime.memory_plan import plan_only

            return plan_only(load_config(args.config, rest)) if args.config else _error("--plan-only needs --config")
        else:  # bad input fails here, before anything starts; a failure during the run keeps its traceback
            run = (_prepare_resume(args.resume, rest) if args.resume else _prepare_train(args.config, rest, args.run_dir))
            if args.dry_run:
                _dry_run(run)
    except (ConfigError, ModelError, ValueError) as e:
        return _error(str(e))
    return _train(run) if args.command == "train" and not args.dry_run else 0


def _worker(args) -> int:
    """A Monarch worker serving at args.address until it is killed; over TLS with args.tls's files."""
    scheme = "tcp://" if args.insecure else "tls://"
    if not args.address.startswith(scheme):
        return _error(f"--address {args.address}: a worker listens on {scheme}HOST:PORT"
                      + ("" if args.insecure else " (or tcp:// with --insecure)"))
    if args.insecure == bool(args.tls):
        return _error("meshrl worker needs --tls DIR (from `meshrl certs DIR`) or, to trust every connection, --insecure")
    if args.tls:
        from meshrl.runtime.certs import tls_environment

        os.environ.update(tls_environment(args.tls.resolve()))
    else:
        print("meshrl: warning: --insecure: this worker runs whatever any client that reaches its port asks",
              file=sys.stderr, flush=True)
    from monarch.actor import run_worker_loop_forever

    run_worker_loop_forever(address=args.address, ca="trust_all_connections")  # TLS comes from the environment
    return 0


def _study(args) -> int:
    from meshrl.tools.studies import STUDIES  # the registry, once every study has registered itself
    from meshrl.tools.study import StudyFailed, run_study, selected, write_report

    if args.list or not args.name:
        for study in STUDIES.values():
            print(f"{study.name:26s} {study.question}")
        return 0 if args.list else _error("study needs a NAME (or --list)")
    if args.name not in STUDIES:
        return _error(f"unknown study {args.name!r}; known: {', '.join(STUDIES)}")
    study, directory = STUDIES[args.name], args.dir or Path("runs") / f"study-{args.name}"
    try:
        runs = selected(study, args.runs)
        for run in runs:
            run.steps()  # every run's config and overrides checked before the first starts
        if args.dry_run:
            print("\n".join(" ".join(run.command(directory / run.name)) for run in runs))
            return 0
        for sig in (signal.SIGTERM, signal.SIGHUP):  # stopped like a Ctrl-C (a closed terminal too): its run stops cleanly
            signal.signal(sig, signal.default_int_handler)
        path = write_report(study, directory) if args.report_only else run_study(study, directory, runs=runs)
    except StudyFailed as e:
        return _error(str(e))
    except KeyboardInterrupt:
        print(f"meshrl: study {args.name} stopped; the finished runs are kept in {directory}; "
              f"`meshrl study {args.name} --dir {directory}` goes on from the first unfinished one", file=sys.stderr)
        return 130
    print(f"report: {path}")
    return 0


def _error(message: str) -> int:
    print(f"meshrl: error: {message}", file=sys.stderr)
    return 2


def _bench_weight_sync(args) -> None:
    from meshrl.tools.bench import weight_sync

    ranks = tuple(int(r) for r in args.ranks.split(","))
    _write_bench(args.json, weight_sync, weight_sync.run(args.model, args.repeats, args.stress_seconds, ranks,
                                                         args.lora_rank))


def _bench_generation(args) -> None:
    from meshrl.tools.bench import generation

    if args.exact and args.impl != "torch":
        raise ValueError("--exact is the torch generator's (generator.exact): add --impl torch")
    _write_bench(args.json, generation, generation.run(args.model, args.prompts, args.group_size, args.max_tokens,
                                                       args.replicas, args.repeats, args.impl, args.exact))


def _bench_trainer(args) -> None:
    from meshrl.tools.bench import trainer, trainer_memory

    if args.memory:
        return _write_bench(args.json, trainer_memory, trainer_memory.run(args.model, [int(t) for t in args.tokens.split(",")]))
    ranks = [int(r) for r in args.ranks.split(",")]
    _write_bench(args.json, trainer, trainer.run(args.model, ranks, args.batch, args.prompt_tokens,
                                                 args.response_tokens, args.repeats, args.lora_rank))


def _bench_controller(args) -> None:
    from meshrl.tools.bench import controller

    if args.real:
        from meshrl.tools.bench import controller_real as real

        runs = real.parse_runs(args.real_runs, [int(r) for r in args.replicas.split(",")],
                               [int(t) for t in args.max_tokens.split(",")])
        return _write_bench(args.json, real, real.run(runs, args.group_size, args.groups, args.processes,
                                                      args.workers, args.bind))
    placement = None
    if args.placement:
        try:
            replicas, ranks, prompts = (int(n) for n in args.placement.split(":"))
        except ValueError:
            raise ValueError(f"--placement {args.placement!r} is not REPLICAS:RANKS:PROMPTS, e.g. 8:4:64") from None
        placement = {"replicas": replicas, "ranks": ranks, "prompts": prompts}
    costs = controller.Costs(args.generate_s_per_token, args.train_s_per_token, args.publish_s, args.pull_s, args.tail)
    _write_bench(args.json, controller, controller.run([int(r) for r in args.replicas.split(",")], args.group_size,
                                                       [int(t) for t in args.max_tokens.split(",")], args.groups,
                                                       placement, costs,
                                                       args.time_scale))


def _write_bench(path: Path, bench, result: dict) -> None:
    """The figures as JSON at `path`, and the bench's report on stdout."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(bench.report(result))


def _bench_multiturn(args, overrides: list[str]) -> None:
    from meshrl.tools.bench import multiturn

    load_config(args.config, overrides)  # bad input fails here, before either run starts
    run_dir = args.run_dir or Path("runs") / f"bench-multiturn-{time.strftime('%Y%m%d-%H%M%S')}"
    _write_bench(args.json, multiturn, multiturn.run(args.config, args.steps, args.replicas, run_dir, overrides))


def _bench_sync_vs_async(args, overrides: list[str]) -> None:
    from meshrl.tools.bench import sync_vs_async

    load_config(args.config, overrides)  # bad input fails here, before either run starts
    run_dir = args.run_dir or Path("runs") / f"bench-{args.config}-{time.strftime('%Y%m%d-%H%M%S')}"
    result = sync_vs_async.run(args.config, args.steps, run_dir, overrides)
    for path in (args.json, args.plot):
        path.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    sync_vs_async.plot(result, args.plot)
    print(sync_vs_async.report(result))
    print(f"runs: {run_dir}/sync, {run_dir}/async_drain, {run_dir}/async_in_flight")


def _supervise(args, overrides: list[str]) -> int:
    """`train --supervise`: the controller in a child process, started again if it is killed."""
    from meshrl.runtime.supervise import Supervisor, train_commands

    run_dir = args.resume or _run_dir(args.config, args.run_dir)
    return Supervisor(run_dir, *train_commands(args.config, run_dir, args.resume, overrides)).run()


def _run_dir(name: str, given: Path | None) -> Path:
    return given or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _prepare_train(name: str, overrides: list[str], run_dir: Path | None):
    """The Run: the config, the model and every role's implementation checked."""
    from meshrl.runtime.run import Run

    config = load_config(name, overrides)
    return Run(config, _run_dir(name, run_dir))


def _prepare_resume(run_dir: Path, overrides: list[str]):
    """The Run that continues `run_dir` from its newest complete checkpoint."""
    from meshrl.checkpoint import resumable
    from meshrl.configs import from_saved, resumable_overrides
    from meshrl.configs.overrides import apply_overrides
    from meshrl.runtime.run import Run

    if not (run_dir / "config.json").is_file():
        raise ValueError(f"{run_dir} is not a run directory (no config.json)")
    saved = from_saved(json.loads((run_dir / "config.json").read_text()))
    config = apply_overrides(saved, overrides)
    resumable_overrides(saved, config)
    return Run(config, run_dir, resume_from=resumable(run_dir))


def _dry_run(run) -> None:
    """The plan of a checked config; the job object is built (its settings checked) but not started."""
    from meshrl.runtime.jobs import describe, make_job

    make_job(run.config.job, run.run_dir / "job")
    print("\n".join(describe(run.config, run.placement) + run.gpus.describe()))
    print(f"model: {run.model_path}\nchecked; nothing started (--dry-run)")


def _train(run) -> int:
    from meshrl.actors.replicas import RoleFailed

    run_dir = run.run_dir
    try:
        summary = asyncio.run(run.run())
    except RoleFailed as e:  # a role could no longer work: what there is was written; one line says what
        print(f"meshrl: error: {e}", file=sys.stderr)
        return 1
    from meshrl.episodes import reward_error_line

    if line := reward_error_line(summary):  # ended or stopped with replies its reward function raised on
        print(line, file=sys.stderr)
    if "stopped_by" in summary:
        from meshrl.checkpoint import latest

        newest = latest(run_dir)
        resume = f"; go on with: meshrl train --resume {run_dir} (from {newest.name})" if newest else ""
        print(f"meshrl: stopped by {summary['stopped_by']} after {summary['steps']} steps; metrics, rollouts, trace"
              f"{' and the ' + _final(summary) if _final(summary) else ''} are in {run_dir}{resume}", file=sys.stderr)
        return 128 + getattr(signal, summary["stopped_by"])
    for key in (k.removesuffix("_initial") for k in summary if k.endswith("_initial") and not k.endswith("95_initial")):
        interval = (f" (95% interval {summary[key + '_low95_final']:.3f}-{summary[key + '_high95_final']:.3f})"
                    if key + "_low95_final" in summary else "")
        print(f"{key.replace('_', ' ')}: step 0 {summary[key + '_initial']:.3f} -> "
              f"step {summary['steps']} {summary[key + '_final']:.3f}{interval}")
    print(f"run directory: {run_dir} (metrics.jsonl, curves.png{', ' + _final(summary) if _final(summary) else ''})")
    return 0


def _final(summary: dict) -> str:
    """"policy version N (final/, from ...)": what summary.json's final_policy says final/ holds ("": nothing)."""
    from meshrl.runtime.final import FinalPolicy

    return FinalPolicy(**summary["final_policy"]).describe() if summary.get("final_policy") else ""
