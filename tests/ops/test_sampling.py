"""Farthest-point sampling against a float64 loop: both calling forms, ties, ragged, graphs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fullgraph
from conftest import DEVICES, backend_cases, points
from fullgraph.ops.sampling import api as sampling
from fullgraph.ops.sampling.cuda import backend as sampling_cuda


def _oracle(x: np.ndarray, count: int, start: int) -> list[int]:
    """The textbook loop in float64: farthest from the taken set, ties to the smaller index."""
    taken = [start]
    gap = np.full(len(x), np.inf)
    while len(taken) < min(count, len(x)):
        gap = np.minimum(gap, ((x - x[taken[-1]]) ** 2).sum(-1))
        taken.append(int(np.argmax(gap)))
    return taken


@pytest.mark.parametrize("backend, device", [c for c in backend_cases() if c.values[0] != "cpu"])
@pytest.mark.parametrize("distribution", ["uniform", "clustered", "duplicates", "grid", "far"])
@pytest.mark.parametrize("dim", [3, 7])
def test_padded_form_matches_the_float64_loop(backend, device, distribution, dim, generator):
    x = torch.stack([points(distribution, 80, dim, generator) for _ in range(3)])
    lengths = torch.tensor([80, 33, 5])
    idx = fullgraph.fps(x.to(device).float(), n_samples=12, lengths=lengths.to(device), random_start=False,
                        backend=backend)
    assert idx.shape == (3, 12) and idx.dtype == torch.int64
    for b in range(3):
        want = _oracle(x[b, :int(lengths[b])].float().double().numpy(), 12, 0)
        assert idx[b].tolist() == want + [-1] * (12 - len(want))


@pytest.mark.parametrize("backend, device", [c for c in backend_cases() if c.values[0] == "triton"])
@pytest.mark.parametrize("path", ["resident", "streamed", "parts", "streamed parts"])
@pytest.mark.interpreted(keep=1)
def test_the_triton_kernel_equals_the_loop(backend, device, path, generator, monkeypatch):
    """The kernel's four forms (a cloud in one program's registers or streamed by it in
    chunks; cut into parts that exchange candidates, each part resident or streamed), on
    ties, duplicates, a non-finite point, an empty item, bf16, and clouds larger than a
    chunk and a part."""
    if "streamed" in path:
        monkeypatch.setattr(sampling, "RESIDENT_ELEMENTS", 512)  # 128 points resident, chunks of 32
    if "parts" in path:
        monkeypatch.setattr(sampling, "MIN_SLICE", 64)
    x = torch.stack([points("grid", 300, 3, generator), points("duplicates", 300, 3, generator),
                     points("far", 300, 3, generator), points("normal", 300, 3, generator)]).to(device)
    x[3, 7] = math.inf
    lengths = torch.tensor([300, 290, 0, 131], device=device)
    for dtype in (torch.float32, torch.bfloat16):
        for count in (1, 300) if path == "resident" else (1, 12):
            want = fullgraph.fps(x.to(dtype), n_samples=count, lengths=lengths, random_start=False, backend="torch")
            got = fullgraph.fps(x.to(dtype), n_samples=count, lengths=lengths, random_start=False, backend=backend)
            assert torch.equal(got, want), (dtype, count)
    assert (got[2] == -1).all() and not (got[3] == 7).any()


CLUSTERS = torch.cuda.is_available() and sampling_cuda.available("cuda")


@pytest.mark.skipif(not CLUSTERS, reason="needs a GPU with thread-block clusters and nvcc")
@pytest.mark.parametrize("cut", [dict(), dict(cluster=1), dict(cluster=2), dict(cluster=6),
                                 dict(cluster=6, shared_copy=False), dict(cluster=8, shared_copy=False)])
def test_the_cuda_kernel_equals_the_loop(cut, generator):
    """The cluster kernel (as it chooses, a cloud in one block, or cut into 2-8 blocks that post
    their candidates into each other's shared memory; the winners' coordinates from the copy
    in shared memory or from global memory) on the Triton test's clouds, in D = 1 to 4, and a
    cloud too large for a cluster refused by name."""
    for size, dim in ((300, 3), (1500, 3), (300, 1), (300, 2), (300, 4)):
        x = torch.stack([points("grid", size, dim, generator), points("duplicates", size, dim, generator),
                         points("far", size, dim, generator), points("normal", size, dim, generator)]).cuda()
        x[3, 7] = math.inf
        x[1] *= 2.0**100  # scaled by the kernel before squaring
        x[0] *= 2.0**-130  # and here (subnormal coordinates: divided by 2^-130 or so)
        lengths = torch.tensor([size, size - 10, 0, 131], device="cuda")
        for dtype in (torch.float32, torch.bfloat16):
            for count in (1, 2, 200):
                want = fullgraph.fps(x.to(dtype), n_samples=count, lengths=lengths, random_start=False, backend="torch")
                got = sampling_cuda.farthest_points(x.to(dtype), lengths, None, count, **cut)
                assert torch.equal(got, want), (size, dim, dtype, count)
        start = torch.tensor([5, 3, 0, 7], device="cuda")  # point 7 of item 3 is not finite: the origin instead
        want = torch.ops.fullgraph.farthest_points(x.float(), lengths, start, 100, "torch")
        assert torch.equal(sampling_cuda.farthest_points(x, lengths, start, 100, **cut), want)
    too_many = sampling_cuda.max_points() + 1
    with pytest.raises(ValueError, match=f'x: backend="cuda" takes clouds of at most {too_many - 1} points'):
        fullgraph.fps(torch.rand(1, too_many, 3, device="cuda"), n_samples=2, backend="cuda")
    with pytest.raises(ValueError, match="cluster: expected 0 .choose. or 1 to 8 blocks"):
        sampling_cuda.farthest_points(torch.rand(1, 10, 3, device="cuda"), None, None, 2, cluster=9)


@pytest.mark.skipif(not CLUSTERS, reason="needs a GPU with thread-block clusters and nvcc")
def test_the_cuda_kernel_on_clouds_it_cuts_itself(generator):
    """Batches whose clusters all fit at once and batches that do not, clouds too large for the
    shared copy (D = 4, 65,536 points), against the Triton kernel (the same contract)."""
    for batch, size, dim, count in ((16, 16384, 3, 300), (40, 16384, 3, 50), (2, 16384, 4, 100),
                                    (2, 65536, 3, 100), (3, 5000, 2, 700)):
        x = torch.randn(batch, size, dim, device="cuda", generator=torch.Generator("cuda").manual_seed(size))
        x[:, ::7] = x[:, 3:4]  # duplicates: ties to the smaller index
        want = fullgraph.fps(x, n_samples=count, random_start=False, backend="triton")
        assert torch.equal(sampling_cuda.farthest_points(x, None, None, count), want), (batch, size, dim)


def test_the_backend_is_named():
    with pytest.raises(ValueError, match="backend: expected one of"):
        fullgraph.fps(torch.rand(2, 10, 3), n_samples=2, backend="cupy")
    with pytest.raises(ValueError, match='backend: "cuda" needs CUDA tensors'):
        fullgraph.fps(torch.rand(2, 10, 3), n_samples=2, backend="cuda")
    with pytest.raises((TypeError, ValueError, ImportError), match='backend[:=] ?"triton"'):
        fullgraph.fps(torch.rand(2, 10, 3, dtype=torch.float64), n_samples=2, backend="triton")


@pytest.mark.parametrize("device", DEVICES)
def test_flat_form_like_torch_cluster(device, generator):
    sizes = [10, 1, 25]
    x = torch.rand(sum(sizes), 2, generator=generator, dtype=torch.float64)
    batch = torch.cat([torch.full((n,), b) for b, n in enumerate(sizes)])
    idx = fullgraph.fps(x.to(device), 0.3, batch=batch.to(device), random_start=False)
    want, start = [], 0
    for n in sizes:
        want += [start + i for i in _oracle(x[start:start + n].numpy(), math.ceil(0.3 * n), 0)]
        start += n
    assert idx.tolist() == want
    assert fullgraph.fps(x.to(device), n_samples=4, batch=batch.to(device), random_start=False).shape == (4 + 1 + 4,)


@pytest.mark.parametrize("device", DEVICES)
def test_random_start_is_a_valid_point_and_seeded(device, generator):
    x = torch.rand(4, 50, 3, generator=generator).to(device)
    x[0, 0] = math.nan  # a non-finite point is never taken
    lengths = torch.tensor([50, 3, 20, 1], device=device)
    first = fullgraph.fps(x, n_samples=5, lengths=lengths, generator=torch.Generator(device).manual_seed(5))
    again = fullgraph.fps(x, n_samples=5, lengths=lengths, generator=torch.Generator(device).manual_seed(5))
    assert torch.equal(first, again)
    for b in range(4):
        row = first[b][first[b] >= 0]
        assert len(set(row.tolist())) == len(row) == min(5, int(lengths[b]) - (b == 0))
        assert (row < lengths[b]).all() and not (b == 0 and (row == 0).any())


def test_bad_input_is_named():
    x = torch.rand(2, 10, 3)
    cases = [
        (lambda: fullgraph.fps(x, n_samples=11), ValueError, "n_samples: expected at most N = 10"),
        (lambda: fullgraph.fps(x, 1.5), ValueError, r"ratio: expected a fraction in \(0, 1\], got 1.5"),
        (lambda: fullgraph.fps(x, 0.0), ValueError, "ratio: expected a finite float > 0"),
        (lambda: fullgraph.fps(x), ValueError, "ratio, n_samples: expected exactly one of them"),
        (lambda: fullgraph.fps(x, n_samples=0), ValueError, "n_samples: expected an int >= 1"),
        (lambda: fullgraph.fps(x[0], 0.5, batch=torch.tensor([1, 0] * 5)), ValueError, "batch: expected a sorted"),
        (lambda: fullgraph.fps(x, 0.5, batch=torch.zeros(10, dtype=torch.int64)), ValueError, "batch: only for flat"),
        (lambda: fullgraph.fps(x.long(), 0.5), TypeError, "x: expected a floating-point tensor"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_compiles_once_across_sizes(device, generator):
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(lambda x, n: fullgraph.fps(x, n_samples=8, lengths=n, random_start=False),
                             backend=counter, fullgraph=True, dynamic=True)
    for size in (20, 37, 64):
        x = torch.rand(2, size, 3, generator=generator).to(device)
        lengths = torch.tensor([size, size // 2], device=device)
        assert torch.equal(compiled(x, lengths), fullgraph.fps(x, n_samples=8, lengths=lengths, random_start=False))
    assert counter.frame_count == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_padded_form_replays_from_a_cuda_graph(generator):
    sample = fullgraph.graphs.graphed(lambda x: fullgraph.fps(x, n_samples=16, random_start=False))
    for _ in range(3):
        x = torch.rand(4, 500, 3, generator=generator).cuda()
        assert torch.equal(sample(x), fullgraph.fps(x, n_samples=16, random_start=False))


def _voxel_oracle(pos, size, batch, start=None, end=None):
    """PyG's voxel_grid numbering in float64 Python (the item id as a last coordinate)."""
    pos = np.concatenate([pos, batch[:, None]], 1)
    size = np.append(np.broadcast_to(size, pos.shape[1] - 1), 1.0)
    start = pos.min(0) if start is None else np.append(np.broadcast_to(start, pos.shape[1] - 1), 0.0)
    end = pos.max(0) if end is None else np.append(np.broadcast_to(end, pos.shape[1] - 1), batch.max())
    counts = np.floor((end - start) / size).astype(np.int64) + 1
    strides = np.concatenate([[1], np.cumprod(counts)[:-1]])
    return (np.floor((pos - start) / size).astype(np.int64) * strides).sum(1)


