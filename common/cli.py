"""The `omnistage` command: serve, generate, bench, status, health, drain, resume, stage-key, keys,
make-tiny-checkpoint, make-config-checkpoint, protos. Commands of a running deployment take it from
`--config` (+ `--set`), else from this user's running `serve` (run_record.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.config import ConfigError, DeployConfig, ServiceConfig, load_config
from omnistage.common.load_driver import KINDS, RequestShape, plan, run_plan
from omnistage.common.load_stats import Summary, details_table, failures, markdown_table
from omnistage.common.runtime import auth
from omnistage.common.runtime.auth import SecretError
from omnistage.common.runtime.control import omnistage_version
from omnistage.v1 import common_pb2, control_pb2, control_pb2_grpc, omni_pb2, omni_pb2_grpc

if TYPE_CHECKING:
    from omnistage.common.client import Result


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cmd_serve(args: argparse.Namespace) -> int:
    from omnistage.common.launcher import launch

    return launch(
        args.config,
        [*args.overrides, *_public_port_overrides(args)],
        run_dir=args.run_dir,
        ready_file=args.ready_file,
        exit_after_ready=args.exit_after_ready,
        check_only=args.check,
    )


def _public_port_overrides(args: argparse.Namespace) -> list[str]:
    """`serve --host/--port/--http-port` as the `--set` overrides of the gateway they move (recorded
    with the run like any other, so the other commands find the moved ports)."""
    flags = {"bind_host": args.host, "port": args.port, "gateway.http_port": args.http_port}
    if all(v is None for v in flags.values()):
        return []
    try:
        gateways = load_config(args.config, args.overrides).services_of("gateway")
    except ConfigError:
        return []  # `serve` reports the config's problem itself
    if not gateways:
        return []
    name = gateways[0].name
    return [f"services.{name}.{key}={value}" for key, value in flags.items() if value is not None]


def cmd_stage_key(args: argparse.Namespace) -> int:
    """Print the stage key of the running `serve` (of `--config`, else this user's current run): what
    a client calling a stage directly (its main or admin port) presents as `authorization: Bearer`."""
    try:
        _from_run(args)
    except ConfigError as exc:
        print(f"omnistage: {exc}", file=sys.stderr)
        return 2
    key = auth.published_stage_key(args.config)
    if not key:
        print(
            f"omnistage: no stage key of a running `omnistage serve {args.config}` for this user "
            f"(a deployment started elsewhere: its ${auth.STAGE_KEY_ENV})",
            file=sys.stderr,
        )
        return 1
    print(key)
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from omnistage.common.deploy_keys import write_env_file

    try:
        path = write_env_file(args.env_file, api_keys=args.api_keys, force=args.force)
    except FileExistsError:
        print(f"omnistage: {args.env_file} exists; --force replaces its keys (rotation)", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"omnistage: {exc}", file=sys.stderr)
        return 2
    print(
        f"omnistage: the deployment's keys written to {path} (0600): "
        f"docker-compose --env-file {path} ...; kubectl create secret generic omnistage-keys --from-env-file={path}"
    )
    return 0


def _from_run(args: argparse.Namespace) -> None:
    """Without --config (and --address), the deployment of this user's running `serve` (run_record.py):
    its config and `--set` overrides, the command's own after them. ConfigError when neither is given
    and no `serve` runs."""
    if getattr(args, "config", None) or getattr(args, "address", None):
        return
    from omnistage.common import run_record

    record = run_record.current()
    if record is None:
        where = "--config FILE" + (" or --address HOST:PORT" if hasattr(args, "address") else "")
        raise ConfigError(f"give {where} (no running `omnistage serve` of this user found)")
    args.config = record.config
    args.overrides = [*record.overrides, *args.overrides]


def cmd_make_tiny_checkpoint(args: argparse.Namespace) -> int:
    from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(args.dir, seed=args.seed)
    print(f"omnistage: tiny checkpoint written to {path}")
    return 0


def cmd_make_config_checkpoint(args: argparse.Namespace) -> int:
    from omnistage.common.checkpoint.config_only import write_config_checkpoint

    path = write_config_checkpoint(args.dir, args.shape)
    print(
        f"omnistage: config-only {args.shape} checkpoint written to {path} (serve it with model.load_format: dummy)"
    )
    return 0


def _config(args: argparse.Namespace) -> DeployConfig:
    """The deploy file of `--config` with its `--set` overrides (ConfigError names the key); the stage
    key its running `serve` left is taken too (stages answer Control only with it)."""
    cfg = load_config(args.config, args.overrides)
    auth.adopt_stage_key(args.config)
    return cfg


def _key_from(var: str, flag: str) -> tuple[tuple[str, str], ...]:
    key = os.environ.get(var, "").strip()
    if not key:
        raise SecretError(f"{flag} {var}: environment variable {var} is not set")
    return auth.bearer(key)


def _gateway_target(args: argparse.Namespace) -> tuple[str, grpc.ChannelCredentials | None, tuple]:
    """(address, TLS credentials or None, call metadata) of the gateway `generate` talks to."""
    key_env = args.api_key_env
    _from_run(args)
    if args.config:
        cfg = _config(args)
        gateways = cfg.services_of("gateway")
        if not gateways:
            raise ConfigError(f"services: {args.config} has no gateway to send the prompt to")
        gw = gateways[0]
        address = args.address or cfg.address(gw.name)
        creds = auth.channel_credentials(gw, args.ca_file, args.cert_file, args.key_file)
        metadata = _key_from(key_env, "--api-key-env") if key_env else auth.client_metadata(gw)
        return address, creds, metadata
    if not args.address:
        raise ConfigError("give --config FILE (the gateway is found there) or --address HOST:PORT")
    creds = None
    if args.ca_file or args.cert_file:
        creds = auth.tls_credentials(args.ca_file, args.cert_file, args.key_file)
    return args.address, creds, _key_from(key_env, "--api-key-env") if key_env else ()


def _channel(address: str, creds: grpc.ChannelCredentials | None) -> grpc.Channel:
    return grpc.secure_channel(address, creds) if creds is not None else grpc.insecure_channel(address)


class _Progress:
    """One self-overwriting stderr line for long work (image denoising steps): `[imagegen 12/30]`."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr  # the stderr of now, not of import time
        self.shown = False

    def update(self, stage: str, done: int, total: int) -> None:
        self.stream.write(f"\r[{stage} {done}/{total}]" if total else f"\r[{stage} {done}]")
        self.stream.flush()
        self.shown = True

    def end(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False


# Kept as they are: line breaks and tabs are layout, the joiners build emoji and scripts' ligatures.
_KEPT_CONTROLS = frozenset("\n\t\u200c\u200d")
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def terminal_safe(text: str) -> str:
    """The model's text with what a terminal would act on written as escapes (`\\x1b`, `\\u202e`): a
    random or hostile answer must not clear the screen, move the cursor or reorder what follows."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch in _KEPT_CONTROLS or unicodedata.category(ch) not in _ESCAPED_CATEGORIES:
            out.append(ch)
        else:
            out.append(ascii(ch)[1:-1])
    return "".join(out)


def _image_options(args: argparse.Namespace) -> omni_pb2.ImageOptions | None:
    if not args.image_out:
        return None
    options = omni_pb2.ImageOptions(steps=args.image_steps, guidance_scale=args.guidance_scale)
    if args.image_size:
        w, sep, h = args.image_size.lower().partition("x")
        if not (sep and w.isdigit() and h.isdigit()):
            raise ValueError(f"--image-size: expected WIDTHxHEIGHT, got {args.image_size!r}")
        options.width, options.height = int(w), int(h)
    if args.seed is not None:
        options.seed = args.seed
    return options


def cmd_generate(args: argparse.Namespace) -> int:
    from omnistage.common.client import Result

    try:
        address, creds, metadata = _gateway_target(args)
        request = _generate_request(args)
    except (ConfigError, SecretError, OSError, ValueError) as exc:
        print(f"omnistage: {exc}", file=sys.stderr)
        return 2
    result = Result()
    progress = _Progress()
    try:
        _stream_answer(args, address, creds, metadata, request, result, progress)
    except grpc.RpcError as exc:
        progress.end()
        print(f"\nomnistage: generate failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the channel is closed on the way out, which cancels the request
        print("\nomnistage: interrupted", file=sys.stderr)
        return 130
    progress.end()
    print()
    finish = result.finish
    if finish is None:
        print("omnistage: the stream ended without a finish event", file=sys.stderr)
        return 1
    status = _write_answer_files(args, result, finish)
    u = finish.usage
    print(
        f"[finish: {common_pb2.FinishReason.Name(finish.reason).removeprefix('FINISH_REASON_').lower()}, "
        f"prompt_tokens={u.prompt_tokens}, completion_tokens={u.completion_tokens}, "
        f"ttft={u.time_to_first_token_ms:.1f}ms{', ' + finish.message if finish.message else ''}]"
    )
    return 1 if finish.reason == common_pb2.FINISH_REASON_ERROR else status


def _generate_request(args: argparse.Namespace) -> omni_pb2.GenerateRequest:
    """The GenerateRequest of `generate`'s flags: text always, audio with --speak, an image with --image-out."""
    from omnistage.common.client import build_request

    modalities = ["text"] + (["audio"] if args.speak else []) + (["image"] if args.image_out else [])
    return build_request(
        args.prompt,
        images=args.image,
        audios=args.audio,
        videos=args.video,
        modalities=modalities,
        voice=args.voice,
        image=_image_options(args),
        system_prompt=args.system_prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
    )


def _stream_answer(
    args: argparse.Namespace,
    address: str,
    creds: grpc.ChannelCredentials | None,
    metadata: tuple,
    request: omni_pb2.GenerateRequest,
    result: Result,
    progress: _Progress,
) -> None:
    """Call Generate and show the answer as it comes: text on stdout, progress and speech length on stderr.

    Every event is also added to `result`, which the caller writes out once the stream ends.
    """
    from omnistage.common.client import OmniClient

    with OmniClient(address, credentials=creds, metadata=metadata, timeout_s=args.timeout_s) as client:
        for event in client.generate(request=request):
            kind = event.WhichOneof("event")
            if kind == "text":
                progress.end()
                sys.stdout.write(terminal_safe(event.text.text))
                sys.stdout.flush()
            elif kind == "progress":
                progress.update(event.progress.stage, event.progress.done, event.progress.total)
            elif kind == "audio" and args.speak and not progress.shown:
                seconds = (
                    (len(result.pcm16) + len(event.audio.pcm16)) / 2 / max(1, event.audio.sample_rate_hz)
                )
                sys.stderr.write(f"\r[speech {seconds:.1f} s]")
                sys.stderr.flush()
            result.add(event)


def _write_answer_files(args: argparse.Namespace, result: Result, finish: omni_pb2.Finish) -> int:
    """Write the speech (--speak) and image (--image-out) files, one line each on stderr; 1 if no image came."""
    status = 0
    if args.speak:
        Path(args.speak).write_bytes(result.wav())
        a = finish.audio
        outcome = omni_pb2.AudioOutcome.Name(a.outcome).removeprefix("AUDIO_OUTCOME_").lower()
        seconds = len(result.pcm16) / 2 / max(1, result.sample_rate_hz or a.sample_rate_hz or 1)
        print(
            f"[speech: {outcome}, {seconds:.2f} s written to {args.speak}"
            + (f", {a.code}: {a.message}" if a.code else "")
            + "]",
            file=sys.stderr,
        )
    if args.image_out:
        if result.images:
            Path(args.image_out).write_bytes(result.png())
            img = result.images[0]
            print(f"[image: {img.width}x{img.height} written to {args.image_out}]", file=sys.stderr)
        else:
            print("omnistage: no image in the answer", file=sys.stderr)
            status = 1
    return status


def cmd_bench(args: argparse.Namespace) -> int:
    """Closed-loop sweep of a running gateway with the load harness's driver (load_driver.py): one table
    row per concurrency and kind as it finishes, then the latency details; exit 1 on any error."""
    try:
        address, creds, metadata = _gateway_target(args)
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
        if not levels or min(levels) < 1:
            raise ValueError(
                f"--concurrency: expected positive integers like 1,2,4, got {args.concurrency!r}"
            )
        kinds = [k for k in args.kinds.split(",") if k]
        unknown = [k for k in kinds if k not in KINDS]
        if unknown or not kinds:
            raise ValueError(f"--kinds: a comma-separated list of {', '.join(KINDS)}, got {args.kinds!r}")
    except (ConfigError, SecretError, OSError, ValueError) as exc:
        print(f"omnistage: {exc}", file=sys.stderr)
        return 2
    shape = RequestShape(
        max_tokens=args.max_tokens,
        deadline_s=args.deadline_s,
        timeout_s=args.timeout_s,
        prompt=args.prompt,
        metadata=tuple(metadata),
    )
    print(f"omnistage bench: {address}, {args.requests} requests per level, max_tokens={args.max_tokens}")
    print("\n".join(markdown_table([]).splitlines()[:2]), flush=True)
    try:
        summaries = asyncio.run(
            _bench(address, creds, list(plan(kinds, ["closed"], levels)), args.requests, shape)
        )
    except grpc.RpcError as exc:  # the unmeasured first request of a kind
        print(f"omnistage: bench failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print("\n" + details_table(summaries))
    if args.json:
        Path(args.json).write_text(json.dumps([s.to_json() for s in summaries], indent=1))
    problems = failures(summaries)
    if problems:  # the exit status says "failed": stderr says which requests and why
        print(
            "omnistage bench: exit 1, requests that did not finish as asked (an error status, a failed "
            "finish, or speech not complete):",
            file=sys.stderr,
        )
        print("\n".join(f"  {line}" for line in problems), file=sys.stderr)
    return 1 if problems else 0


async def _bench(
    address: str,
    creds: grpc.ChannelCredentials | None,
    runs: list[tuple[str, str, str]],
    requests: int,
    shape: RequestShape,
) -> list[Summary]:
    options = [("grpc.max_receive_message_length", 64 << 20)]
    channel = (
        grpc.aio.secure_channel(address, creds, options)
        if creds is not None
        else grpc.aio.insecure_channel(address, options)
    )
    async with channel:
        return await run_plan(
            omni_pb2_grpc.OmniStub(channel),
            runs,
            requests,
            shape,
            on_summary=lambda s: print(markdown_table([s]).splitlines()[-1], flush=True),
        )


def _health(address: str, timeout_s: float) -> str:
    """`SERVING`, `NOT_SERVING`, or `unreachable: CODE: details`."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return f"unreachable: {exc.code().name}: {exc.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when one process is SERVING, 1 otherwise (one line on stdout): container health checks.

    ADDRESS asks grpc.health.v1 (the whole server, `service=""`) on a main or admin port;
    `--status-file` reads the status file a process without a gRPC server writes (thinker ranks > 0).
    """
    if bool(args.address) == bool(args.status_file):
        print("omnistage health: give ADDRESS (HOST:PORT) or --status-file FILE", file=sys.stderr)
        return 2
    if args.status_file:
        from omnistage.common.runtime.status_file import read_status

        rec = read_status(Path(args.status_file))
        if rec is None:
            print(f"{args.status_file}: no status yet")
            return 1
        phase = f"failed in {rec.failed_in}: {rec.failure}" if rec.phase == "failed" else rec.phase
        print(f"{rec.service} r{rec.rank} (pid {rec.pid}): {phase}")
        return 0 if rec.phase == "serving" else 1
    health = _health(args.address, args.timeout_s)
    print(f"{args.address}: {health}")
    return 0 if health == "SERVING" else 1


def describe_lines(address: str, timeout_s: float, metadata: tuple = ()) -> tuple[bool, list[str]]:
    """Human-readable Describe + health of one service at its admin address; (serving?, lines)."""
    with grpc.insecure_channel(address) as channel:
        try:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
            d = control_pb2_grpc.ControlStub(channel).Describe(
                control_pb2.DescribeRequest(), timeout=timeout_s, metadata=metadata
            )
        except grpc.RpcError as exc:
            return False, [f"{address}  unreachable: {exc.code().name}: {exc.details()}"]
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
    p = d.progress
    phase = control_pb2.Phase.Name(p.phase).removeprefix("PHASE_").lower()
    count = f" {p.done}/{p.total} {p.unit}" if p.total else (f" {p.done} {p.unit}" if p.done else "")
    kind = control_pb2.StageKind.Name(d.kind).removeprefix("STAGE_KIND_").lower()
    lines = [
        f"{d.name} ({kind}) admin {address}: {status}, phase {phase}{count} ({p.elapsed_s:.1f}s)"
        + (f" {p.detail}" if p.detail else ""),
        f"  version {d.version}, rank {d.rank}/{d.world_size}, pid {d.pid}, config {d.config_hash[:12]}"
        + (f", model {d.model}" if d.model else ""),
        f"  requests: {d.running_requests} running, {d.queued_requests} queued",
    ]
    lim = d.limits
    lines.append(
        f"  limits: max_running {lim.max_running_requests}, max_queued {lim.max_queued_requests}, "
        f"max_message {_mib(lim.max_message_bytes)}"
        + (
            f", max_model_len {lim.max_model_len}, default_max_tokens {lim.default_max_tokens}"
            if lim.max_model_len
            else ""
        )
    )
    for m in d.memory:
        lines.append(
            f"  memory {m.device}: total {_mib(m.total_bytes)} (weights {_mib(m.weights_bytes)}, "
            f"kv {_mib(m.kv_cache_bytes)}, activations {_mib(m.activation_peak_bytes)}, "
            f"graphs {_mib(m.graph_pool_bytes)}, transport {_mib(m.transport_pool_bytes)})"
            + (f", budget {_mib(m.budget_bytes)}" if m.budget_bytes else "")
        )
    for r in d.readiness:  # the gateway: which capabilities it serves now
        lines.append(f"  {r.capability}: " + ("ready" if r.ready else f"not ready ({r.reason})"))
    if d.failure:
        lines.append(f"  failure: {d.failure}")
    return health.status == health_pb2.HealthCheckResponse.SERVING, lines


def service_lines(cfg: DeployConfig, svc: ServiceConfig, timeout_s: float) -> tuple[bool, list[str]]:
    """Status of one service of a deploy file: Describe on its admin port, else its main port's health."""
    admin = cfg.admin_address(svc.name)
    if admin:
        ok, lines = describe_lines(admin, timeout_s, auth.admin_metadata(svc))
        lines[0] += f" (serves at {cfg.address(svc.name)})"
        return ok, lines
    if svc.tls is None:
        health = _health(cfg.address(svc.name), timeout_s)
    else:
        health = "health not checked (TLS)"
    return health == "SERVING", [
        f"{svc.name} ({svc.kind}) at {cfg.address(svc.name)}: {health} "
        f"(no admin port: set services.{svc.name}.admin_port to see its phase)"
    ]


def cmd_status(args: argparse.Namespace) -> int:
    if args.config or not args.address:
        try:
            _from_run(args)
            cfg = _config(args)
            results = [service_lines(cfg, svc, args.timeout_s) for svc in cfg.services.values()]
        except (ConfigError, SecretError) as exc:
            print(f"omnistage: {exc}", file=sys.stderr)
            return 2
    else:
        try:
            metadata = (
                _key_from(args.admin_key_env, "--admin-key-env") if args.admin_key_env else _stage_key()
            )
        except SecretError as exc:
            print(f"omnistage: {exc}", file=sys.stderr)
            return 2
        results = [describe_lines(args.address, args.timeout_s, metadata)]
    all_ok = True
    for ok, lines in results:
        all_ok &= ok
        print(terminal_safe("\n".join(lines)))  # phase details and failures quote what services say
    return 0 if all_ok else 1


def _stage_key() -> tuple[tuple[str, str], ...]:
    """What `status --address` presents without --admin-key-env: the stage key ($OMNISTAGE_STAGE_KEY,
    else the one this user's running `serve` left), which a stage's admin port takes as its admin key."""
    key = auth.stage_key()
    if not key:
        from omnistage.common import run_record

        record = run_record.current()
        key = auth.published_stage_key(record.config) if record is not None else ""
    return auth.bearer(key) if key else ()


def _control(args: argparse.Namespace) -> tuple[ServiceConfig, str, tuple]:
    """(service, admin address, metadata) of `--service` in `--config`."""
    cfg = _config(args)
    svc = cfg.service(args.service)
    address = cfg.admin_address(svc.name)
    if not address:
        raise ConfigError(
            f"services.{svc.name}.admin_port: not set; Control (Drain, Resume) is served only there"
        )
    return svc, address, auth.admin_metadata(svc)


def _call_control(
    args: argparse.Namespace, rpc: str, request: Any, timeout_s: Callable[[ServiceConfig], float]
) -> tuple[ServiceConfig, Any] | int:
    """Control.<rpc> on the admin port of `--service`: (service, reply), or the exit code once the
    reason is printed (2: the config or the admin key, 1: the call)."""
    try:
        _from_run(args)
        svc, address, metadata = _control(args)
    except (ConfigError, SecretError) as exc:
        print(f"omnistage: {exc}", file=sys.stderr)
        return 2
    with grpc.insecure_channel(address) as channel:
        try:
            call = getattr(control_pb2_grpc.ControlStub(channel), rpc)
            return svc, call(request, timeout=timeout_s(svc), metadata=metadata)
        except grpc.RpcError as exc:
            print(f"omnistage: {rpc.lower()} failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1


def cmd_drain(args: argparse.Namespace) -> int:
    def timeout_s(svc: ServiceConfig) -> float:
        return (args.deadline_ms / 1000 if args.deadline_ms else svc.drain_grace_s) + 30.0

    result = _call_control(args, "Drain", control_pb2.DrainRequest(deadline_ms=args.deadline_ms), timeout_s)
    if isinstance(result, int):
        return result
    svc, reply = result
    resume = [
        "omnistage",
        "resume",
        "--config",
        args.config,
        *(w for o in args.overrides for w in ("--set", o)),
        "--service",
        svc.name,
    ]
    print(
        f"omnistage: {svc.name} draining: {reply.completed} requests finished, {reply.aborted} aborted; "
        f"new requests get UNAVAILABLE until `{shlex.join(resume)}`"
    )
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    result = _call_control(args, "Resume", control_pb2.ResumeRequest(), lambda svc: args.timeout_s)
    if isinstance(result, int):
        return result
    print(f"omnistage: {result[0].name} serving again")
    return 0


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


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", help="deploy YAML (the one `serve` runs; default: this user's running `serve`)"
    )
    _overrides_arg(p, "the same overrides as `serve` (repeatable)")


def _overrides_arg(p: argparse.ArgumentParser, help_text: str) -> None:
    """`--set KEY.PATH=VALUE` (repeatable) into `args.overrides`: `serve`'s and every command's that reads its config."""
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE", help=help_text
    )


def _service_args(p: argparse.ArgumentParser) -> None:
    """One service of a deploy file (drain, resume)."""
    _config_args(p)
    p.add_argument("--service", required=True, help="service name (key under services:)")


def _gateway_args(p: argparse.ArgumentParser) -> None:
    """Where and how a client command (generate, bench) calls the gateway."""
    _config_args(p)
    p.add_argument("--address", metavar="HOST:PORT", help="the gateway (default: from --config)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="deadline of each request")
    p.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="environment variable holding the API key (default: the gateway's api_keys_env / api_keys_file)",
    )
    p.add_argument(
        "--ca-file", default="", help="TLS: CA to trust (default with --config: the gateway's certificate)"
    )
    p.add_argument("--cert-file", default="", help="TLS: client certificate (mutual TLS)")
    p.add_argument("--key-file", default="", help="TLS: client key (mutual TLS)")


Subparsers = Any  # argparse's _SubParsersAction (private)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnistage", description="Stage-wise gRPC serving of omni-modal models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_parser(sub)
    _checkpoint_parsers(sub)
    _generate_parser(sub)
    _bench_parser(sub)
    _admin_parsers(sub)
    _key_parsers(sub)
    p = sub.add_parser("protos", help="regenerate omnistage/v1 *_pb2 code from the .proto files")
    p.add_argument("--check", action="store_true", help="exit 1 when the committed generated code is stale")
    p.set_defaults(fn=cmd_protos)
    version = f"omnistage {omnistage_version()}"
    for p in (parser, *sub.choices.values()):
        p.add_argument("--version", action="version", version=version)
    return parser


def _key_parsers(sub: Subparsers) -> None:
    p = sub.add_parser(
        "stage-key",
        help="print the stage key of this user's running `serve` (for calling a stage's ports directly)",
    )
    _config_args(p)
    p.set_defaults(fn=cmd_stage_key)

    p = sub.add_parser(
        "keys", help="write fresh deployment keys (API, admin, stage, Grafana) to a 0600 env file"
    )
    p.add_argument(
        "--env-file",
        required=True,
        metavar="PATH",
        help="docker-compose --env-file / kubectl --from-env-file",
    )
    p.add_argument("--api-keys", type=int, default=1, help="how many client keys OMNISTAGE_API_KEYS holds")
    p.add_argument("--force", action="store_true", help="replace an existing file (new keys)")
    p.set_defaults(fn=cmd_keys)


def _serve_parser(sub: Subparsers) -> None:
    p = sub.add_parser("serve", help="start every service of a deploy file and supervise them")
    p.add_argument("config", help="deploy YAML (e.g. deploy/local-tiny.yaml)")
    _overrides_arg(p, "override a config key (repeatable)")
    p.add_argument("--host", default=None, help="address the gateway's public ports bind (its bind_host)")
    p.add_argument("--port", type=int, default=None, help="the gateway's gRPC port (its port)")
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="the gateway's OpenAI-compatible HTTP port (gateway.http_port)",
    )
    p.add_argument("--run-dir", default=None, help="directory for status files (default: a temp dir)")
    p.add_argument("--ready-file", default=None, help="write the gateway address here when ready")
    p.add_argument("--exit-after-ready", action="store_true", help="stop everything once ready (smoke tests)")
    p.add_argument(
        "--check",
        action="store_true",
        help="check the config, the per-GPU memory ledger, the checkpoint, secrets and ports; start nothing",
    )
    p.set_defaults(fn=cmd_serve)


def _checkpoint_parsers(sub: Subparsers) -> None:
    p = sub.add_parser(
        "make-tiny-checkpoint", help="write the tiny random-weight checkpoint in the HF layout"
    )
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_make_tiny_checkpoint)

    p = sub.add_parser(
        "make-config-checkpoint",
        help="write the configs of every part at a real shape + tiny tokenizers, no weights (load_format: dummy)",
    )
    p.add_argument("dir")
    p.add_argument("--shape", choices=("ming-flash", "ling-mini", "tiny"), default="ming-flash")
    p.set_defaults(fn=cmd_make_config_checkpoint)


def _generate_parser(sub: Subparsers) -> None:
    p = sub.add_parser("generate", help="send one text prompt to the gateway and stream the answer")
    _gateway_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--image", action="append", default=[], metavar="FILE", help="an input image (repeatable)")
    p.add_argument(
        "--audio", action="append", default=[], metavar="FILE", help="an input audio clip (repeatable)"
    )
    p.add_argument("--video", action="append", default=[], metavar="FILE", help="an input video (repeatable)")
    p.add_argument(
        "--speak", metavar="OUT.wav", help="also speak the answer (MODALITY_AUDIO) into this WAV file"
    )
    p.add_argument("--voice", default="", help="preset voice of --speak (default: the talker's)")
    p.add_argument(
        "--image-out", metavar="OUT.png", help="also generate an image (MODALITY_IMAGE) into this PNG"
    )
    p.add_argument(
        "--image-size", default="", metavar="WxH", help="size of --image-out (default: the stage's)"
    )
    p.add_argument(
        "--image-steps", type=int, default=0, help="denoising steps of --image-out (0: the stage's)"
    )
    p.add_argument(
        "--guidance-scale", type=float, default=0.0, help="guidance of --image-out (0: the stage's)"
    )
    p.add_argument("--system-prompt", default="")
    p.add_argument("--max-tokens", type=int, default=0, help="0: the server's default")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=0.0, help="0: off")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling (and of the image's noise)")
    p.set_defaults(fn=cmd_generate)


def _bench_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "bench",
        help="closed-loop load sweep against a running gateway (load_tests/pipeline_load.py's driver)",
    )
    _gateway_args(p)
    p.add_argument(
        "--kinds",
        default="text",
        help="comma-separated request kinds: text, vision (image + text in), speech, image, mixed",
    )
    p.add_argument("--concurrency", default="1,2,4", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=16, help="requests per level (at least the concurrency)")
    p.add_argument("--prompt", default="", help="the prompt of every request (default: one per kind)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (ignore_eos)")
    p.add_argument(
        "--deadline-s", type=float, default=30.0, help="goodput: a request OK within this many seconds"
    )
    p.add_argument("--json", metavar="FILE", help="also write every level's summary as JSON")
    p.set_defaults(fn=cmd_bench)


