"""The benchmark workloads: each builds its variants, the callables to time.

A workload is registered under a CLI name with its sizes; ``build(size, device)``
returns ``Case`` objects, one per variant. Later workloads (lltm, kmeans,
diffusion-policy) register here the same way.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import graphs, memory
from ..models import LLTM, ConditionalUnet1D, KNNProjector, RadiusProjector
from ..models.unet1d import matmul_convolutions
from .timing import graphed

BASELINE = "document eager"


@dataclass
class Case:
    """One variant: a forward callable and, where it trains, a train-step callable."""

    variant: str
    forward: Callable[[], object]
    train_step: Callable[[], object] | None = None
    check: Callable[[], dict] | None = None  # extra fields for the forward row (e.g. error vs eager)


@dataclass
class Workload:
    name: str
    description: str
    sizes: dict[str, dict]
    build: Callable[[dict, torch.device], list[Case]]
    notes: list[str] = field(default_factory=list)


WORKLOADS: dict[str, Workload] = {}


def register(workload: Workload) -> Workload:
    WORKLOADS[workload.name] = workload
    return workload


def seed_point_clouds(n_cloud: int, grid_side: int, target_features: int, device, dtype=torch.float32):
    """The document's data: a normal cloud [n_cloud, 3], a [-1, 1]^3 grid [grid_side^3, 3],
    and random targets [grid_side^3, target_features]."""
    generator = torch.Generator(device="cpu").manual_seed(42)
    cloud = torch.randn(n_cloud, 3, generator=generator, dtype=dtype)
    axis = torch.linspace(-1, 1, grid_side, dtype=dtype)
    grid = torch.stack([c.flatten() for c in torch.meshgrid(axis, axis, axis, indexing="ij")], dim=1)
    targets = torch.randn(grid.shape[0], target_features, generator=generator, dtype=dtype)
    return cloud.to(device), grid.to(device), targets.to(device)


def _variants(device: torch.device, external: str | None):
    """(name, aggregation, torch.compile options or None for eager, backend).

    ``external`` ("warp" or "cuml") adds that backend's variants where it is installed."""
    variants = [
        ("document eager", "document", None, "auto"),
        ("document compiled", "document", {}, "auto"),
        ("fullgraph eager", "fullgraph", None, "auto"),
        ("fullgraph compiled", "fullgraph", {"fullgraph": True}, "auto"),
    ]
    if device.type == "cuda":
        with_graphs = {"fullgraph": True, "mode": "reduce-overhead"}
        variants += [
            ("document compiled+graphs", "document", {"mode": "reduce-overhead"}, "auto"),
            ("fullgraph compiled+graphs", "fullgraph", with_graphs, "auto"),
        ]
        if external is not None and importlib.util.find_spec(external) is not None:
            variants += [
                (f"fullgraph {external} compiled", "fullgraph", {"fullgraph": True}, external),
                (f"fullgraph {external} compiled+graphs", "fullgraph", with_graphs, external),
            ]
    return variants


