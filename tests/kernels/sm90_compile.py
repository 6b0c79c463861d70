"""Compile every Triton kernel for an sm_90 (H100/H200) target without a GPU.

The interpreter checks numerics but not what only the compiler sees (types, ``tl.dot`` shape rules,
shared-memory use). Triton ships ``ptxas``, so the full compile to a cubin runs on a CPU-only machine.

    python -m tests.kernels.sm90_compile          # every engine configuration (bf16, fp32) + a kernel subset
    python -m tests.kernels.sm90_compile --all    # + fp32/fp16, small head sizes, every quant / split variant

The engine's kernels (``write_kv``, paged attention, the split reduction) are compiled for *every*
configuration their launchers can pick, as enumerated by ``sinkserve_kernels.paged_attention.engine_launch_configs``
(the launchers build their compile-time arguments with the same functions, so this list cannot drift):
decode and prefill/mixed tiles x every split count, with the launch options (``num_warps``, ``num_stages``)
the launcher passes, for Llama-3-8B's attention shape (32 query heads, 8 KV heads of 128, 16-token blocks)
and Gemma-3-4B's (8 query heads, 4 KV heads of 256: the largest head size, whose mixed tile gets 8 warps)
in bfloat16 (the CUDA default) and float32 (exact IEEE dots, another code path), over 16-bit and packed
int4 KV (prod.yaml's long pool; float32 over packed KV runs fewer pipelining stages). Every engine kernel's
shared memory must fit one sm_90 program (``SM90_MAX_SHARED``, 227 KiB) -- a launch over it fails on the
device, not here, unless this checks it. ``--all`` adds float16 and the shapes of the reference and test
models (head size 32 and 16).

Must run in a fresh process with ``TRITON_INTERPRET=0`` (kernels decorated for compilation), which is why
``test_compile_sm90.py`` launches it as a subprocess.
"""

from __future__ import annotations

import inspect
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sinkserve_kernels import indexer as ix  # noqa: E402
from sinkserve_kernels import kv_quant as kq  # noqa: E402
from sinkserve_kernels import paged_attention as pa  # noqa: E402
from sinkserve_kernels import sparse_attention as sa  # noqa: E402
from sinkserve_kernels import topk as tk  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_sm90(fn, types, consts, options=None):
    names = inspect.signature(fn.fn).parameters
    sig = {}
    for n in names:
        if n in consts: sig[n] = "constexpr"
        elif n in types: sig[n] = types[n]
        elif n.endswith("_ptr"): raise KeyError(n)
        else: sig[n] = "i32"
    t = time.time()
    k = triton.compile(ASTSource(fn, sig, consts), target=TARGET, options=dict(options or {}))
    return time.time() - t, k.metadata.shared

def quant_ptrs(dt, quant):
    if quant == 0:
        return dict(k_ptr=f"*{dt}", v_ptr=f"*{dt}", fpk_ptr=f"*{dt}", fpv_ptr=f"*{dt}", fp_index_ptr=f"*{dt}",
                    ks_ptr=f"*{dt}", kz_ptr=f"*{dt}", vs_ptr=f"*{dt}", vz_ptr=f"*{dt}")
    return dict(k_ptr="*u8", v_ptr="*u8", fpk_ptr=f"*{dt}", fpv_ptr=f"*{dt}", fp_index_ptr="*i32",
                ks_ptr="*fp16", kz_ptr="*fp16", vs_ptr="*fp16", vz_ptr="*fp16")

TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# (name, query heads, KV heads, head size, block size)
ENGINE_SHAPES = [("llama3-8b", 32, 8, 128, 16), ("gemma3-4b", 8, 4, 256, 16)]
ENGINE_SHAPES_ALL = ENGINE_SHAPES + [("reference", 4, 2, 32, 16), ("tiny", 4, 2, 16, 16)]


# Packed KV (prod.yaml's long pool: int4, 64-token blocks), its attention over codes + the 16-bit side pool.
# int8 compiles to the same tiles and shared memory as int4, and NUM_SPLITS changes only the epilogue (the
# 16-bit variants above compile every split), so one split count per tile keeps the CPU compile short.
PACKED_BLOCK_SIZE, PACKED_BITS, PACKED_SPLITS = 64, 4, 1


