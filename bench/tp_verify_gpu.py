"""Tensor-parallel verification of the thinker on a multi-GPU machine, in one command (self-checking).

    source bench/device_env.sh                       # on a lent GPU machine (see bench/device_wheels.sh)
    python bench/tp_verify_gpu.py --tp 4             # GPUs 0..3
    python bench/tp_verify_gpu.py --tiny --tp 2      # CPU, gloo, tiny shape: this script's own test

(a) a config-only Ming-flash-omni-2.0 checkpoint (config.json + tiny tokenizer, no weights);
(b) `omnistage serve` of the production topology (thinker TP=N, bf16, `load_format: dummy`, memory
    budget 0.9 of each GPU, + gateway), started K times in a row: ready time, per-phase seconds
    and the KV size each rank chose;
(c) greedy tokens through the gateway at TP=N equal TP=1 (and TP=2) on a smaller shape in fp32
    (--tiny: TP=N's from the last start of (b), which has that shape and dtype);
(d) an out-of-memory error in a warm-up forward on rank N-1, then on rank 0 (spawned ranks, no
    launcher: the TP machinery alone): every rank gone within tp.failure_exit_s (30 s) of the
    failure, all with one diagnostic naming the rank;
(e) on the last start of (b): SIGKILL of the last rank while 16 requests stream: every client gets
    UNAVAILABLE naming the rank within 10 s, serve exits non-zero naming it, no process left.
Prints a table last; writes $OUT/tp_verify.json when OUT is set (else --json). Exit 0 only if every
check passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omnistage.common.bench_results import write_result

GiB = 1 << 30
# (c): Ming's attention geometry and routing at a size that fits one GPU in fp32 (~2.4 B parameters);
# every TP size up to 8 divides it (KV heads are replicated past 4 ranks).
MING_SMALL = dict(
    vocab_size=157184,
    hidden_size=2048,
    num_hidden_layers=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=5632,
    first_k_dense_replace=1,
    num_experts=64,
    num_experts_per_tok=8,
    num_shared_experts=1,
    moe_intermediate_size=512,
    n_group=8,
    topk_group=4,
)
_STARTED = re.compile(r"^omnistage: started (\S+) r(\d+) \(pid (\d+)\)$", re.M)
_STARTUP_DONE = re.compile(r"thinker\[r(\d+)\] INFO start-up done: (\{.*\})$", re.M)
PARITY_PROMPTS = ["Count to ten.", "Describe the weather in Hangzhou.", "你好，世界！", "def main():"]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    data: dict = field(default_factory=dict)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


# --- omnistage serve -------------------------------------------------------------------------


class Serve:
    """`omnistage serve` of one deploy file; output in files, readable at any time."""

    def __init__(self, work: Path, name: str, cfg: dict) -> None:
        self.path = work / f"{name}.yaml"
        self.path.write_text(yaml.safe_dump(cfg))
        self.ready = work / f"{name}.ready"
        self.out, self.err = work / f"{name}.out", work / f"{name}.err"
        self.started = time.monotonic()
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "omnistage.common.cli",
                    "serve",
                    str(self.path),
                    "--ready-file",
                    str(self.ready),
                ],
                stdout=o,
                stderr=e,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )

    def logs(self, n: int = 3000) -> str:
        return (self.out.read_text() + self.err.read_text())[-n:]

    def wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while not (self.ready.exists() and self.ready.read_text().strip()):
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode} before ready:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve not ready within {timeout_s:g}s:\n{self.logs()}")
            time.sleep(0.2)
        return self.ready.read_text().strip()

    def children(self) -> dict[tuple[str, int], int]:
        return {(m[1], int(m[2])): int(m[3]) for m in _STARTED.finditer(self.out.read_text())}

    def startup_records(self) -> dict[int, dict]:
        return {int(m[1]): json.loads(m[2]) for m in _STARTUP_DONE.finditer(self.err.read_text())}

    def stop(self, timeout_s: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(30)

    def leftovers(self, timeout_s: float = 10) -> list[int]:
        """Our processes still alive after `timeout_s` (then killed)."""
        pids = list(self.children().values())
        deadline = time.monotonic() + timeout_s
        while True:
            left = [p for p in pids if _alive(p)] + _pgrep(str(self.path))
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return sorted(set(left))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


def _pgrep(pattern: str) -> list[int]:
    """Processes whose command line holds `pattern` (the deploy file's path), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if pattern in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
    return [p for p in found if _alive(p)]


def deploy(args: argparse.Namespace, ckpt: Path, tp: int, dtype: str, *, production: bool) -> dict:
    """The production topology (thinker TP + gateway); --tiny: the same on CPU with small limits."""
    gw, th, dist = free_ports(3)
    if args.tiny:
        engine = {"max_num_seqs": 16, "max_num_batched_tokens": 128, "max_model_len": 512}
        device: dict = {"device": "cpu"}
    else:
        engine = {"max_num_seqs": 64, "max_num_batched_tokens": 4096, "max_model_len": 8192}
        device = {"device": "cuda", "gpus": list(range(tp)), "memory": {"budget_fraction": 0.9}}
    if not production:  # parity: small, quick, one request at a time is enough
        engine = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 512}
    thinker = {
        "kind": "thinker",
        "port": th,
        "tp_size": tp,
        "dist_port": dist,
        "dtype": dtype,
        "engine": engine,
        **device,
    }
    return {
        "model": {"checkpoint": str(ckpt), "load_format": "dummy"},
        # No restarts: check (e) is how a lost rank ends the pipeline (the restart is tested apart).
        "supervision": {"max_restarts": 0},
        "services": {"thinker": thinker, "gateway": {"kind": "gateway", "port": gw}},
    }