@pytest.mark.parametrize("device", DEVICES)
def test_voxel_grid_numbers_voxels_like_pyg(device, generator):
    pos = torch.rand(200, 3, generator=generator, dtype=torch.float64) * 4 - 1
    batch = torch.sort(torch.randint(0, 3, (200,), generator=generator)).values
    for size, start, end in ((0.5, None, None), ([0.3, 0.7, 1.1], -1.0, 3.0)):
        got = fullgraph.voxel_grid(pos.to(device), size, batch.to(device), start, end)
        np.testing.assert_array_equal(got.cpu().numpy(), _voxel_oracle(pos.numpy(), np.asarray(size), batch.numpy(),
                                                                       start, end))
    # Points in one voxel share its id; a voxel never spans two items.
    ids = fullgraph.voxel_grid(pos, 0.5, batch)
    for voxel in ids.unique():
        members = ids == voxel
        assert batch[members].unique().numel() == 1
        assert (torch.floor((pos[members] - pos.min(0).values) / 0.5).unique(dim=0).shape[0]) == 1
    with pytest.raises(ValueError, match="size: expected voxel edges > 0"):
        fullgraph.voxel_grid(pos, 0.0)
    with pytest.raises(ValueError, match="size: expected a float or 3 of them"):
        fullgraph.voxel_grid(pos, [0.1, 0.2])


