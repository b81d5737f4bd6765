"""The peer all-reduce next to NCCL on GPUs: correctness and µs per call, eager and in a CUDA graph.

    source bench/device_env.sh
    python3 bench/allreduce_gpu.py --out $OUT/allreduce.json              # 2 ranks on GPUs 0 and 1
    python3 bench/allreduce_gpu.py --same-gpu --out $OUT/allreduce_1gpu.json  # 2 ranks on GPU 0

Two (or `--world`) rank processes join the thinker's TP group, record the start-up choice, then per
dtype (bf16, fp32) and message size (4 KiB .. 1 MiB): whether the peer sums (eager and replayed
from a graph) equal the fp32 rank-order sum on every rank bit for bit, NCCL's largest difference
from them, and µs per call of both (`--same-gpu`: CUDA IPC within one GPU, no NCCL, times not
meaningful: the two processes' kernels take turns on the GPU). Last, the stall check: rank 0 calls
alone and must stop after 2 s naming rank 1. Writes {"meta", "rows", "ranks"}; rows have "tp",
"bytes", "dtype", "nccl_us", "peer_us", "nccl_graph_us", "peer_graph_us", "equal". Every rank has a
deadline and the script kills what is left. Exit 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root (tests/…/peer_ranks.py)
from omnistage.common.bench_results import write_result  # noqa: E402

from tests.services.thinker.tp.peer_ranks import PeerCheck, run_ranks  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="allreduce.json")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--same-gpu", action="store_true")
    ap.add_argument("--iters", type=int, default=200, help="eager calls timed per size")
    ap.add_argument("--graph-calls", type=int, default=20, help="calls in one captured graph")
    ap.add_argument("--replays", type=int, default=10, help="graph replays timed per size")
    ap.add_argument("--deadline-s", type=float, default=400.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="allreduce-") as tmp:
        check = PeerCheck(
            tmp,
            world=args.world,
            same_gpu=args.same_gpu,
            iters=args.iters,
            graph_calls=args.graph_calls,
            replays=args.replays,
            deadline_s=args.deadline_s,
        )
        result = run_ranks(check)
    meta = {
        "gpus": torch.cuda.device_count(),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "world": args.world,
        "same_gpu": args.same_gpu,
        "exit_codes": result["exit_codes"],
    }
    write_result(args.out, {"meta": meta, **result}, gpu=meta["gpus"] > 0)
    print(json.dumps(meta))
    for r in result["ranks"]:
        print(f"rank {r.get('rank')}: choice {r.get('choice')} stall {r.get('stall')} error {r.get('error')}")
    print("| dtype | bytes | NCCL µs | peer µs | NCCL graph µs | peer graph µs | equal | NCCL max diff |")
    print("|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        cells = [row[k] for k in ("dtype", "bytes", "nccl_us", "peer_us", "nccl_graph_us", "peer_graph_us")]
        print("| " + " | ".join(str(c) for c in cells) + f" | {row['equal']} | {row['nccl_max_diff']} |")
    stall = result["ranks"][0].get("stall", {}) if result["ranks"] else {}
    passed = (
        result["exit_codes"] == [0] * args.world
        and bool(result["rows"])
        and all(row["equal"] for row in result["rows"])
        and stall.get("named_rank") == 1
    )
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
