"""AdamW8bit's update on the GPU (offload_plugin.formats.adamw8bit.gpu, the streamed 8-bit
state's kernel): its bits against the host update (offload_plugin.formats.adamw8bit.optimizer), and its rate
on one streamed unit.

Inside a backward the update's kernels and backward's take the GPU in turns, so the
kernel's time adds to the step's. With ``--probe``, where that time goes: the kernel's work
timed with one part replaced by something cheap (and wrong), and in tiles of several blocks
a program.

    python bench/formats/adamw8bit_gpu_update.py --json /tmp/rate.json   # on a GPU: check, then time
    TRITON_INTERPRET=1 python bench/formats/adamw8bit_gpu_update.py --cpu  # the check alone, on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: offload_plugin, installed or not

from offload_plugin.formats.adamw8bit import update as adamw8bit  # noqa: E402
from offload_plugin.formats.adamw8bit.native import update_8bit_  # noqa: E402
from offload_plugin.formats.adamw8bit.optimizer import BLOCK  # noqa: E402

try:  # (torch's CUDA wheels bring Triton; without it only --help runs)
    import triton
    import triton.language as tl

    from offload_plugin.formats.adamw8bit import gpu as adamw8bit_gpu
    from offload_plugin.formats.adamw8bit.gpu import _bf16, _grad
except ImportError:
    triton = None

GROUP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _state(n: int, gen: torch.Generator) -> dict:
    """A flat parameter of ``n`` elements with a gradient and 8-bit moments over six decades."""
    blocks = -(-n // BLOCK)

    def spread(x):
        return x * 10.0 ** torch.randint(-6, 1, (n,), generator=gen).float()

    s = dict(weight=torch.randn(n, generator=gen).to(torch.bfloat16),
             state1=torch.empty(n, dtype=torch.uint8), absmax1=torch.empty(blocks),
             state2=torch.empty(n, dtype=torch.uint8), absmax2=torch.empty(blocks))
    adamw8bit.quantize_(spread(torch.randn(n, generator=gen)) * 1e-2, True, s["state1"], s["absmax1"])
    adamw8bit.quantize_(spread(torch.rand(n, generator=gen)) * 1e-4, False, s["state2"], s["absmax2"])
    return s


if triton is not None:
    @triton.jit
    def _probe_quantize(x, inside, lut, codes, absmax, offs, blocks, real, NO_LUT: tl.constexpr):
        top = tl.max(tl.where(inside, tl.abs(x), 0.0), axis=1)
        inv = tl.div_rn(1.0, tl.where(top == 0.0, 1.0, top))
        index = ((((x * inv[:, None] + 1.0) * 0.5) * 65535.0) + 0.5).to(tl.int32)
        index = tl.minimum(tl.maximum(index, 0), 65535)
        if NO_LUT:
            code = index >> 8
        else:
            code = tl.load(lut + index).to(tl.int32)
        tl.store(codes + offs, code.to(tl.uint8), mask=inside)
        tl.store(absmax + blocks, top, mask=real)

    @triton.jit
    def _probe(weight, grad, state1, absmax1, state2, absmax2, n, coeffs, map1, map2, lut1, lut2,
               NO_LUT: tl.constexpr, NO_MAP: tl.constexpr, FAST_DIV: tl.constexpr, ROWS: tl.constexpr,
               BLOCK_SIZE: tl.constexpr):
        """The 8-bit kernel's work with parts replaced (probe_rates): timing only."""
        blocks = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        offs = blocks[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]
        inside = offs < n
        real = blocks * BLOCK_SIZE < n
        # (adamw8bit.coefficients' row, read where used)
        g = _grad(grad, offs, inside, 1.0, False)
        k1 = tl.load(state1 + offs, mask=inside, other=0).to(tl.int32)
        k2 = tl.load(state2 + offs, mask=inside, other=0).to(tl.int32)
        s1 = tl.load(absmax1 + blocks, mask=real, other=0.0)[:, None]
        s2 = tl.load(absmax2 + blocks, mask=real, other=0.0)[:, None]
        if NO_MAP:
            m = k1.to(tl.float32) * s1
            v = k2.to(tl.float32) * s2
        else:
            m = tl.load(map1 + k1) * s1
            v = tl.load(map2 + k2) * s2
        m = tl.fma(g, tl.load(coeffs + 1), m * tl.load(coeffs + 0))
        v = tl.fma(tl.load(coeffs + 3) * g, g, v * tl.load(coeffs + 2))
        p = _bf16(tl.load(weight + offs, mask=inside, other=0)) * tl.load(coeffs + 6)
        step_size, c2, eps = tl.load(coeffs + 7), tl.load(coeffs + 4), tl.load(coeffs + 5)
        if FAST_DIV:
            p = p + step_size * m / (tl.sqrt(v) / c2 + eps)
        else:
            p = p + tl.div_rn(step_size * m, tl.div_rn(tl.sqrt_rn(v), c2) + eps)
        tl.store(weight + offs, (p.to(tl.uint32, bitcast=True) >> 16).to(tl.int16), mask=inside)
        _probe_quantize(m, inside, lut1, state1, absmax1, offs, blocks, real, NO_LUT)
        _probe_quantize(v, inside, lut2, state2, absmax2, offs, blocks, real, NO_LUT)