def _outside_torch_pool(device: torch.device) -> dict:
    """Device memory in use that PyTorch's caching allocator does not hold (the CUDA
    context, library workspaces, external libraries' own pools), in bytes."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"outside_torch_pool_bytes": total - free - torch.cuda.memory_reserved(device)}


def _projector_cases(model: torch.nn.Module, params: dict, device: torch.device, external=None) -> list[Case]:
    cloud, grid, targets = seed_point_clouds(params["cloud"], params["grid"], 1, device)
    cases = []
    for name, aggregation, options, backend in _variants(device, external):
        variant_model = copy.deepcopy(model).to(device)
        variant_model.aggregation, variant_model.backend = aggregation, backend
        run = variant_model if options is None else torch.compile(variant_model, **options)
        optimizer = torch.optim.Adam(variant_model.parameters(), lr=1e-3)

        def forward(run=run):
            with torch.no_grad():
                return run(grid, cloud)

        def train_step(run=run, optimizer=optimizer):
            optimizer.zero_grad()
            loss = torch.mean((run(grid, cloud) - targets) ** 2)
            loss.backward()
            optimizer.step()
            return loss

        check = functools.partial(_outside_torch_pool, device) if device.type == "cuda" else None
        cases.append(Case(name, forward, train_step, check))
    return cases


def _knn_projector(params, device):
    torch.manual_seed(42)
    return _projector_cases(KNNProjector(k=params["k"], hidden_dim=25, sigma=0.1), params, device, "cuml")


def _radius_projector(params, device):
    torch.manual_seed(42)
    model = RadiusProjector(radius=params["radius"], hidden_dim=25, sigma=0.1)
    return _projector_cases(model, params, device, "warp")


register(Workload(
    name="knn-projector",
    description="seed 000: MLP -> kNN-weighted aggregation -> MLP, forward and Adam train step",
    sizes={"seed": {"grid": 30, "cloud": 100_000, "k": 7}, "small": {"grid": 12, "cloud": 8_000, "k": 7},
           "tiny": {"grid": 5, "cloud": 500, "k": 7}},
    build=_knn_projector,
))

register(Workload(
    name="radius-projector",
    description="seed 000: MLP -> radius-bounded aggregation -> MLP, forward and Adam train step",
    sizes={"seed": {"grid": 30, "cloud": 25_000, "radius": 0.1},
           "small": {"grid": 12, "cloud": 4_000, "radius": 0.1},
           "tiny": {"grid": 5, "cloud": 500, "radius": 0.5}},
    build=_radius_projector,
))


def _replayed(fn, device):
    """``fn`` captured in a CUDA graph on its first call (the timing's first call), then replayed."""
    replay = None

    def call():
        nonlocal replay
        if replay is None:
            replay = graphed(fn, device)
        return replay()

    return call


def _lltm(params, device):
    """forward = one cell step; train = the step and its backward (the document's loop body:
    ``(new_h.sum() + new_cell.sum()).backward()``), gradients for the weights and bias.
    "graphed" variants capture the eager step (and its backward) in one CUDA graph."""
    generator = torch.Generator().manual_seed(0)
    batch, features, state = params["batch"], params["features"], params["state"]
    x, h, c = (torch.randn(batch, n, generator=generator).to(device) for n in (features, state, state))
    torch.manual_seed(42)
    reference = LLTM(features, state, backend="torch").to(device)
    variants = [("document eager", "torch", None), ("document compiled", "torch", {}),
                ("extension eager", "extension", None), ("extension compiled", "extension", {"fullgraph": True})]
    if device.type == "cuda":
        variants += [("document compiled+graphs", "torch", {"mode": "reduce-overhead"}),
                     ("extension compiled+graphs", "extension", {"fullgraph": True, "mode": "reduce-overhead"}),
                     ("document graphed", "torch", "graphed"), ("extension graphed", "extension", "graphed")]
    cases = []
    for name, backend, options in variants:
        cell = copy.deepcopy(reference)
        cell.backend = backend
        run = torch.compile(cell, **options) if isinstance(options, dict) else cell

        def forward(run=run):
            with torch.no_grad():
                return run(x, (h, c))

        def train_step(run=run, cell=cell):
            cell.zero_grad(set_to_none=True)
            new_h, new_cell = run(x, (h, c))
            (new_h.sum() + new_cell.sum()).backward()
            return cell.weights.grad

        def gradients(cell=cell):
            new_h, new_cell = cell(x, (h, c))
            return torch.autograd.grad(new_h.sum() + new_cell.sum(), [cell.weights, cell.bias])

        if options == "graphed":
            forward, train_step = _replayed(forward, device), _replayed(gradients, device)
        cases.append(Case(name, forward, train_step))
    return cases


register(Workload(
    name="lltm",
    description="seed 001: one LLTM cell step (forward) and step + backward (train); C++ kernel on CPUs, "
                "CUDA kernel on GPUs",
    sizes={"seed": {"batch": 16, "features": 32, "state": 128}, "small": {"batch": 16, "features": 32, "state": 128},
           "tiny": {"batch": 4, "features": 8, "state": 16}},
    build=_lltm,
    notes=[("floor at the document's size: ~0.2 MFLOP and ~0.3 MB per step, microseconds of GPU work; "
            "what remains is launch latency (3 kernels forward, 4-6 backward)")],
))


def _document_kmeans(x, means):
    """Seed 002's NumPy assignment step, verbatim."""
    return np.argmin(np.linalg.norm(x - means[:, None], axis=2), axis=0)


def _kmeans(params, device):
    """forward = the assignment step, train = one Lloyd iteration (assign + update)."""
    from ..ops import kmeans as kmeans_ops

    generator = np.random.default_rng(0)
    half = params["points"] // 2
    x = np.repeat(np.array([[5, 5], [10, 10]], dtype=np.float32), [half, half], axis=0)
    x += generator.standard_normal(x.shape, dtype=np.float32)
    means = np.array([[5, 5], [10, 10]], dtype=np.float32)
    x_device, means_device = torch.from_numpy(x).to(device), torch.from_numpy(means).to(device)
    compiled_document = torch.compile(_document_kmeans)
    # The document's tensor wrapper; called without its `with torch.device("cuda")`, which
    # fails inside the compiler on torch 2.11.
    document_on_tensors = torch.compile(lambda x, m: torch.from_numpy(_document_kmeans(x.numpy(), m.numpy())))
    cases = [
        Case("document eager", lambda: _document_kmeans(x, means),
             lambda: kmeans_ops._lloyd_step.fn(x, means, np.arange(2), 1)),
        Case("document compiled", lambda: compiled_document(x, means)),
        Case(f"document compiled, {device.type} tensors", lambda: document_on_tensors(x_device, means_device)),
        Case("fullgraph compiled", lambda: kmeans_ops.kmeans_assign(x_device, means_device),
             lambda: kmeans_ops.lloyd_step(x_device, means_device)),
    ]
    try:
        from sklearn.cluster import KMeans
        from sklearn.metrics import pairwise_distances_argmin
    except ImportError:
        return cases
    one_iteration = KMeans(2, init=means, n_init=1, max_iter=1, algorithm="lloyd")
    cases.append(Case("scikit-learn", lambda: pairwise_distances_argmin(x, means), lambda: one_iteration.fit(x)))
    return cases


register(Workload(
    name="kmeans",
    description="seed 002: k-means assignment step (forward) and one Lloyd iteration (train), 2-D float32 points, "
                "2 clusters; NumPy and scikit-learn on the CPU, fullgraph on the chosen device",
    sizes={"seed": {"points": 20_000_000}, "small": {"points": 1_000_000}, "tiny": {"points": 20_000}},
    build=_kmeans,
    notes=[("floors on an H100 (~3 TB/s), seed size: the assignment reads 160 MB of points and writes 160 MB "
            "of int64 labels, ~0.107 ms; a Lloyd iteration as written (assign, then sum the clusters reading "
            "points and labels again) moves 640 MB, ~0.21 ms")],
))


def _diffusion_policy(params, device):
    """forward = the whole sampler: ``steps`` U-Net calls and denoise steps from fixed noise."""
    from ..diffusion import denoise
    from ..ops import ddpm

    torch.manual_seed(0)
    batch, steps = params["batch"], params["steps"]
    unet = ConditionalUnet1D(down_dims=params["down_dims"], global_cond_dim=params["cond"]).to(device).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    cond = torch.randn(batch, params["cond"], device=device, generator=generator)
    x = torch.randn(batch, unet.horizon, unet.action_dim, device=device, generator=generator)
    noise = torch.randn(steps, *x.shape, device=device, generator=generator)
    alphas = ddpm.squaredcos_cap_v2(steps, device=device)

    def unfused_loop(net):
        return torch.no_grad()(functools.partial(denoise, net, x, noise, cond, alphas, True, ddpm.reference))

    baseline = unfused_loop(unet)()

    def deviation(run):
        return lambda: {"max_abs_diff_vs_eager": float((run().float() - baseline).abs().max())}

    def cases():
        yield "document eager", unfused_loop(unet)
        yield "document compiled", unfused_loop(torch.compile(unet))
        if device.type != "cuda":
            return
        yield "document compiled+graphs", unfused_loop(torch.compile(unet, mode="reduce-overhead"))
        yield "document recipe (U-Net graphed)", unfused_loop(graphs.graphed(unet))
        streamlined = matmul_convolutions(copy.deepcopy(unet))
        for name, net in (
                ("fullgraph graphed loop", unet),
                ("fullgraph graphed loop, compiled U-Net", torch.compile(unet, fullgraph=True)),
                ("fullgraph graphed loop, compiled matmul-conv U-Net", torch.compile(streamlined, fullgraph=True)),
                ("fullgraph graphed loop, compiled matmul-conv bf16 U-Net",
                 torch.compile(copy.deepcopy(streamlined).to(torch.bfloat16), fullgraph=True))):
            loop = graphs.graphed(torch.no_grad()(functools.partial(denoise, net)), warmup=2)
            yield name, functools.partial(loop, x, noise, cond, alphas, True)

    return [Case(name, run, check=deviation(run)) for name, run in cases()]


register(Workload(
    name="diffusion-policy",
    description="seed 003: DDPM sampling of Diffusion Policy's ConditionalUnet1D (79.9 M parameters at the "
                "seed size), the whole loop from fixed noise",
    sizes={"seed": {"batch": 1, "steps": 100, "down_dims": (256, 512, 1024), "cond": 1028},
           "batch8": {"batch": 8, "steps": 100, "down_dims": (256, 512, 1024), "cond": 1028},
           "small": {"batch": 1, "steps": 10, "down_dims": (64, 128, 256), "cond": 1028},
           "tiny": {"batch": 1, "steps": 3, "down_dims": (16, 32, 64), "cond": 1028}},
    build=_diffusion_policy,
    notes=[("floor per step at the seed size: read the weights once, 320 MB in float32 (~0.11 ms at ~3 TB/s; "
            "160 MB in bf16); 100 steps: ~11 ms (float32), ~5.5 ms (bf16)")],
))


@functools.cache
def _allocating_ops():
    """Two extern ops that allocate their result in their own library, as user code does:
    a CuPy softplus and a Warp soft clip (the README's example kernel)."""
    from .. import extern

    spec = lambda x: [(x.shape, x.dtype)]  # noqa: E731

    @extern.op("fullgraph_bench::cupy_softplus", "(Tensor x) -> Tensor", outputs=spec, library="cupy")
    def cupy_softplus(x):
        import cupy

        return cupy.logaddexp(x, 0)

    @extern.op("fullgraph_bench::warp_soft_clip", "(Tensor x) -> Tensor", outputs=spec, library="warp")
    def warp_soft_clip(x):
        import warp as wp

        y = wp.empty_like(x)
        wp.launch(_warp_soft_clip_kernel(), dim=x.shape, inputs=[x, 2.0], outputs=[y])
        return y

    return {"cupy": cupy_softplus, "warp": warp_soft_clip}


@functools.cache
def _warp_soft_clip_kernel():
    import warp as wp

    @wp.kernel
    def soft_clip(x: wp.array(dtype=float), scale: float, y: wp.array(dtype=float)):
        i = wp.tid()
        y[i] = scale * wp.tanh(x[i] / scale)

    return soft_clip


def _library_pool(library: str, device: torch.device) -> dict:
    """Bytes the library's own pool holds after the run (memory PyTorch cannot reuse),
    and the device memory outside PyTorch's pool."""
    torch.cuda.synchronize(device)
    if library == "cupy":
        import cupy

        held = cupy.get_default_memory_pool().total_bytes()
    else:
        import warp

        held = warp.get_mempool_used_mem_current(f"cuda:{device.index or 0}")
    return {"library_pool_bytes": held, **_outside_torch_pool(device)}


def _extern_pool(params, device):
    """Per library: its own allocator, PyTorch's pool (fullgraph.memory.torch_pool), and
    PyTorch's pool inside a CUDA graph (capturable only then)."""
    if device.type != "cuda":
        raise ValueError("extern-pool measures GPU memory pools: run it with --device cuda")
    x = torch.randn(params["n"], device=device)
    cases = []
    for library, extern_op in _allocating_ops().items():
        if importlib.util.find_spec(library) is None:
            continue

        def own(extern_op=extern_op):
            return extern_op(x)

        def pooled(extern_op=extern_op, library=library):
            with memory.torch_pool(library):
                return extern_op(x)

        def graphed_pooled(replay=graphs.graphed(extern_op), library=library):
            with memory.torch_pool(library):  # the capture (first call) and the replays
                return replay(x)

        check = functools.partial(_library_pool, library, device)
        cases += [Case(f"{library}, own allocator", own, check=check),
                  Case(f"{library}, torch pool", pooled, check=check),
                  Case(f"{library}, torch pool, CUDA graph", graphed_pooled, check=check)]
    return cases


register(Workload(
    name="extern-pool",
    description="fullgraph.memory: extern ops that allocate in CuPy / Warp, with and without PyTorch's pool",
    sizes={"seed": {"n": 2**24}, "small": {"n": 2**20}, "tiny": {"n": 2**12}},
    build=_extern_pool,
))