# --- gRPC clients ----------------------------------------------------------------------------


def generate(address: str, text: str, max_tokens: int, timeout_s: float) -> list[int]:
    import grpc
    from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc

    request = omni_pb2.GenerateRequest(
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=text)])],
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    with grpc.insecure_channel(address) as ch:
        events = list(omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=timeout_s))
    return [t for e in events if e.WhichOneof("event") == "text" for t in e.text.token_ids]


@dataclass
class Stream:
    events: int = 0
    code: str = ""
    details: str = ""
    ended: float = 0.0


def stream(address: str, max_tokens: int, first: threading.Event, out: Stream) -> None:
    import grpc
    from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc

    request = omni_pb2.GenerateRequest(
        messages=[
            omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Tell a story.")])
        ],
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    with grpc.insecure_channel(address) as ch:
        try:
            for _ in omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=300):
                out.events += 1
                first.set()
            out.code = "OK"
        except grpc.RpcError as exc:
            out.code, out.details = exc.code().name, exc.details() or ""
    out.ended = time.time()


# --- (b) + (e) -------------------------------------------------------------------------------


def check_starts(args: argparse.Namespace, work: Path, ckpt: Path) -> tuple[list[Check], Serve | None]:
    checks, serve = [], None
    for k in range(1, args.starts + 1):
        serve = Serve(work, f"prod-{k}", deploy(args, ckpt, args.tp, args.dtype, production=True))
        name = f"(b) start {k}/{args.starts}"
        try:
            serve.wait_ready(args.start_timeout_s)
        except RuntimeError as exc:
            checks.append(Check(name, False, str(exc)[-600:]))
            serve.stop()
            serve.leftovers()
            return checks, None
        ready_s = time.monotonic() - serve.started
        recs = serve.startup_records()
        r0 = recs.get(0, {})
        kv = sorted({r["kv_blocks"] for r in recs.values()})
        phases = ", ".join(f"{p} {s:.1f}s" for p, s in r0.get("phase_seconds", {}).items())
        skipped = [r["rank"] for r in recs.values() if r["warmup_skipped"]]
        ok = len(recs) == args.tp and len(kv) == 1 and not skipped
        detail = (
            f"ready {ready_s:.1f}s; r0 {phases}; KV {kv} blocks = {r0.get('kv_tokens', 0)} tokens "
            f"({r0.get('kv_bytes', 0) / GiB:.2f} GiB/rank), attempts {sorted({r['kv_attempts'] for r in recs.values()})}, "
            f"weights {r0.get('weights_bytes', 0) / GiB:.2f} GiB/rank"
            + (f"; warm-up skipped on {skipped}" if skipped else "")
        )
        checks.append(Check(name, ok, detail, {"ready_s": ready_s, "ranks": recs}))
        if k < args.starts:
            code = serve.stop()
            left = serve.leftovers()
            checks.append(Check(f"(b) stop {k}", code == 0 and not left, f"exit {code}, left {left}"))
    return checks, serve


