"""The CPU decode-attention kernel (``sinkserve_kernels/csrc/decode_attention.c``) alone: an older revision of the
source against the working tree's, built side by side with the same flags, in one process.

Every sequence of the batch decodes one token over ``context`` cached tokens in shuffled 16-token blocks
(Hkv KV heads, G query heads each, float32). Per shape the builds alternate for ``--rounds`` rounds of
``--reps`` calls; the table gives min / median microseconds per call and old / new (medians). The
``portable`` column is the working tree's source built with ``-mno-avx512f`` (the path a CPU without
AVX-512 runs). Outputs of the builds are compared before timing.

``--kv int8|int4|int2`` times the packed-cache entry (``sinkserve_decode_attention_quant``) instead: every
block packed (value group 16, no 16-bit blocks), the same shapes. Before the one attention core (issue 39)
that entry lived in ``csrc/decode_attention_quant.c`` and the float32 one took a score scratch; an old
revision is built from its own ``csrc`` and called with its own signature.

    python -m bench.cpu_decode_attention --out docs/cpu_decode_attention.md
    python -m bench.cpu_decode_attention --kv int4 --old-rev HEAD   # the packed kernel, HEAD vs working tree
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.host import cpu_name  # noqa: E402
from bench.report import emit  # noqa: E402
from sinkserve_kernels.cpu_lib import load_source  # noqa: E402

SOURCE = "sinkserve_kernels/csrc/decode_attention.c"
OLD_QUANT_SOURCE = "sinkserve_kernels/csrc/decode_attention_quant.c"  # before the one core
CSRC = REPO_ROOT / "sinkserve_kernels" / "csrc"  # its headers, for a source built from a temporary file
VALUE_GROUP = 16
# the last revision before the AVX-512 rewrite (two passes, one horizontal sum per key and head)
OLD_REV = "791bb6a9c110"


def uptime() -> str:
    """The load averages (1, 5, 15 minutes)."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def make_inputs(batch: int, context: int, hkv: int, group: int, d: int, block: int, seed: int = 0) -> dict:
    """Random q and caches, each sequence's blocks scattered over the pool (block 0: the null block)."""
    g = torch.Generator().manual_seed(seed)
    per = -(-context // block)
    num_blocks = batch * per + 1
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).to(torch.int32)
    hq = hkv * group
    return dict(q=torch.randn(batch, hq, d, generator=g),
                k=torch.randn(num_blocks, block, hkv, d, generator=g),
                v=torch.randn(num_blocks, block, hkv, d, generator=g),
                tables=perm.view(batch, per).contiguous(),
                lens=torch.full((batch,), context, dtype=torch.int32),
                starts=torch.arange(batch + 1, dtype=torch.int32),
                out=torch.empty(batch, hq, d), hq=hq, hkv=hkv, d=d, block=block)


def make_quant_inputs(batch: int, context: int, hkv: int, group: int, d: int, block: int, bits: int) -> dict:
    """``make_inputs`` with the K/V packed into a ``QuantKVCache`` of ``bits`` (every block packed)."""
    from sinkserve_kernels import torch_kernels
    from sinkserve_kernels.kv_quant import QuantKVCache

    x = make_inputs(batch, context, hkv, group, d, block)
    nb = x["k"].shape[0]
    cache = QuantKVCache.allocate(nb, 1, block, hkv, d, bits=bits, group_size=VALUE_GROUP, dtype=torch.float32)
    torch_kernels.quantize_into(cache, torch.arange(nb), x.pop("k"), x.pop("v"))
    return {**x, "cache": cache}


def call_quant(lib, x: dict) -> None:  # type: ignore[no-untyped-def]
    import ctypes

    from sinkserve_kernels.cpu_attention import quant_cache_args

    kv = quant_cache_args(x["cache"])
    rc = lib.sinkserve_decode_attention_quant(
        x["q"].data_ptr(), x["q"].stride(0), x["q"].stride(1), ctypes.byref(kv), x["tables"].data_ptr(),
        x["tables"].stride(0), x["lens"].data_ptr(), x["starts"].data_ptr(), x["lens"].shape[0], x["hq"], x["hkv"],
        x["d"], x["block"], x["d"] ** -0.5, 0, None, x["out"].data_ptr())
    assert rc == 0, rc


