"""The table of bench/decode_variants_gpu.sh: each variant's decode tok/s at each concurrency over its
rounds (median and best; out tok/s with the first tokens' prefill, and the decode rate after them), its
share of the HBM floor, and whether its greedy tokens are the first
variant's (the same dummy weights: a bit-equal change keeps them; a change of sums' order may not).

    python3 bench/decode_variants.py OUT_DIR [--floor 1:1911,2:...] [--out FILE]

reads OUT_DIR/variants/<name>_r<round>.json (bench/ling_mini_gpu.py --out), prints the table and writes
it as JSON to --out (default OUT_DIR/decode_variants.json).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from omnistage.common.bench_results import write_result

# Ling-mini-2.0's HBM floor on one H200 (bench/RESULTS.md: the bytes a step reads at 4.8 TB/s), out tok/s.
LING_MINI_FLOOR = {1: 1911, 8: 4160, 32: 6480}
_RUN = re.compile(r"^(?P<name>.+)_r(?P<round>\d+)\.json$")


def load_runs(folder: Path) -> tuple[dict[str, list[dict]], bool]:
    """Variant name → its runs' rank-0 results, in round order (a run that wrote no JSON is absent);
    and whether every run was a GPU run (its JSON's `gpu`)."""
    runs: dict[str, list[tuple[int, dict]]] = {}
    gpu = True
    for path in sorted(folder.glob("*_r*.json")):
        match = _RUN.match(path.name)
        if match is None:
            continue
        report = json.loads(path.read_text())
        gpu = gpu and bool(report.get("gpu"))
        runs.setdefault(match["name"], []).append((int(match["round"]), (report.get("ranks") or [{}])[0]))
    return {name: [r for _, r in sorted(rows, key=lambda x: x[0])] for name, rows in runs.items()}, gpu


def _stats(vals: list[float], floor: int | None) -> dict:
    """A concurrency's runs: each, their median and best, the median's share of the floor."""
    median = statistics.median(vals)
    return {
        "runs": [round(v, 1) for v in vals],
        "median": round(median, 1),
        "best": round(max(vals), 1),
        **({"floor_pct": round(100 * median / floor, 1)} if floor else {}),
    }


def summarise(runs: dict[str, list[dict]], order: list[str], floor: dict[int, int]) -> list[dict]:
    """One row a variant (in `order`, then any other found): out tok/s (`out`: the first tokens'
    prefill in) and the decode rate after them (`decode`, where the bench reports it) a concurrency,
    over every sweep row of every round, and the first sweep row's tokens against the first variant's."""
    names = [n for n in order if n in runs] + sorted(set(runs) - set(order))
    reference = None
    table = []
    for name in names:
        by_c: dict[int, dict[str, list[float]]] = {}
        tokens = None
        for rank in runs[name]:
            for row in rank.get("sweep") or []:
                level = by_c.setdefault(int(row["concurrency"]), {"out": [], "decode": []})
                level["out"].append(float(row["out_tok_s"]))
                if "decode_tok_s" in row:
                    level["decode"].append(float(row["decode_tok_s"]))
                tokens = tokens or row.get("first_tokens")
        if reference is None:
            reference = tokens
        levels = {
            c: {kind: _stats(vals, floor.get(c)) for kind, vals in level.items() if vals}
            for c, level in sorted(by_c.items())
        }
        table.append(
            {
                "variant": name,
                "rounds": len(runs[name]),
                "tok_s": levels,
                "tokens_as_first": tokens == reference,
            }
        )
    return table


def render(table: list[dict]) -> str:
    """The table as text: a line a variant, `c=N out median (best) decode median (best, % floor)`."""
    lines = []
    for row in table:
        cells = []
        for c, level in row["tok_s"].items():
            cell = f"c={c}"
            for kind, v in level.items():
                pct = f", {v['floor_pct']}%" if "floor_pct" in v else ""
                cell += f" {kind} {v['median']:.1f} (best {v['best']:.1f}{pct})"
            cells.append(cell)
        same = "same tokens" if row["tokens_as_first"] else "OTHER TOKENS"
        lines.append(f"{row['variant']:<24} rounds {row['rounds']}  " + "  ".join(cells) + f"  [{same}]")
    return "\n".join(lines)


def _floor(text: str) -> dict[int, int]:
    return {int(c): int(v) for c, v in (pair.split(":") for pair in text.split(",") if pair)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument(
        "--order", default="", help="variant names in the order to list them (the first: the reference)"
    )
    ap.add_argument("--floor", type=_floor, default=LING_MINI_FLOOR, help="c:tok_s,... (default Ling-mini's)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    runs, gpu = load_runs(args.out_dir / "variants")
    if not runs:
        print(f"no variant results under {args.out_dir / 'variants'}", file=sys.stderr)
        return 1
    table = summarise(runs, [n for n in args.order.split() if n], args.floor)
    print(render(table))
    # a table of CPU (--tiny) runs never replaces one of GPU runs
    write_result(args.out or args.out_dir / "decode_variants.json", {"variants": table}, gpu=gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