def check_sigkill(args: argparse.Namespace, serve: Serve) -> Check:
    address = serve.ready.read_text().strip()
    victim = args.tp - 1
    results = [Stream() for _ in range(args.streams)]
    firsts = [threading.Event() for _ in results]
    threads = [
        threading.Thread(target=stream, args=(address, args.stream_tokens, f, r), daemon=True)
        for f, r in zip(firsts, results, strict=True)
    ]
    for t in threads:
        t.start()
    name = f"(e) SIGKILL rank {victim}, {args.streams} streams"
    if not all(f.wait(120) for f in firsts):
        serve.stop()
        return Check(name, False, f"not every stream got an event within 120s:\n{serve.logs()}")
    pid = serve.children()[("thinker", victim)]
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(120)
    try:
        code = serve.proc.wait(120)
    except subprocess.TimeoutExpired:
        code = None
    gone = time.time() - killed
    left = serve.leftovers()
    if code is None:
        serve.stop()
    delays = [r.ended - killed for r in results]
    unavailable = [r for r in results if r.code == "UNAVAILABLE" and f"rank {victim} died" in r.details]
    err = serve.err.read_text()
    named = f"omnistage: thinker r{victim} died: killed by SIGKILL" in err
    ok = (
        len(unavailable) == len(results)
        and max(delays) <= 10
        and code not in (0, None)
        and named
        and not left
    )
    odd = [f"{r.code} {r.details[:120]}" for r in results if r not in unavailable][:3]
    detail = (
        f"{len(unavailable)}/{len(results)} UNAVAILABLE naming rank {victim}, slowest {max(delays):.1f}s after the "
        f"kill; serve exit {code} {gone:.1f}s after, {'names' if named else 'does NOT name'} thinker r{victim}; "
        f"left {left}" + (f"; others: {odd}" if odd else "")
    )
    sample = unavailable[0].details if unavailable else ""
    return Check(name, ok, detail, {"delays_s": delays, "exit_code": code, "client_message": sample})


# --- (c) -------------------------------------------------------------------------------------


def parity_tokens(args: argparse.Namespace, address: str) -> list[list[int]]:
    return [generate(address, p, args.parity_tokens, 300) for p in PARITY_PROMPTS]


def tokens_before_the_kill(args: argparse.Namespace, last: Serve | None) -> dict[int, list[list[int]]]:
    """--tiny: the last production serve has the parity's shape (tiny) and dtype (fp32), so its TP=N
    greedy tokens are taken before (e) kills it: one serve fewer (a GPU's production shape differs)."""
    if not (args.tiny and args.dtype == "float32" and last is not None):
        return {}
    try:
        return {args.tp: parity_tokens(args, last.ready.read_text().strip())}
    except Exception as exc:  # noqa: BLE001 - (c) then serves TP=N itself
        print(f"(c) on the production serve: {type(exc).__name__}: {str(exc)[-300:]}", file=sys.stderr)
        return {}


def check_parity(args: argparse.Namespace, work: Path, tokens: dict[int, list[list[int]]]) -> list[Check]:
    """`tokens`: the TP sizes whose tokens are in already (`tokens_before_the_kill`)."""
    from omnistage.common.checkpoint.config_only import write_config_checkpoint

    shape = "tiny" if args.tiny else MING_SMALL
    ckpt = write_config_checkpoint(work / "ckpt-small", shape)
    sizes = sorted({1, 2, args.tp} & set(range(1, args.tp + 1)))
    checks = []
    for tp in [tp for tp in sizes if tp not in tokens]:
        serve = Serve(work, f"parity-tp{tp}", deploy(args, ckpt, tp, "float32", production=False))
        try:
            address = serve.wait_ready(args.start_timeout_s)
            tokens[tp] = parity_tokens(args, address)
        except Exception as exc:  # noqa: BLE001 - reported as a failed check
            checks.append(Check(f"(c) parity TP={tp}", False, f"{type(exc).__name__}: {str(exc)[-500:]}"))
            if os.environ.get("OUT"):  # the whole serve log comes back for a look
                Path(os.environ["OUT"], f"parity-tp{tp}.log").write_text(serve.logs(10**7))
        finally:
            serve.stop()
            serve.leftovers()
    if 1 not in tokens:
        return checks
    for tp in sizes[1:]:
        if tp not in tokens:
            continue
        same = sum(a == b for a, b in zip(tokens[tp], tokens[1], strict=True))
        first_diff = [_first_difference(a, b) for a, b in zip(tokens[tp], tokens[1], strict=True)]
        ok = same == len(PARITY_PROMPTS) and all(len(t) == args.parity_tokens for t in tokens[tp])
        checks.append(
            Check(
                f"(c) greedy TP={tp} == TP=1 (fp32)",
                ok,
                f"{same}/{len(PARITY_PROMPTS)} prompts identical over {args.parity_tokens} tokens; first differences {first_diff}",
                {"tokens": tokens[tp], "reference": tokens[1]},
            )
        )
    return checks


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None if len(a) == len(b) else 0
    )


