"""Where a step of the FPS loop goes inside one program: a kernel that repeats the resident
step (distances of BLOCK 3-D points to a centre, running minimum, the first of the largest,
the centre's coordinates loaded for the next step) STEPS times, with parts of it removed,
timed with CUDA events for a grid of CLOUDS programs. Prints microseconds per step.

    python benchmarks/fps_step_latency.py > fps-step-latency.log     (needs a CUDA device)

Modes: "full" (as fullgraph's kernel: argmax with its index, then a dependent load of the
centre), "max only" (the largest value, no index: the centre picked from its bits),
"packed" (one int64 maximum of distance bits and inverted lane), "no reduction" (the centre
is the step number: compute and load only), "empty" (the loop and the output store).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MODES = ["full", "max only", "packed", "no reduction", "empty"]


@triton.jit
def _steps(points, out, STEPS: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    base = points + b * BLOCK * 3
    x0 = tl.load(base + lanes * 3)
    x1 = tl.load(base + lanes * 3 + 1)
    x2 = tl.load(base + lanes * 3 + 2)
    gap = tl.full((BLOCK,), float("inf"), tl.float32)
    current = 0
    for step in range(STEPS):
        tl.store(out + b * STEPS + step, current)
        if MODE != 4:
            d = x0 - tl.load(base + current * 3)
            total = d * d
            d = x1 - tl.load(base + current * 3 + 1)
            total = total + d * d
            d = x2 - tl.load(base + current * 3 + 2)
            total = total + d * d
            gap = tl.minimum(gap, total)
            if MODE == 0:
                top, offset = tl.max(gap, 0, return_indices=True, return_indices_tie_break_left=True)
                current = offset
            elif MODE == 1:
                top = tl.max(gap, 0)
                current = top.to(tl.int32, bitcast=True) & (BLOCK - 1)
            elif MODE == 2:
                key = (gap.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK - 1 - lanes)
                current = (BLOCK - 1 - (tl.max(key, 0) & 0xFFFFFFFF)).to(tl.int32)
            else:
                current = (step * 7 + 1) & (BLOCK - 1)
        else:
            current = (step * 7 + 1) & (BLOCK - 1)


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    steps = 2048
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for block in (1024, 2048, 8192):
        for clouds in (1, 128):
            points = torch.rand(clouds * block * 3, device="cuda")
            out = torch.empty(clouds * steps, dtype=torch.int32, device="cuda")
            for warps in (1, 2, 4, 8, 16):
                if block // (32 * warps) > 64:
                    continue
                row = []
                for mode, name in enumerate(MODES):
                    launch = _steps[(clouds,)]
                    launch(points, out, STEPS=steps, BLOCK=block, MODE=mode, num_warps=warps)
                    times = []
                    for _ in range(5):
                        start.record()
                        launch(points, out, STEPS=steps, BLOCK=block, MODE=mode, num_warps=warps)
                        end.record()
                        end.synchronize()
                        times.append(start.elapsed_time(end))
                    row.append(f"{name} {1000 * sorted(times)[2] / steps:.2f}")
                print(f"block {block}, clouds {clouds}, warps {warps}: " + ", ".join(row) + " us/step", flush=True)


if __name__ == "__main__":
    main()
