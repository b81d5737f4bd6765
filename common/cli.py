"""The `omnistage` command: serve, generate, status, make-tiny-checkpoint, make-config-checkpoint, protos."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.config import ConfigError, load_config
from omnistage.v1 import common_pb2, control_pb2, control_pb2_grpc, omni_pb2, omni_pb2_grpc


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cmd_serve(args: argparse.Namespace) -> int:
    from omnistage.common.launcher import launch

    return launch(
        args.config, args.overrides, run_dir=args.run_dir, ready_file=args.ready_file,
        exit_after_ready=args.exit_after_ready,
    )


def cmd_make_tiny_checkpoint(args: argparse.Namespace) -> int:
    from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(args.dir, seed=args.seed)
    print(f"omnistage: tiny checkpoint written to {path}")
    return 0


def cmd_make_config_checkpoint(args: argparse.Namespace) -> int:
    from omnistage.common.checkpoint.config_only import write_config_checkpoint

    path = write_config_checkpoint(args.dir, args.shape)
    print(f"omnistage: config-only {args.shape} checkpoint written to {path} (serve it with model.load_format: dummy)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    sampling = common_pb2.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.seed is not None:
        sampling.seed = args.seed
    request = omni_pb2.GenerateRequest(
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=args.prompt)])],
        output_modalities=[omni_pb2.MODALITY_TEXT],
        sampling=sampling,
    )
    finish = None
    with grpc.insecure_channel(args.address) as channel:
        try:
            for event in omni_pb2_grpc.OmniStub(channel).Generate(request, timeout=args.timeout_s):
                kind = event.WhichOneof("event")
                if kind == "text":
                    sys.stdout.write(event.text.text)
                    sys.stdout.flush()
                elif kind == "finish":
                    finish = event.finish
        except grpc.RpcError as exc:
            print(f"\nomnistage: generate failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print()
    if finish is None:
        print("omnistage: the stream ended without a finish event", file=sys.stderr)
        return 1
    u = finish.usage
    print(
        f"[finish: {common_pb2.FinishReason.Name(finish.reason).removeprefix('FINISH_REASON_').lower()}, "
        f"prompt_tokens={u.prompt_tokens}, completion_tokens={u.completion_tokens}, "
        f"ttft={u.time_to_first_token_ms:.1f}ms{', ' + finish.message if finish.message else ''}]"
    )
    return 1 if finish.reason == common_pb2.FINISH_REASON_ERROR else 0


def describe_lines(address: str, timeout_s: float) -> tuple[bool, list[str]]:
    """Human-readable Describe + health of one service; (serving?, lines)."""
    with grpc.insecure_channel(address) as channel:
        try:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            d = control_pb2_grpc.ControlStub(channel).Describe(control_pb2.DescribeRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, [f"{address}  unreachable: {exc.code().name}: {exc.details()}"]
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
    p = d.progress
    phase = control_pb2.Phase.Name(p.phase).removeprefix("PHASE_").lower()
    count = f" {p.done}/{p.total} {p.unit}" if p.total else (f" {p.done} {p.unit}" if p.done else "")
    kind = control_pb2.StageKind.Name(d.kind).removeprefix("STAGE_KIND_").lower()
    lines = [
        f"{d.name} ({kind}) at {address}: {status}, phase {phase}{count} ({p.elapsed_s:.1f}s)"
        + (f" {p.detail}" if p.detail else ""),
        f"  version {d.version}, rank {d.rank}/{d.world_size}, pid {d.pid}, config {d.config_hash[:12]}"
        + (f", model {d.model}" if d.model else ""),
        f"  requests: {d.running_requests} running, {d.queued_requests} queued",
    ]
    lim = d.limits
    lines.append(
        f"  limits: max_running {lim.max_running_requests}, max_queued {lim.max_queued_requests}, "
        f"max_message {_mib(lim.max_message_bytes)}"
        + (f", max_model_len {lim.max_model_len}, default_max_tokens {lim.default_max_tokens}" if lim.max_model_len else "")
    )
    for m in d.memory:
        lines.append(
            f"  memory {m.device}: total {_mib(m.total_bytes)} (weights {_mib(m.weights_bytes)}, "
            f"kv {_mib(m.kv_cache_bytes)}, activations {_mib(m.activation_peak_bytes)}, "
            f"graphs {_mib(m.graph_pool_bytes)}, transport {_mib(m.transport_pool_bytes)})"
            + (f", budget {_mib(m.budget_bytes)}" if m.budget_bytes else "")
        )
    if d.failure:
        lines.append(f"  failure: {d.failure}")
    return health.status == health_pb2.HealthCheckResponse.SERVING, lines


def cmd_status(args: argparse.Namespace) -> int:
    if args.config:
        try:
            cfg = load_config(args.config, args.overrides)
        except ConfigError as exc:
            print(f"omnistage: config error: {exc}", file=sys.stderr)
            return 2
        addresses = [cfg.address(name) for name in cfg.services]
    elif args.address:
        addresses = [args.address]
    else:
        print("omnistage status: give --address HOST:PORT or --config FILE", file=sys.stderr)
        return 2
    all_ok = True
    for address in addresses:
        ok, lines = describe_lines(address, args.timeout_s)
        all_ok &= ok
        print("\n".join(lines))
    return 0 if all_ok else 1


def cmd_protos(args: argparse.Namespace) -> int:
    from omnistage.common import protogen

    if args.check:
        problems = protogen.check()
        for line in problems:
            print(f"omnistage protos: {line}", file=sys.stderr)
        if not problems:
            print("omnistage protos: generated code is up to date")
        return 1 if problems else 0
    files = protogen.write()
    print(f"omnistage protos: wrote {len(files)} files to {files[0].parent}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage", description="Stage-wise gRPC serving of omni-modal models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="start every service of a deploy file and supervise them")
    p.add_argument("config", help="deploy YAML (e.g. deploy/local-tiny.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--run-dir", default=None, help="directory for status files (default: a temp dir)")
    p.add_argument("--ready-file", default=None, help="write the gateway address here when ready")
    p.add_argument("--exit-after-ready", action="store_true", help="stop everything once ready (smoke tests)")
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("make-tiny-checkpoint", help="write the tiny random-weight checkpoint in the HF layout")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_make_tiny_checkpoint)

    p = sub.add_parser(
        "make-config-checkpoint",
        help="write config.json of a real thinker shape + a tiny tokenizer, no weights (load_format: dummy)",
    )
    p.add_argument("dir")
    p.add_argument("--shape", choices=("ming-flash", "ling-mini", "tiny"), default="ming-flash")
    p.set_defaults(fn=cmd_make_config_checkpoint)

    p = sub.add_parser("generate", help="send one text prompt to a gateway and stream the answer")
    p.add_argument("--address", required=True, metavar="HOST:PORT")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=0, help="0: the server's default")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("status", help="Describe + health of one service, or of every service of a deploy file")
    p.add_argument("--address", metavar="HOST:PORT")
    p.add_argument("--config", help="deploy YAML: query all its services")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE")
    p.add_argument("--timeout-s", type=float, default=2.0)
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("protos", help="regenerate omnistage/v1 *_pb2 code from the .proto files")
    p.add_argument("--check", action="store_true", help="exit 1 when the committed generated code is stale")
    p.set_defaults(fn=cmd_protos)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