# --- (d) -------------------------------------------------------------------------------------


def _oom_rank(cfg_dict: dict, out: str) -> None:
    """One spawned rank: start-up with the warm-up fault; the group failure it sees goes to `out`."""
    from omnistage.common.config import EngineConfig, FaultConfig, MemoryConfig
    from omnistage.common.log import setup_logging
    from omnistage.services.thinker.group.startup import LogProgress, RankConfig, StartupError, start_rank

    rank = cfg_dict["rank"]
    setup_logging("thinker", rank=rank)
    lock, written = threading.Lock(), [False]

    def write(**data) -> None:
        with lock:
            if not written[0]:
                Path(out).write_text(json.dumps(data))
                written[0] = True

    class Progress(LogProgress):
        def failed(self, failure) -> None:
            write(message=failure.message, culprit=failure.rank, noticed_unix=time.time())

    cfg = RankConfig(
        cfg_dict["ckpt"],
        EngineConfig(**cfg_dict["engine"]),
        MemoryConfig(**cfg_dict["memory"]),
        load_format="dummy",
        dtype=cfg_dict["dtype"],
        device=cfg_dict["device"],
        rank=rank,
        world_size=cfg_dict["world_size"],
        dist_port=cfg_dict["port"],
        fault=FaultConfig(**cfg_dict["fault"]),
    )
    try:
        start_rank(cfg, Progress(rank))
    except StartupError as exc:
        write(message=str(exc), culprit=exc.failure.rank, noticed_unix=time.time())
        os._exit(1)
    write(message="", culprit=-1, noticed_unix=0.0, finished=True)
    os._exit(0)


