"""The `pdserve` command line: serve, generate, status, demo, bench, plan, profile.

    pdserve serve --config deploy/local.yaml [--port 50051 --prefill-tp 2 ...]
    pdserve generate --address 127.0.0.1:50051 --prompt "Hello" --max-tokens 32
                     [--json-schema FILE | --regex RE | --choice A --choice B]
    pdserve status --address 127.0.0.1:50051 --metrics 127.0.0.1:9400
    pdserve demo
    pdserve bench --compare --out runs/today [--quick]    (benchmarks/goodput/)
    pdserve profile --out profile.json / pdserve plan ...  (benchmarks/profiling/, planner/)

Flags override the config file; `serve` without --config starts from the defaults (the demo
model). Errors the user can fix end with exit code 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from deploy.cli.client import RouterClient, fetch_metrics, format_status, parse_metrics
from deploy.config.checks import read_token_file
from deploy.config.serve_config import ConfigError, ServeConfig, apply_overrides, load_config

DEFAULT_ADDRESS = "127.0.0.1:50051"
ROLES = ("prefill", "decode", "colocated")
# serve's flags (argparse names) and the config keys they set over the file.
_FLAG_KEYS = {
    "model": "model",
    "mode": "mode",
    "host": "router.host",
    "port": "router.port",
    "metrics_port": "router.metrics_port",
    "http_port": "router.http_port",
    **{f"{role}_instances": f"{role}.instances" for role in ROLES},
    **{f"{role}_tp": f"{role}.tensor_parallel_size" for role in ROLES},
}


def _add_serve(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="start a cluster and serve until SIGINT/SIGTERM")
    serve.add_argument("--config", help="YAML config file (see deploy/local.yaml)")
    serve.add_argument(
        "--model", help="Hugging Face model folder, 'smollm2' (SmolLM2-135M-Instruct) or 'demo'"
    )
    serve.add_argument("--host", help="address the router listens on")
    serve.add_argument("--port", type=int, help="router port (0: a free one)")
    serve.add_argument("--metrics-port", type=int, help="Prometheus port (0: a free one)")
    serve.add_argument(
        "--http-port",
        type=int,
        help="OpenAI-compatible HTTP API port (0: a free one; on router.http_host, 127.0.0.1)",
    )
    for role in ROLES:
        serve.add_argument(f"--{role}-instances", type=int, help=f"number of {role} instances")
        serve.add_argument(f"--{role}-tp", type=int, help=f"TP ranks per {role} instance")
    serve.add_argument("--mode", choices=("disaggregated", "colocated"))
    serve.add_argument("--no-ray", action="store_true", help="run workers as plain processes")
    serve.set_defaults(func=cmd_serve)


def _add_router_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="router HOST:PORT")
    parser.add_argument("--token", dest="token_file", help="file holding the bearer token")
    parser.add_argument("--auth-token", help="the bearer token itself")
    parser.add_argument("--tls-ca", help="CA certificate (PEM) to verify a TLS router")


def _add_generate(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser("generate", help="stream one generation to the terminal")
    _add_router_flags(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float)
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true")
    constraint = generate.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema", metavar="FILE", help="the output is JSON matching this schema file"
    )
    constraint.add_argument("--regex", help="the output matches this regular expression")
    constraint.add_argument(
        "--choice", action="append", help="the output is one of these (repeatable)"
    )
    generate.add_argument("--timeout", type=float, default=300.0, help="seconds for the call")
    generate.set_defaults(func=cmd_generate)


def _add_status(commands: argparse._SubParsersAction) -> None:
    status = commands.add_parser("status", help="workers, load, KV usage and health")
    _add_router_flags(status)
    status.add_argument("--metrics", help="router metrics HOST:PORT (default: from --config)")
    status.add_argument("--config", help="the config file the cluster was served with")
    status.set_defaults(func=cmd_status)


def _add_demo(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser("demo", help="local cluster, a few streamed generations, a table")
    demo.add_argument("--no-ray", action="store_true", help="run workers as plain processes")
    demo.add_argument(
        "--max-tokens", type=int, default=None, help="per answer (default 48 chat, 24 plain)"
    )
    # Tests and the cold-start script point the demo at another small model folder.
    demo.add_argument(
        "--model",
        default=os.environ.get("PDSERVE_DEMO_MODEL"),
        help="'smollm2' (the default), 'demo' (the small local model) or a model folder",
    )
    demo.set_defaults(func=cmd_demo)


# Subcommands owned by another package: `pdserve NAME ARGS` hands ARGS to that package's own
# command line, imported only when NAME runs, so deploy imports neither benchmarks nor planner.
def _run_bench(argv: list[str]) -> int:
    from benchmarks.goodput.compare import main

    return main(argv)


def _run_plan(argv: list[str]) -> int:
    from planner.cli import main

    return main(argv)


def _run_profile(argv: list[str]) -> int:
    from benchmarks.profiling.cli import main

    return main(argv)


_FORWARDED: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "bench": (
        "goodput under SLOs: disaggregated against colocated (--compare --out DIR)",
        _run_bench,
    ),
    "plan": ("search placements for a workload and SLOs", _run_plan),
    "profile": ("measure this deployment's latency model", _run_profile),
}


def _add_forwarded(commands: argparse._SubParsersAction) -> None:
    """Listed in `pdserve --help`; `main` forwards them before this parser sees their flags."""
    for name, (help_text, _run) in _FORWARDED.items():
        commands.add_parser(name, help=f"{help_text} (pdserve {name} --help)", add_help=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_add_serve, _add_generate, _add_status, _add_demo, _add_forwarded):
        add(commands)
    return parser


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The config file (or the defaults) with the flags given over it."""
    config = load_config(args.config) if args.config else ServeConfig()
    flags = vars(args)
    given = {key: flags[name] for name, key in _FLAG_KEYS.items() if flags[name] is not None}
    if args.no_ray:
        given["ray.enabled"] = False
    return apply_overrides(config, given)