def check(device, sizes: list[int]) -> list[str]:
    """The kernel against the host update: three steps per case (to nearest,
    stochastic rounding, a scaled gradient), the last skipped as a non-finite gradient's
    is; returns the differences (none: the same bits)."""
    maps, problems = adamw8bit_gpu.GpuMaps(device), []
    cases = [dict(stochastic=False, scale=None), dict(stochastic=True, scale=None), dict(stochastic=False, scale=0.37)]
    for n in sizes:
        for case in cases:
            gen = torch.Generator().manual_seed(n)
            host = _state(n, gen)
            grads = [(torch.randn(n, generator=gen) * torch.logspace(-6, 1, n)).to(torch.bfloat16) for _ in range(3)]
            start, numel = 3 * BLOCK, n + 5 * BLOCK  # (a range of a larger parameter: stochastic rounding's place)
            gpu = {k: v.to(device, copy=True) for k, v in host.items()}
            for t, grad in enumerate(grads, 1):
                row = adamw8bit.coefficients(dict(GROUP, stochastic_rounding=case["stochastic"]), t, case["scale"])
                skip = t == 3
                if not skip:
                    update_8bit_(host["weight"], grad, host["state1"], host["absmax1"], host["state2"],
                                           host["absmax2"], row, start, numel)
                coeffs = torch.tensor(row, dtype=torch.float32, device=device)
                flag = torch.full((1,), float(skip), device=device)
                adamw8bit_gpu.update_8bit_(gpu["weight"], grad.to(device), gpu["state1"], gpu["absmax1"], gpu["state2"],
                                           gpu["absmax2"], coeffs, flag, maps, scaled=case["scale"] is not None,
                                           start=start, numel=numel, seed=int(row[11]))
            for k, want in host.items():
                got = gpu[k].cpu()
                same = torch.equal(got.view(torch.int16) if got.dtype == torch.bfloat16 else got.view(torch.uint8),
                                   want.view(torch.int16) if want.dtype == torch.bfloat16 else want.view(torch.uint8))
                if not same:
                    problems.append(f"n={n} {case}: {k} differs")
    return problems


def _unit(device, n: int) -> tuple:
    """A timed unit on ``device``: its state, a gradient, the maps and step 5's coefficients."""
    gen = torch.Generator().manual_seed(0)
    state = {k: v.to(device) for k, v in _state(n, gen).items()}
    grad = torch.randn(n, generator=gen).to(torch.bfloat16).to(device)
    coeffs = torch.tensor(adamw8bit.coefficients(dict(GROUP, stochastic_rounding=False), 5), device=device)
    return state, grad, adamw8bit_gpu.GpuMaps(device), coeffs


