"""The lossy codecs' encode and decode speed per core, two checkouts side by side.

Two processes stay up, one importing the codecs from each checkout (`PYTHONPATH`; torch on
one thread), and take turns: each figure is timed as one batch of `--blocks` Llama-3-8B
blocks (2 MiB) in A, then in B (then B, then A on the next round), for `--rounds` rounds, so
the noise of a shared machine falls on both alike within milliseconds. Figures: encode
"streamed" (each payload dropped before the next, as a writer that sends as it encodes),
encode "kept" (all held, as a tier's write batch), decode into blocks already in memory, and
a `memcpy` of the same bytes between blocks (the ceiling of one pass). The table gives each
side's best batch (the rate with the least interference) and median, B/A of each, and the
best over the same process's best `memcpy`. Only `tiers.codecs` is imported from the
checkouts, so any revision with the codecs can be A.

    python -m bench.codec_ab --before /tmp/old-codec --after . --rounds 40

`scripts/codec_before_after.sh REV` makes the "before" checkout with `git worktree`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

SHAPE = (32, 2, 16, 8, 128)
KINDS = ("int8", "fp8", "k8v4")
FIGURES = ("encode_streamed", "encode_kept", "decode")


class Child:
    """One process timing batches with the codecs of `checkout` (`serve`), on request."""

    def __init__(self, checkout: Path, dtype: str, blocks: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
        env["PYTHONPATH"] = str(checkout)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", dtype, str(blocks)],
                                     env=env, cwd=str(checkout), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.checkout = checkout
        self.ask("ready")

    def ask(self, what: str) -> float:
        """Seconds of one batch of figure `what` ("memcpy", "fp8 decode", ...)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(what + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"codec timing from {self.checkout} ended (exit {self.proc.wait()})")
        return float(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Local:
    """Both sides in this process (`--same-process`): B's codecs from the import path, A's
    from `before`'s `quant.py` and `scaled.py` loaded under other module names (their other
    imports are B's: the tier errors, codec base and thread guard, unchanged between the
    revisions compared here). Each batch of A runs right beside B's on the same core."""

    def __init__(self, before: Path, dtype: str, blocks: int) -> None:
        import torch

        from tiers.codecs import CodecKind, build_codec

        old = _load_old_codecs(before)
        torch.set_num_threads(1)
        srcs, dsts = _blocks(getattr(torch, dtype), blocks)
        self.jobs: dict[str, dict[str, Callable[[], object]]] = {"before": {}, "after": {}}
        for side in self.jobs:
            self.jobs[side]["memcpy"] = lambda: [d.copy_(s) for s, d in zip(srcs, dsts)]
            for name in KINDS:
                kind = getattr(CodecKind, name.upper())
                codec = old.ScaledCodec(kind, SHAPE, getattr(torch, dtype)) if side == "before" else build_codec(
                    kind, SHAPE, getattr(torch, dtype))
                self.jobs[side].update(_jobs(name, codec, srcs, dsts))
            for job in self.jobs[side].values():
                job()

    def ask(self, side: str, what: str) -> float:
        job = self.jobs[side][what]
        t0 = time.perf_counter()
        job()
        return time.perf_counter() - t0


def _load_old_codecs(before: Path) -> types.ModuleType:
    """`before`'s `tiers/codecs/scaled.py` as a module of its own, over its own `quant.py`."""
    modules = {}
    for name in ("quant", "scaled"):
        text = (before / "tiers" / "codecs" / f"{name}.py").read_text()
        text = text.replace("from tiers.codecs.quant import", "from tiers.codecs._ab_before_quant import")
        text = "\n".join(line for line in text.splitlines() if not line.startswith("@register_codec("))
        module = types.ModuleType(f"tiers.codecs._ab_before_{name}")
        sys.modules[module.__name__] = module
        exec(compile(text, str(before / "tiers" / "codecs" / f"{name}.py"), "exec"), module.__dict__)
        modules[name] = module
    return modules["scaled"]


def _blocks(dtype, blocks: int):  # type: ignore[no-untyped-def]
    """`blocks` Llama-3-8B blocks of `dtype` (as `bench codecs`) and as many destinations."""
    import torch

    g = torch.Generator().manual_seed(0)
    srcs = []
    for _ in range(blocks):
        x = torch.randn(SHAPE, generator=g)
        x[:, 0, :, :, [10, 74, 50, 114]] *= 10  # outlier key channels, as `bench codecs`
        srcs.append(x.to(dtype))
    return srcs, [torch.empty_like(s) for s in srcs]


class _Side:
    """One side of a `Local`, asked as a `Child` is."""

    def __init__(self, local: Local, side: str) -> None:
        self.local, self.side = local, side

    def ask(self, what: str) -> float:
        return self.local.ask(self.side, what)

    def close(self) -> None:
        pass


def serve(dtype_name: str, blocks: int) -> None:
    """The child: build the blocks and codecs, then time one batch per line of stdin."""
    import torch

    from tiers.codecs import CodecKind, build_codec

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    srcs, dsts = _blocks(dtype, blocks)
    jobs: dict[str, Callable[[], object]] = {"memcpy": lambda: [d.copy_(s) for s, d in zip(srcs, dsts)],
                                             "ready": lambda: None}
    for name in KINDS:
        jobs.update(_jobs(name, build_codec(getattr(CodecKind, name.upper()), SHAPE, dtype), srcs, dsts))
    for job in jobs.values():
        job()  # warm: scratch buffers, the allocator
    for line in sys.stdin:
        job = jobs[line.strip()]
        t0 = time.perf_counter()
        job()
        print(time.perf_counter() - t0, flush=True)


def _jobs(name, codec, srcs, dsts):  # type: ignore[no-untyped-def]
    """One codec's timed batches by figure name."""
    payloads = [bytes(codec.encode(s) or b"") for s in srcs]

    def streamed() -> None:
        for s in srcs:
            codec.encode(s)

    return {f"{name} encode_streamed": streamed, f"{name} encode_kept": lambda: [codec.encode(s) for s in srcs],
            f"{name} decode": lambda: [codec.decode(p, d) for p, d in zip(payloads, dsts)]}


def summary(times: dict[str, dict[str, list[float]]], nbytes: int) -> list[list[object]]:
    """Rows (figure, A best, B best, B/A best, A median, B median, B/A median, A/memcpy,
    B/memcpy), rates in GB/s."""
    def rate(t: float) -> float:
        return nbytes / t / 1e9

    best = {side: {k: rate(min(v)) for k, v in figs.items()} for side, figs in times.items()}
    med = {side: {k: rate(statistics.median(v)) for k, v in figs.items()} for side, figs in times.items()}
    rows: list[list[object]] = []
    for fig in times["before"]:
        a, b = best["before"][fig], best["after"][fig]
        ma, mb = med["before"][fig], med["after"][fig]
        rows.append([fig, round(a, 3), round(b, 3), round(b / a, 2), round(ma, 3), round(mb, 3), round(mb / ma, 2),
                     round(a / best["before"]["memcpy"], 3), round(b / best["after"]["memcpy"], 3)])
    return rows


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--child"]:
        serve(args[1], int(args[2]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.codec_ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="checkout A (the baseline)")
    parser.add_argument("--after", type=Path, default=Path("."), help="checkout B (default: here)")
    parser.add_argument("--rounds", type=int, default=40, help="batches of each figure per side, taking turns")
    parser.add_argument("--blocks", type=int, default=8, help="blocks of 2 MiB per batch")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here as well")
    parser.add_argument("--same-process", action="store_true",
                        help="both sides in this process, batch beside batch (A: --before's quant.py and scaled.py)")
    ns = parser.parse_args(args)
    for side in (ns.before, ns.after):
        if not (side / "tiers" / "codecs" / "scaled.py").is_file():
            parser.error(f"{side} is not a kvstrata checkout with tiers/codecs/scaled.py")
    if min(ns.rounds, ns.blocks) < 1:
        parser.error("--rounds and --blocks must be >= 1")
    if ns.same_process:
        local = Local(ns.before.resolve(), ns.dtype, ns.blocks)
        children: dict[str, Child | _Side] = {side: _Side(local, side) for side in ("before", "after")}
    else:
        children = {side: Child(getattr(ns, side).resolve(), ns.dtype, ns.blocks) for side in ("before", "after")}
    figures = ["memcpy"] + [f"{k} {f}" for k in KINDS for f in FIGURES]
    times: dict[str, dict[str, list[float]]] = {side: {f: [] for f in figures} for side in children}
    load = [os.getloadavg()[0]]
    try:
        for i in range(ns.rounds):
            for fig in figures:
                for side in (("before", "after") if i % 2 == 0 else ("after", "before")):
                    times[side][fig].append(children[side].ask(fig))
            load.append(os.getloadavg()[0])
    finally:
        for child in children.values():
            child.close()
    nbytes = ns.blocks * math.prod(SHAPE) * 2
    rows = summary(times, nbytes)
    from cli.output import print_table

    print_table(f"codecs per core ({ns.dtype}, GB/s of 2 MiB blocks, {ns.rounds} batches of {ns.blocks} per side, "
                f"taking turns{', one process' if ns.same_process else ''}): A = {ns.before}, B = {ns.after}",
                ["figure", "A best", "B best", "B/A", "A median", "B median", "B/A median", "A/memcpy", "B/memcpy"],
                rows)
    print(f"load average (1 min) during the run: {min(load):.1f}-{max(load):.1f}")
    where = "one process, batch beside batch" if ns.same_process else "two processes taking turns per batch"
    result = {"how": f"A and B in {where}, {ns.rounds} batches of {ns.blocks} blocks "
                     "of 2 MiB per figure and side; best and median batch; torch.set_num_threads(1)",
              "dtype": ns.dtype, "before": str(ns.before), "after": str(ns.after),
              "columns": ["figure", "A best", "B best", "B/A", "A median", "B median", "B/A median", "A/memcpy",
                          "B/memcpy"],
              "rows": rows, "load_average_1min": [min(load), max(load)],
              "seconds": {side: {fig: {"best": min(t), "median": statistics.median(t), "batches": len(t)}
                                 for fig, t in figs.items()} for side, figs in times.items()}}
    if ns.out is not None:
        ns.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    here = Path(__file__).resolve().parent  # run as a file: bench/ itself is first on the path, and
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]  # bench/tiers.py is no `tiers`
    raise SystemExit(main())