class _ServeSignals:
    """SIGINT/SIGTERM for `serve`: the first asks for a drain (during start-up it abandons the
    start); a second one ends everything at once: every process this one started is killed by
    id, Ray's temp dir removed, and the process exits. The handlers run on the main thread,
    which only waits (`wait_for`), so a second signal is handled at once."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.serving = threading.Event()
        self.cluster: object = None

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.stop.is_set():
            self._exit_now(signum)
        self.stop.set()
        if not self.serving.is_set():  # still starting: abandon start-up (the `with` cleans up)
            raise KeyboardInterrupt(f"signal {signum}")

    def _exit_now(self, signum: int) -> None:
        from deploy.runtime.ray.node import descendant_pids

        _say(f"signal {signal.Signals(signum).name} again: stopping at once")
        for pid in descendant_pids(os.getpid()):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        temp_dir = getattr(self.cluster, "temp_dir", None)  # a local Ray cluster's
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
        os._exit(128 + signum)

    def wait_for(self, work: Callable[[], object]) -> None:
        """Run `work` on a thread; the main thread stays free for a second signal."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # handed to the main thread below
                errors.append(exc)

        thread = threading.Thread(target=run, name="pdserve-shutdown", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
        if errors:
            raise errors[0]


def cmd_serve(args: argparse.Namespace) -> int:
    from deploy.config.models import resolve_model
    from deploy.runtime.launch import open_cluster

    config = serve_config(args)
    signals = _ServeSignals()
    signals.install()
    say = _say
    model_dir = resolve_model(config.model, say=say)
    config.check_tensor_parallel(model_dir)  # a named model's heads are known only now
    signals.cluster = cluster = open_cluster(config, model_dir, say=say)
    with cluster:
        address = cluster.start(progress=say)
        signals.install()  # again: starting Ray installs its own SIGTERM handler (it aborts)
        metrics_port = cluster.metrics_port
        metrics = (
            f", metrics http://{config.router.host}:{metrics_port}/metrics" if metrics_port else ""
        )
        http_port = cluster.http_port
        if http_port is not None:
            metrics += f", OpenAI API http://{config.router.http_host}:{http_port}/v1"
        say(f"serving on {address}{metrics}; Ctrl-C to stop")
        signals.serving.set()
        while not signals.stop.wait(0.5):
            pass
        say(
            f"stopping: draining in-flight requests (up to {config.router.shutdown_grace_s:g} s;"
            " a second Ctrl-C stops at once)"
        )
        signals.wait_for(cluster.shutdown)
    say("stopped")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve_proto.v1 import generation_pb2 as pb

    request = pb.GenerateRequest(
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    for name in ("top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            setattr(request, name, getattr(args, name))
    if args.json_schema is not None:
        try:
            schema = Path(args.json_schema).read_text()
        except OSError as exc:
            raise ConfigError(f"--json-schema {args.json_schema}: {exc.strerror}") from None
        request.structured_output.json_schema = schema
    elif args.regex is not None:
        request.structured_output.regex = args.regex
    elif args.choice:
        request.structured_output.choice.choices.extend(args.choice)
    last = pb.GenerateResponse()
    with _client(args) as client:
        for response in client.generate(request, timeout_s=args.timeout):
            sys.stdout.write(response.text)
            sys.stdout.flush()
            last = response
    sys.stdout.write("\n")
    reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
    timings = last.timings
    print(
        f"[{reason}: {last.usage.completion_tokens} tokens, TTFT {1000 * timings.first_token_s:.1f}"
        f" ms, TPOT {1000 * timings.per_token_s:.1f} ms]",
        file=sys.stderr,
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from grpc_health.v1 import health_pb2

    metrics_address = args.metrics
    if metrics_address is None and args.config:
        router = load_config(args.config).router
        if router.metrics_port:
            metrics_address = f"{router.host}:{router.metrics_port}"
    if metrics_address is None:
        raise ConfigError("give --metrics HOST:PORT (or --config with router.metrics_port set)")
    with _client(args) as client:
        try:
            health = health_pb2.HealthCheckResponse.ServingStatus.Name(client.health())
        except grpc.RpcError as exc:
            health = f"unreachable ({exc.code().name})"
    status = parse_metrics(fetch_metrics(metrics_address, token=_token(args), tls_ca=args.tls_ca))
    print(format_status(args.address, health, status))
    return 0 if health == "SERVING" else 1


def _client(args: argparse.Namespace) -> RouterClient:
    """A client of the router that --address, --token / --auth-token and --tls-ca name."""
    return RouterClient(args.address, _token(args), args.tls_ca)


def _token(args: argparse.Namespace) -> str | None:
    """The bearer token --token (a file) or --auth-token gives, if any."""
    return read_token_file(args.token_file, "token file") if args.token_file else args.auth_token


def cmd_demo(args: argparse.Namespace) -> int:
    from deploy.cli.demo import run_demo

    run_demo(model_dir=args.model, use_ray=not args.no_ray, max_tokens=args.max_tokens)
    return 0


def _say(line: str) -> None:
    # One write per line: workers start on threads of their own, and print() writes the text
    # and its newline apart, so two lines could run together.
    sys.stdout.write(f"[pdserve] {line}\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """The console script `pdserve`."""
    words = list(sys.argv[1:] if argv is None else argv)
    if words and words[0] in _FORWARDED:
        command, run = words[0], lambda: _FORWARDED[words[0]][1](words[1:])
    else:
        args = build_parser().parse_args(words)
        command, run = args.command, lambda: args.func(args)
    try:
        return int(run())
    except (ConfigError, ValueError, OSError) as exc:
        print(f"pdserve {command}: error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"pdserve {command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
