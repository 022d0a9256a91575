"""The lossy codecs' encode and decode speed per core, two checkouts in alternating processes.

Each process (a fresh interpreter with `PYTHONPATH` at one checkout, torch on one thread)
times, per codec, the best of `--batches` batches of `--blocks` Llama-3-8B blocks (2 MiB):
encode "streamed" (each payload dropped before the next, as a writer that sends as it
encodes), encode "kept" (all held, as a tier's write batch), decode into blocks already in
memory, and a `memcpy` of the same bytes between blocks (the ceiling of one pass). Processes
alternate A, B, B, A, ... so the machine's noise falls on both; the table gives each side's
median over its processes, B/A, and each rate over the same processes' `memcpy`. Only
`tiers.codecs` is imported from the checkouts, so any revision with the codecs can be A.

    python -m bench.codec_ab --before /tmp/old-codec --after . --procs 3

`scripts/codec_before_after.sh REV` makes the "before" checkout with `git worktree`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPE = (32, 2, 16, 8, 128)
KINDS = ("int8", "fp8", "k8v4")
FIGURES = ("encode_streamed", "encode_kept", "decode")


def measure(dtype_name: str, blocks: int, batches: int) -> dict[str, object]:
    """This process's rates (GB/s of block bytes) for every codec and a memcpy."""
    import torch

    from tiers.codecs import CodecKind, build_codec

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    srcs = []
    for _ in range(blocks):
        x = torch.randn(SHAPE, generator=g)
        x[:, 0, :, :, [10, 74, 50, 114]] *= 10  # outlier key channels, as `bench codecs`
        srcs.append(x.to(dtype))
    dsts = [torch.empty_like(s) for s in srcs]
    nbytes = blocks * srcs[0].numel() * srcs[0].element_size()

    def best(fn) -> float:  # type: ignore[no-untyped-def]
        fn()  # warm: scratch buffers, the allocator
        times = []
        for _ in range(batches):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return nbytes / min(times) / 1e9

    out: dict[str, object] = {"memcpy": best(lambda: [d.copy_(s) for s, d in zip(srcs, dsts)])}
    for name in KINDS:
        out[name] = _rates(build_codec(getattr(CodecKind, name.upper()), SHAPE, dtype), srcs, dsts, best)
    return out


def _rates(codec, srcs, dsts, best) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """One codec's encode (streamed, kept) and decode rates, timed by `best`."""
    payloads = [bytes(codec.encode(s) or b"") for s in srcs]

    def streamed() -> None:
        for s in srcs:
            codec.encode(s)

    return {"encode_streamed": best(streamed), "encode_kept": best(lambda: [codec.encode(s) for s in srcs]),
            "decode": best(lambda: [codec.decode(p, d) for p, d in zip(payloads, dsts)])}


def run_once(checkout: Path, dtype: str, blocks: int, batches: int) -> dict[str, object]:
    """`measure` in a fresh process importing the codecs from `checkout`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    env["PYTHONPATH"] = str(checkout)
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", dtype, str(blocks), str(batches)],
                          env=env, capture_output=True, text=True, timeout=1800, cwd=str(checkout))
    if done.returncode != 0:
        raise SystemExit(f"codec timing from {checkout} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    loaded: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded


def summary(runs: dict[str, list[dict[str, object]]]) -> list[list[object]]:
    """Rows (codec, figure, median A, median B, B/A, A/memcpy, B/memcpy)."""
    med = {side: {"memcpy": statistics.median(float(r["memcpy"]) for r in rs)}  # type: ignore[arg-type]
           for side, rs in runs.items()}
    rows: list[list[object]] = []
    for name in KINDS:
        for fig in FIGURES:
            a = statistics.median(float(r[name][fig]) for r in runs["before"])  # type: ignore[index]
            b = statistics.median(float(r[name][fig]) for r in runs["after"])  # type: ignore[index]
            rows.append([name, fig, round(a, 3), round(b, 3), round(b / a, 2),
                         round(a / med["before"]["memcpy"], 3), round(b / med["after"]["memcpy"], 3)])
    return rows


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--child"]:
        print(json.dumps(measure(args[1], int(args[2]), int(args[3]))))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.codec_ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="checkout A (the baseline)")
    parser.add_argument("--after", type=Path, default=Path("."), help="checkout B (default: here)")
    parser.add_argument("--procs", type=int, default=3, help="processes of each side, alternating")
    parser.add_argument("--blocks", type=int, default=8, help="blocks of 2 MiB per batch")
    parser.add_argument("--batches", type=int, default=7, help="batches per figure (the best is kept)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here as well")
    ns = parser.parse_args(args)
    for side in (ns.before, ns.after):
        if not (side / "tiers" / "codecs" / "scaled.py").is_file():
            parser.error(f"{side} is not a kvstrata checkout with tiers/codecs/scaled.py")
    if min(ns.procs, ns.blocks, ns.batches) < 1:
        parser.error("--procs, --blocks and --batches must be >= 1")
    runs: dict[str, list[dict[str, object]]] = {"before": [], "after": []}
    for i in range(ns.procs):
        for side in (("before", "after") if i % 2 == 0 else ("after", "before")):
            runs[side].append(run_once(getattr(ns, side).resolve(), ns.dtype, ns.blocks, ns.batches))
    rows = summary(runs)
    from cli.output import print_table

    print_table(f"codecs per core ({ns.dtype}, GB/s, medians of {ns.procs} alternating processes each): "
                f"A = {ns.before}, B = {ns.after}",
                ["codec", "figure", "A", "B", "B/A", "A/memcpy", "B/memcpy"], rows)
    memcpy = {side: [r["memcpy"] for r in rs] for side, rs in runs.items()}
    print(f"memcpy GB/s, A: {memcpy['before']}; B: {memcpy['after']}; load average {os.getloadavg()}")
    result = {"how": f"A vs B in alternating processes, {ns.procs} each; per process best of {ns.batches} batches "
                     f"of {ns.blocks} blocks of 2 MiB; torch.set_num_threads(1)",
              "dtype": ns.dtype, "before": str(ns.before), "after": str(ns.after), "rows": rows, "runs": runs,
              "load_average_end": os.getloadavg()}
    if ns.out is not None:
        ns.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    here = Path(__file__).resolve().parent  # run as a file: bench/ itself is first on the path, and
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]  # bench/tiers.py is no `tiers`
    raise SystemExit(main())