def engine_variants(every: bool) -> list[tuple[str, object, dict, dict, dict]]:
    """``(name, kernel, types, constexprs, launch options)`` for every configuration the engine can launch
    (packed KV: the paged tiles at one split count, see ``PACKED_SPLITS``)."""
    out = []
    for shape, hq, hkv, d, bs in ENGINE_SHAPES_ALL if every else ENGINE_SHAPES:
        for dtype in (torch.bfloat16, torch.float32, torch.float16) if every else (torch.bfloat16, torch.float32):
            dt = TRITON_TYPES[dtype]
            packed = [(cfg, PACKED_BITS) for cfg in pa.engine_launch_configs(
                hq, hkv, d, PACKED_BLOCK_SIZE, dtype, quant=PACKED_BITS, group_size=min(64, d // 2))
                if cfg.kernel == "paged_attention" and cfg.num_splits == PACKED_SPLITS]
            for cfg, quant in [(c, 0) for c in pa.engine_launch_configs(hq, hkv, d, bs, dtype)] + packed:
                if cfg.kernel == "paged_attention":
                    fn, types = pa._paged_attn_kernel, dict(
                        q_ptr=f"*{dt}", o_ptr=f"*{dt}", part_o_ptr="*fp32", part_ml_ptr="*fp32", block_tables_ptr="*i32",
                        seq_lens_ptr="*i32", qsl_ptr="*i32", sinks_ptr="*fp32", qk_scale="fp32", **quant_ptrs(dt, quant))
                elif cfg.kernel == "reduce":
                    fn, types = pa._reduce_kernel, dict(part_o_ptr="*fp32", part_ml_ptr="*fp32", o_ptr=f"*{dt}",
                                                        sinks_ptr="*fp32")
                else:
                    fn, types = pa._write_kv_kernel, dict(key_ptr=f"*{dt}", value_ptr=f"*{dt}", k_cache_ptr=f"*{dt}",
                                                          v_cache_ptr=f"*{dt}", slot_ptr="*i64")
                opts = dict(cfg.options)
                launch = "".join(f" {k}={opts[k]}" for k in ("num_warps", "num_stages") if k in opts)
                out.append((f"engine {shape} {dt}{f' int{quant}' if quant else ''} {cfg.name}"
                            + launch.replace("num_warps", "warps").replace("num_stages", "stages"), fn, types,
                            dict(cfg.constexprs), opts))
            # Sparse decode over the selected blocks (16-bit and packed KV), launched with the paged tiles'
            # options (sinkserve_kernels.sparse_attention.sparse_constexprs).
            for quant in (0, PACKED_BITS):
                bs_s, gs = (PACKED_BLOCK_SIZE, min(64, d // 2)) if quant else (bs, 1)
                consts = sa.sparse_constexprs(hq, hkv, d, bs_s, PACKED_SPLITS, dtype, False, quant, gs)
                opts = pa.paged_options(consts)
                types = dict(q_ptr=f"*{dt}", o_ptr=f"*{dt}", part_o_ptr="*fp32", part_ml_ptr="*fp32", slots_ptr="*i32",
                             qk_scale="fp32", **quant_ptrs(dt, quant))
                out.append((f"engine {shape} {dt}{f' int{quant}' if quant else ''} sparse splits={PACKED_SPLITS} "
                            f"warps={opts['num_warps']} stages={opts['num_stages']}", sa._sparse_attn_kernel, types,
                            consts, opts))
    return out


results = []
# The default subset covers every kernel and every load_kv mode at least once.
SUBSET = None if "--all" in sys.argv else {
    "paged bf16 q0 s4", "paged bf16 q0 s1 sinks", "paged bf16 q4 s4 sinks", "sparse bf16 q4 s1", "reduce",
    "reduce sinks", "quantize int4", "indexer scale=True", "topk forced=True",
    "write_kv",
}
def run(name, fn, types, consts, always=False, options=None, max_shared=None):
    try:
        if SUBSET is not None and name not in SUBSET and not always:
            return
        dt, shared = compile_sm90(fn, types, consts, options)
        if max_shared is not None and shared > max_shared:
            results.append((name, "FAIL", f"shared memory {shared} B > {max_shared} B per sm_90 program"))
        else:
            results.append((name, "ok", f"{dt:.1f}s shared={shared}B"))
    except Exception as e:
        results.append((name, "FAIL", repr(e)[:600]))
    print(*results[-1], flush=True)

for dt in ["bf16", "fp32"]:
  for quant in ([0, 8, 4] if dt == "bf16" else [0]):
    for splits in [1, 4]:
        types = dict(q_ptr=f"*{dt}", o_ptr=f"*{dt}", part_o_ptr="*fp32", part_ml_ptr="*fp32", block_tables_ptr="*i32",
                     seq_lens_ptr="*i32", qsl_ptr="*i32", sinks_ptr="*fp32", qk_scale="fp32", **quant_ptrs(dt, quant))
        for sinks in (False, True):
            consts = dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, GROUP=4, HEAD_DIM=128, HALF=64, BLOCK_SIZE=16, BLOCK_Q=4,
                          BLOCK_M=16, BLOCK_N=64, NUM_SPLITS=splits, QUANT=quant, GROUP_SIZE=32, HAS_SINKS=sinks,
                          DOT_PREC="ieee" if dt == "fp32" else "tf32", INTERP=False)
            run(f"paged {dt} q{quant} s{splits}" + (" sinks" if sinks else ""), pa._paged_attn_kernel, types, consts)
        types_s = dict(q_ptr=f"*{dt}", o_ptr=f"*{dt}", part_o_ptr="*fp32", part_ml_ptr="*fp32", slots_ptr="*i32",
                       qk_scale="fp32", **quant_ptrs(dt, quant))
        consts_s = dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, GROUP=4, BLOCK_M=16, HEAD_DIM=128, HALF=64, BLOCK_SIZE=16,
                        BLOCK_N=64, NUM_SPLITS=splits, QUANT=quant, GROUP_SIZE=32,
                        DOT_PREC="ieee" if dt == "fp32" else "tf32", INTERP=False)
        run(f"sparse {dt} q{quant} s{splits}", sa._sparse_attn_kernel, types_s, consts_s)
for sinks in (False, True):
    run("reduce" + (" sinks" if sinks else ""), pa._reduce_kernel,
        dict(part_o_ptr="*fp32", part_ml_ptr="*fp32", o_ptr="*bf16", sinks_ptr="*fp32"),
        dict(NUM_Q_HEADS=32, HEAD_DIM=128, D_PAD=128, NUM_SPLITS=4, SPLITS_PAD=4, HAS_SINKS=sinks, INTERP=False))
for bits in (8, 4):
    run(f"quantize int{bits}", kq._quantize_kernel, dict(src_k_ptr="*bf16", src_v_ptr="*bf16", src_row_ptr="*i64",
        dst_block_ptr="*i64", k_codes_ptr="*u8", v_codes_ptr="*u8", ks_ptr="*fp16", kz_ptr="*fp16", vs_ptr="*fp16",
        vz_ptr="*fp16"), dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, GROUP_SIZE=32, NGH=2, BITS=bits))
for has_scale, kt in ((False, "bf16"), (True, "i8")):
    run(f"indexer scale={has_scale}", ix._indexer_kernel, dict(q_ptr="*bf16", w_ptr="*fp32", k_ptr=f"*{kt}",
        ks_ptr="*fp32", out_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32"),
        dict(NUM_HEADS=16, H_PAD=16, IDX_DIM=64, D_PAD=64, BLOCK_SIZE=16, BLOCK_N=64, HAS_SCALE=has_scale,
             DOT_PREC="ieee" if has_scale else "tf32", INTERP=False))
for forced in (False, True):
    run(f"topk forced={forced}", tk._topk_kernel, dict(scores_ptr="*fp32", out_ptr="*i32", block_tables_ptr="*i32",
        seq_lens_ptr="*i32", qsl_ptr="*i32", forced_ptr="*u8" if forced else "*fp32"),
        dict(BLOCK_SIZE=16, BLOCK_N=1024, BLOCK_K=1024, HAS_FORCED=forced))
run("write_kv", pa._write_kv_kernel, dict(key_ptr="*fp32", value_ptr="*fp32", k_cache_ptr="*bf16", v_cache_ptr="*bf16",
    slot_ptr="*i64"), dict(NUM_KV_HEADS=8, HEAD_DIM=128, H_PAD=8, D_PAD=128, INTERP=False))
for name, fn, types, consts, options in engine_variants(SUBSET is None):
    run(name, fn, types, consts, always=True, options=options, max_shared=pa.SM90_MAX_SHARED)
failed = [r[0] for r in results if r[1] == "FAIL"]
print(f"compiled {len(results) - len(failed)}/{len(results)} kernels for sm_90; failed: {failed}")
sys.exit(1 if failed else 0)