def rate(device, n: int, repeats: int) -> dict:
    """The kernel's median time for one unit of ``n`` elements, and the bytes it moves in the
    GPU's memory per second (weight and codes read and written, the gradient read)."""
    s, grad, maps, coeffs = _unit(device, n)
    flag = torch.zeros(1, device=device)
    t = _median_time(lambda: adamw8bit_gpu.update_8bit_(s["weight"], grad, s["state1"], s["absmax1"], s["state2"],
                                                        s["absmax2"], coeffs, flag, maps), repeats)
    nbytes = n * (2 + 2 + 2 + 2 + 2) + 16 * (-(-n // BLOCK))
    return dict(numel=n, seconds=t, elements_per_s=n / t, bytes_per_s=nbytes / t)


def probe_rates(device, n: int, repeats: int) -> list[dict]:
    """Where the kernel's time goes: its work (a program per block, as shipped) with one part
    replaced by something cheap and wrong (the quantizer's table lookups, the maps'
    lookups, the correctly rounded division and square root), and all of it in tiles of
    several blocks a program; each timed like ``rate``. Diagnostics only: these variants'
    results are not AdamW's."""
    s, grad, maps, coeffs = _unit(device, n)
    out = []
    variants = [("all parts", {}), ("no table lookups", dict(NO_LUT=True)), ("no map lookups", dict(NO_MAP=True)),
                ("no lookups", dict(NO_LUT=True, NO_MAP=True)), ("approximate division", dict(FAST_DIV=True)),
                ("no lookups, approximate division", dict(NO_LUT=True, NO_MAP=True, FAST_DIV=True))]
    variants += [(f"all parts, {rows} blocks a program, {warps} warps", dict(ROWS=rows, WARPS=warps))
                 for rows, warps in ((2, 2), (2, 4), (4, 4), (8, 4), (8, 8), (32, 8))]
    for name, flags in variants:
        kw = dict(dict(NO_LUT=False, NO_MAP=False, FAST_DIV=False, ROWS=1, WARPS=4), **flags)
        rows, warps = kw.pop("ROWS"), kw.pop("WARPS")

        def launch():
            _probe[(triton.cdiv(n, BLOCK * rows),)](
                s["weight"].view(torch.int16), grad.view(torch.int16), s["state1"], s["absmax1"], s["state2"],
                s["absmax2"], n, coeffs, maps.map1, maps.map2, maps.lut1, maps.lut2, ROWS=rows, BLOCK_SIZE=BLOCK,
                num_warps=warps, **kw, **adamw8bit_gpu._NO_CONTRACTION)
        t = _median_time(launch, repeats)
        out.append(dict(probe=name, seconds=t, elements_per_s=n / t))
    return out


def _median_time(launch, repeats: int) -> float:
    for _ in range(3):
        launch()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        launch()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the check alone, in Triton's interpreter (TRITON_INTERPRET=1)")
    ap.add_argument("--numel", type=int, default=1 << 25, help="elements of the timed unit (AdamW8bit's: 32 M)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", help="write the rates here")
    ap.add_argument("--probe", action="store_true", help="also time the kernel's work with parts replaced, and in tiles")
    ap.add_argument("--warps", default="",
                    help="also check and time the kernel launched with these warps per program (comma-separated; "
                         "adamw8bit_gpu.WARPS is the shipped count)")
    args = ap.parse_args()
    if triton is None:
        sys.exit("needs Triton (installed with torch's CUDA wheels)")
    device = torch.device("cpu" if args.cpu else "cuda")
    sizes = [1, 200, 256, 257, 2 * BLOCK * 8 + 77] + ([] if args.cpu else [100_003, 1 << 20])
    problems = check(device, sizes)
    for p in problems:
        print("DIFFERS:", p)
    if problems:
        sys.exit(1)
    print(f"bits: the same as adamw8bit's host update, sizes {sizes}")
    if args.cpu:
        return
    r = rate(device, args.numel, args.repeats)
    print(f"rate: {r['seconds'] * 1e3:.3f} ms per {args.numel / 2**20:g} M elements, "
          f"{r['elements_per_s'] / 1e9:.1f} G elements/s, {r['bytes_per_s'] / 1e9:.0f} GB/s of GPU memory")
    launches = []
    for warps in [int(w) for w in filter(None, args.warps.split(","))]:
        shipped, adamw8bit_gpu.WARPS = adamw8bit_gpu.WARPS, warps
        try:
            launches.append(dict(warps=warps, same_bits=not check(device, sizes), **rate(device, args.numel, args.repeats)))
        finally:
            adamw8bit_gpu.WARPS = shipped
        r2 = launches[-1]
        print(f"{warps} warps a program: bits {'the same' if r2['same_bits'] else 'DIFFER'}, "
              f"{r2['seconds'] * 1e3:.3f} ms, {r2['elements_per_s'] / 1e9:.1f} G elements/s", flush=True)
    probes = probe_rates(device, args.numel, args.repeats) if args.probe else []
    for p in probes:
        print(f"probe: {p['probe']}: {p['seconds'] * 1e3:.3f} ms, {p['elements_per_s'] / 1e9:.1f} G elements/s")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(kind="adamw8bit_gpu_update", device=torch.cuda.get_device_name(),
                                                   rate=r, warps=launches, probes=probes), indent=1))


if __name__ == "__main__":
    main()