def check_oom(args: argparse.Namespace, work: Path, ckpt: Path, bad: int) -> Check:
    from omnistage.common.config import TPConfig

    bound = TPConfig().failure_exit_s
    ctx = mp.get_context("spawn")
    port = free_ports(1)[0]
    prod = deploy(args, ckpt, args.tp, args.dtype, production=True)["services"]["thinker"]
    procs, outs = [], []
    for rank in range(args.tp):
        out = work / f"oom-r{bad}-rank{rank}.json"
        out.unlink(missing_ok=True)
        cfg = {
            "ckpt": str(ckpt),
            "engine": prod["engine"],
            "memory": prod.get("memory", {}),
            "dtype": args.dtype,
            "device": "cpu" if args.tiny else f"cuda:{rank}",
            "rank": rank,
            "world_size": args.tp,
            "port": port,
            "fault": {"phase": "warming_up", "action": "oom", "rank": bad, "at": "warmup_forward"},
        }
        procs.append(ctx.Process(target=_oom_rank, args=(cfg, str(out)), name=f"oom-rank{rank}"))
        outs.append(out)
    for p in procs:
        p.start()
    exits: dict[int, float] = {}
    deadline = time.monotonic() + args.start_timeout_s
    while len(exits) < len(procs) and time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if r not in exits and not p.is_alive():
                exits[r] = time.time()
        time.sleep(0.05)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)
    results = [json.loads(o.read_text()) if o.exists() else {} for o in outs]
    messages = {r.get("message", "") for r in results}
    noticed = [r["noticed_unix"] for r in results if r.get("noticed_unix")]
    spread = max(exits.values()) - min(noticed) if noticed and exits else math.inf
    want = f"rank {bad} failed in warm-up shape"
    ok = not hung and len(messages) == 1 and want in next(iter(messages)) and spread <= bound + 2
    detail = (
        f"all {args.tp} ranks gone {spread:.1f}s after the failure (bound {bound:g}s)"
        if not hung
        else f"ranks {hung} still running {args.start_timeout_s:g}s after start"
    ) + f"; {len(messages)} diagnostic(s): {sorted(messages)[0][:160]!r}"
    return Check(f"(d) OOM in warm-up on rank {bad}", ok, detail, {"results": results, "spread_s": spread})


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="CPU, gloo, tiny shape (tests this script)")
    ap.add_argument("--starts", type=int, default=3, help="(b): production start-ups in a row")
    ap.add_argument("--checks", default="b,c,d,e", help="which of b,c,d,e to run (a always runs)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--stream-tokens", type=int, default=None, help="per stream (default 2000; tiny 450)")
    ap.add_argument("--parity-tokens", type=int, default=32)
    ap.add_argument(
        "--oom-ranks", default="", help="(d): ranks that fail in warm-up, comma-separated (default: last, 0)"
    )
    ap.add_argument("--dtype", default=None, help="production dtype (default bfloat16; tiny float32)")
    ap.add_argument("--start-timeout-s", type=float, default=600)
    ap.add_argument(
        "--json", default="", help="write the JSON report here ($OUT/tp_verify.json when OUT is set)"
    )
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    args.stream_tokens = args.stream_tokens or (450 if args.tiny else 2000)
    wanted = set(args.checks.split(","))
    import torch

    if not args.tiny and torch.cuda.device_count() < args.tp:
        print(
            f"--tp {args.tp} needs {args.tp} GPUs, found {torch.cuda.device_count()} (CPU: --tiny)",
            file=sys.stderr,
        )
        return 2
    device = (
        "cpu (gloo, tiny shape)"
        if args.tiny
        else f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    )
    from omnistage.common.checkpoint.config_only import write_config_checkpoint

    checks: list[Check] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tp-verify-") as tmp:
        work = Path(tmp)
        ckpt = write_config_checkpoint(work / "ckpt", "tiny" if args.tiny else "ming-flash")
        cfg = json.loads((ckpt / "config.json").read_text())["llm_config"]
        checks.append(
            Check(
                "(a) config-only checkpoint",
                not list(ckpt.glob("*.safetensors*")),
                f"{'tiny' if args.tiny else 'ming-flash'}: hidden {cfg['hidden_size']}, "
                f"{cfg['num_hidden_layers']} layers, {cfg['num_experts']} experts, vocab {cfg['vocab_size']}",
            )
        )
        last, parity = None, {}  # parity: TP size -> greedy tokens taken on the production serve
        if wanted & {"b", "e"}:
            starts, last = check_starts(args, work, ckpt)
            checks += starts
        if "c" in wanted:
            parity = tokens_before_the_kill(args, last)
        if "e" in wanted and last is not None:
            checks.append(check_sigkill(args, last))
        elif last is not None:
            last.stop()
            last.leftovers()
        if "c" in wanted:
            checks += check_parity(args, work, parity)
        if "d" in wanted:
            oom_ranks = [int(r) for r in args.oom_ranks.split(",")] if args.oom_ranks else [args.tp - 1, 0]
            for bad in dict.fromkeys(oom_ranks):
                checks.append(check_oom(args, work, ckpt, bad))
    elapsed = time.monotonic() - started
    width = max(len(c.name) for c in checks)
    print(f"\nTP verification: TP={args.tp} on {device}, torch {torch.__version__}, {elapsed:.0f}s")
    for c in checks:
        print(f"{c.name:<{width}}  {'ok  ' if c.ok else 'FAIL'}  {c.detail}")
    report = {
        "tp": args.tp,
        "device": device,
        "torch": torch.__version__,
        "elapsed_s": round(elapsed, 1),
        "ok": all(c.ok for c in checks),
        "checks": [c.__dict__ for c in checks],
    }
    path = args.json or (str(Path(os.environ["OUT"]) / "tp_verify.json") if os.environ.get("OUT") else "")
    if path:
        write_result(path, report, gpu=not args.tiny)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