@pytest.mark.slow
def test_voxel_grid_refuses_the_same_compiled_or_not():
    pos = torch.rand(10, 3)
    far = pos.clone()
    far[0, 0] = float("nan")
    compiled = torch.compile(fullgraph.voxel_grid, fullgraph=True, dynamic=True)
    for args, error, message in [((pos, -1.0), ValueError, "size: expected voxel edges > 0"),
                                 ((far, 0.1), ValueError, "pos: expected finite coordinates"),
                                 ((pos, 0.1, None, 1.0, 0.0), ValueError, "end: expected >= start")]:
        for run in (fullgraph.voxel_grid, compiled):
            with pytest.raises(error, match=message):
                run(*args)
    for size in ("a", None, [0.1, "b", 0.2]):
        with pytest.raises(TypeError, match="size: expected a float, a sequence of 3 floats or a tensor"):
            fullgraph.voxel_grid(pos, size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_voxel_grid_keeps_items_apart_in_low_precision(dtype, generator):
    """The item id is an integer coordinate: in bfloat16 it rounded from 256 on (float16: 2048)."""
    items = 3000
    pos = torch.rand(items, 2, generator=generator).to(dtype)
    batch = torch.arange(items)
    ids = fullgraph.voxel_grid(pos, 10.0, batch)  # one voxel per item
    assert ids.unique().numel() == items
    np.testing.assert_array_equal(ids.numpy(), _voxel_oracle(pos.double().numpy(), np.asarray(10.0),
                                                             batch.numpy()))