def call(lib, x: dict) -> None:  # type: ignore[no-untyped-def]
    if "cache" in x:
        return call_quant(lib, x)
    # a revision before the one core takes a score scratch: longest span x min(G, 16) floats
    scratch = (x.setdefault("scratch", torch.empty(int(x["lens"].max()) * min(x["hq"] // x["hkv"], 16))),) \
        if getattr(lib, "takes_scratch", False) else ()
    rc = lib.sinkserve_decode_attention(
        x["q"].data_ptr(), x["q"].stride(0), x["q"].stride(1), x["k"].data_ptr(), x["v"].data_ptr(),
        x["tables"].data_ptr(), x["tables"].stride(0), x["lens"].data_ptr(), x["starts"].data_ptr(),
        x["lens"].shape[0], x["hq"], x["hkv"], x["d"], x["block"], x["d"] ** -0.5, 0, None, x["out"].data_ptr(),
        *[a for t in scratch for a in (t.data_ptr(), t.numel())])
    assert rc == 0, rc


def old_build(rev: str, kv: str, tmp: Path, flags: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    """The kernel's source at ``rev`` built with that revision's headers (written under ``tmp``); a float32
    entry that still takes the score scratch gets its own argument types (``takes_scratch``)."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO_ROOT, check=True, capture_output=True,
                              text=True).stdout

    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "sinkserve_kernels/csrc/"], cwd=REPO_ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith(".h"):
            (tmp / Path(name).name).write_text(show(name))
    source = OLD_QUANT_SOURCE if kv != "fp" and OLD_QUANT_SOURCE in names else SOURCE
    src = show(source)
    lib = load_source(src, ("-I", str(tmp), *flags))
    if kv == "fp" and "int64_t scratch_len" in src:
        import ctypes

        fn = lib.sinkserve_decode_attention
        fn.argtypes = [*fn.argtypes, ctypes.c_void_p, ctypes.c_int64]
        lib.takes_scratch = True
    return lib


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", default="128,400,2048")
    ap.add_argument("--head-dim", default="32,64,128")
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--old-rev", default=OLD_REV, help="git revision of the old source")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--no-avx512", action="store_true",
                    help="build old and new with -mno-avx512f too (the portable paths against each other)")
    ap.add_argument("--kv", choices=("fp", "int8", "int4", "int2"), default="fp",
                    help="the float32 cache's kernel (default) or the packed cache's at these bits")
    args = ap.parse_args(argv)

    source = SOURCE
    new_src = (REPO_ROOT / source).read_text()
    inc = ("-I", str(CSRC))
    flags = ("-mno-avx512f",) if args.no_avx512 else ()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"old": old_build(args.old_rev, args.kv, Path(tmp), flags), "new": load_source(new_src, (*inc, *flags)),
                "portable": load_source(new_src, (*inc, "-mno-avx512f"))}
    load = [uptime()]
    rows = []
    for d in (int(x) for x in args.head_dim.split(",")):
        for context in (int(x) for x in args.context.split(",")):
            for batch in (int(x) for x in args.batch.split(",")):
                x = make_inputs(batch, context, args.kv_heads, args.group, d, args.block) if args.kv == "fp" else \
                    make_quant_inputs(batch, context, args.kv_heads, args.group, d, args.block, int(args.kv[3:]))
                outs = {}
                for name, lib in libs.items():
                    call(lib, x)
                    outs[name] = x["out"].clone()
                for name in ("new", "portable"):
                    torch.testing.assert_close(outs[name], outs["old"], rtol=1e-4, atol=1e-5)
                times: dict[str, list[float]] = {name: [] for name in libs}
                for _ in range(args.rounds):
                    for name, lib in libs.items():
                        for _ in range(args.reps):
                            t = time.perf_counter()
                            call(lib, x)
                            times[name].append(time.perf_counter() - t)
                med = {n: statistics.median(t) * 1e6 for n, t in times.items()}
                rows.append((d, context, batch, *[(min(times[n]) * 1e6, med[n]) for n in libs],
                             med["old"] / med["new"], med["old"] / med["portable"]))
                print(rows[-1], flush=True)
                del x
    load.append(uptime())
    lines = [
        "# CPU decode attention: the kernel alone, old vs new source"
        + ("" if args.kv == "fp" else f" (packed {args.kv} cache)"),
        "",
        f"`python -m bench.cpu_decode_attention {' '.join(sys.argv[1:] if argv is None else argv)}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {cpu_name()}, {os.cpu_count()} CPUs shared with other "
        f"jobs (load averages {load[0]} before, {load[1]} after), one thread. old: the kernel's source at "
        f"{args.old_rev}; new: the working tree's; portable: new built with `-mno-avx512f`; all with "
        f"`cc -O3 -march=native -ffast-math`{' -mno-avx512f (old and new too)' if args.no_avx512 else ''}. {args.kv_heads} KV heads x {args.group} query heads, block "
        f"{args.block}, one decode token per sequence at `context` cached tokens, {args.rounds} rounds x "
        f"{args.reps} calls per build, the builds alternating. Microseconds per call, min / median.",
        "",
        "| head dim | context | batch | old | new | portable | old / new | old / portable |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d, context, batch, old, new, port, r_new, r_port in rows:
        lines.append(f"| {d} | {context} | {batch} | {old[0]:.0f} / {old[1]:.0f} | {new[0]:.0f} / {new[1]:.0f} | "
                     f"{port[0]:.0f} / {port[1]:.0f} | {r_new:.2f}x | {r_port:.2f}x |")
    return emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    sys.exit(main())
