"""fullgraph.narrow_mlp against the same layers in PyTorch (eager and torch.compile), forward
and forward + backward, each from a CUDA graph (the GPU's time alone), over row counts and
widths beyond the projector's; then the "triton" kernel's settings on the projector's MLPs.

    python benchmarks/mlp_shapes.py [--settings | --eager] > mlp.log     (needs a CUDA device)

CUDA-event medians of graph replays after warm-up, all in one process, random inputs.
"""

from __future__ import annotations

import itertools
import sys

import torch
from replay_profile import graphed_ms

import fullgraph
from fullgraph.bench.timing import time_call
from fullgraph.ops import mlp

WIDTHS = ((3, 25, 25, 25), (25, 25, 25, 1), (16, 32, 32, 16), (3, 32, 32, 32, 32), (64, 64, 64))  # the last: "auto" takes torch
ROWS = (1_000, 10_000, 100_000, 1_000_000)
# One setting at a time from the defaults, then BLOCK x NUM_WARPS together.
SETTINGS = {"BLOCK": (32, 64, 128), "NUM_WARPS": (2, 4, 8), "BACKWARD_BLOCK": (16, 32, 64),
            "BACKWARD_NUM_WARPS": (1, 2, 4), "BACKWARD_PROGRAMS_PER_SM": (1, 2, 4, 8, 16)}
PAIRS = ((128, 8), (32, 2), (16, 1))  # (BACKWARD_BLOCK, BACKWARD_NUM_WARPS) together,
PER_SM = (2, 4, 8)  # under each of these BACKWARD_PROGRAMS_PER_SM


def _model(widths):
    layers = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).cuda()


def _calls(model, compiled, rows):
    """{variant: (forward, forward + backward)} of ``model`` (and ``compiled``, it under
    torch.compile) on one set of inputs of ``rows`` rows."""
    linear = [m for m in model if isinstance(m, torch.nn.Linear)]
    params = [layer.weight for layer in linear] + [layer.bias for layer in linear]
    x = torch.randn(rows, linear[0].in_features, device="cuda", requires_grad=True)
    grad_out = torch.randn(rows, linear[-1].out_features, device="cuda")

    def fused(x):
        return fullgraph.narrow_mlp(x, [layer.weight for layer in linear], [layer.bias for layer in linear])

    calls = {}
    for name, run in (("torch eager", model), ("torch.compile", compiled), ("narrow_mlp", fused)):
        def forward(run=run):
            with torch.no_grad():
                run(x)

        def train(run=run):
            torch.autograd.grad(run(x), [x, *params], grad_out)

        calls[name] = (forward, train)
    return calls


def shapes() -> None:
    print("rows, widths: forward / forward + backward, graphed us (torch eager | torch.compile | narrow_mlp)")
    for widths in WIDTHS:
        model = _model(widths)
        compiled = torch.compile(model, dynamic=True)
        for rows in ROWS:
            times = {name: [graphed_ms(f) * 1000 for f in pair] for name, pair in _calls(model, compiled, rows).items()}
            cells = " | ".join(f"{t[0]:8.1f} / {t[1]:8.1f}" for t in times.values())
            best = min(times["torch eager"][1], times["torch.compile"][1])
            print(f"{rows:>9,} {str(widths):>22}: {cells}   train ratio {best / times['narrow_mlp'][1]:.2f}x")


def eager() -> None:
    """As called (no graph): the host's launches included, where a few thousand rows leave
    the GPU idle between them."""
    print("rows, widths: forward / forward + backward, eager us (torch eager | narrow_mlp)")
    for widths in WIDTHS[:2]:
        model = _model(widths)
        for rows in ROWS[:3]:
            calls = _calls(model, None, rows)
            times = {name: [time_call(f, torch.device("cuda"), warmup=5, runs=50).median_ms * 1000 for f in calls[name]]
                     for name in ("torch eager", "narrow_mlp")}
            cells = " | ".join(f"{t[0]:8.1f} / {t[1]:8.1f}" for t in times.values())
            print(f"{rows:>9,} {str(widths):>22}: {cells}")


def settings() -> None:
    print("narrow_mlp settings, projector MLPs (10^5 x (3, 25, 25, 25) and 27,000 x (25, 25, 25, 1)), graphed us")
    defaults = {name: getattr(mlp, name) for name in SETTINGS}
    for name, values in SETTINGS.items():
        for value in values:
            setattr(mlp, name, value)
            times = [graphed_ms(f) * 1000 for widths, rows in (((3, 25, 25, 25), 100_000), ((25, 25, 25, 1), 27_000))
                     for f in _calls(_model(widths), None, rows)["narrow_mlp"]]
            print(f"{name} = {value}: " + ", ".join(f"{t:.1f}" for t in times))
        setattr(mlp, name, defaults[name])
    for (block, warps), per_sm in itertools.product(PAIRS, PER_SM):
        mlp.BACKWARD_BLOCK, mlp.BACKWARD_NUM_WARPS, mlp.BACKWARD_PROGRAMS_PER_SM = block, warps, per_sm
        times = [graphed_ms(f) * 1000 for widths, rows in (((3, 25, 25, 25), 100_000), ((25, 25, 25, 1), 27_000))
                 for f in _calls(_model(widths), None, rows)["narrow_mlp"]]
        print(f"BACKWARD_BLOCK = {block}, BACKWARD_NUM_WARPS = {warps}, BACKWARD_PROGRAMS_PER_SM = {per_sm}: "
              + ", ".join(f"{t:.1f}" for t in times))
    for name in ("BACKWARD_BLOCK", "BACKWARD_NUM_WARPS", "BACKWARD_PROGRAMS_PER_SM"):
        setattr(mlp, name, defaults[name])


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    if "--eager" in sys.argv:
        eager()
    else:
        settings()
    if not {"--settings", "--eager"} & set(sys.argv):
        shapes()