def _admin_parsers(sub: Subparsers) -> None:
    """status, health, drain and resume: the commands of an operator of a running deployment."""
    p = sub.add_parser(
        "status", help="phase, health and limits of every service of a deploy file (or one admin address)"
    )
    _config_args(p)
    p.add_argument(
        "--address", metavar="ADMIN_HOST:PORT", help="one service's admin port instead of --config"
    )
    p.add_argument(
        "--admin-key-env", metavar="VAR", help="with --address: environment variable holding the admin key"
    )
    p.add_argument("--timeout-s", type=float, default=2.0)
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser(
        "health",
        help="exit 0 when a service is SERVING (grpc.health.v1), 1 otherwise: container health checks",
    )
    p.add_argument("address", nargs="?", metavar="HOST:PORT", help="a main or admin port (plaintext)")
    p.add_argument(
        "--status-file",
        metavar="FILE",
        help="instead: the status file of a process without a gRPC server (<run-dir>/<service>.r<rank>.json)",
    )
    p.add_argument("--timeout-s", type=float, default=2.0)
    p.set_defaults(fn=cmd_health)

    p = sub.add_parser("drain", help="stop one service taking requests (Control.Drain on its admin port)")
    _service_args(p)
    p.add_argument(
        "--deadline-ms", type=int, default=0, help="wait this long for in-flight requests (0: drain_grace_s)"
    )
    p.set_defaults(fn=cmd_drain)

    p = sub.add_parser("resume", help="let a drained service take requests again (Control.Resume)")
    _service_args(p)
    p.add_argument("--timeout-s", type=float, default=10.0)
    p.set_defaults(fn=cmd_resume)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.fn(args)
        sys.stdout.flush()  # here, not at exit: a reader that left is seen where it can be handled
        return code
    except BrokenPipeError:  # `omnistage status | head`: the reader left; no traceback, the shell's code
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not raise again
        return 141


if __name__ == "__main__":
    sys.exit(main())
