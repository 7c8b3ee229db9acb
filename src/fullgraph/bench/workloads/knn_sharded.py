"""kNN and kNN aggregation over a cloud sharded across ranks (``fullgraph.distributed``),
launched with ``torchrun --nproc-per-node N fullgraph bench knn-sharded``: every rank holds
an equal share of the points (strong scaling: the sizes are totals; ``weak``: per rank), a
region of space (domain decomposition; see ``_shard``). Shards of random points would not
scale: every rank would search all its queries against every shard."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ... import distributed
from .base import Case, Workload, register

CHANNELS = 8


def _shard(distribution: str, count: int, rank: int, world: int, device, weak: bool = False) -> torch.Tensor:
    """This rank's ``count`` 3-D points, drawn on ``device`` (hundreds of millions of points:
    no host copy). The shards are domains, as in domain-parallel training: uniform points in
    the rank's slab [rank / world, (rank + 1) / world) of the unit cube along x, or points of
    the rank's 64 / world of the Gaussian clusters (64, the same on every rank) in the order
    of their centres along x, so that every cluster holds 1/64 of the points whatever the
    rank count (one that divides 64): every rank count gives the same cloud, in
    distribution. ``weak``: the domain grows with the ranks instead, a unit cube per rank
    along x (rank r: [r, r + 1), all 64 clusters shifted)."""
    generator = torch.Generator(device=device).manual_seed(1000 + rank)
    slab = (rank, 1.0) if weak else (rank / world, 1.0 / world)  # (start, width) along x
    if distribution == "uniform":
        points = torch.rand(count, 3, generator=generator, device=device)
        points[:, 0] = slab[0] + points[:, 0] * slab[1]
        return points
    centres = torch.rand(64, 3, generator=torch.Generator(device=device).manual_seed(0), device=device)
    if weak:
        centres[:, 0] += rank
        own = torch.arange(64, device=device)
    else:
        own = centres[:, 0].argsort().tensor_split(world)[rank]
        own = own if own.numel() else torch.arange(64, device=device)  # more ranks than clusters
    members = own[torch.randint(own.numel(), (count,), generator=generator, device=device)]
    return centres[members] + 0.01 * torch.randn(count, 3, generator=generator, device=device)


def _knn_sharded(params, device):
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("launch it with torchrun (torchrun --nproc-per-node N -m fullgraph.cli bench knn-sharded): "
                         "torch.distributed is not initialized")
    world, rank = dist.get_world_size(), dist.get_rank()
    weak, train = bool(params.get("per_rank")), params.get("train", True)
    count = params["points"] if weak else params["points"] // world
    k = params["k"]
    # Bytes each rank receives per kNN: the other ranks' reference shards, float32 [count, 3].
    ring_bytes = (world - 1) * count * 3 * 4

    def trainable(points):
        """(points, features) leaves for a train step. Only sizes that train make them: with
        their copies they take 44 B a point (9 GB at 2 x 10^8 points, each cloud)."""
        features = torch.randn(count, CHANNELS, generator=torch.Generator(device=device).manual_seed(rank),
                               device=device)
        return points.clone().requires_grad_(), features.requires_grad_()

    cases = []
    clouds = {distribution: _shard(distribution, count, rank, world, device, weak=weak)
              for distribution in ("uniform", "clustered")}
    for distribution, points in clouds.items():
        def search(points=points):
            return distributed.knn(points, points, k)

        def train_step(leaves=trainable(points) if train else None):
            out = distributed.knn_aggregate(leaves[0], leaves[0], leaves[1], k, sigma=0.01)
            out.square().mean().backward()
            return out

        # The train step's neighbour rows (M x k x (3 + C) floats: 70 GB for 100M queries per
        # rank) exceed one GPU at the seed and weak sizes: forward only there.
        cases.append(Case(f"distributed.knn, {distribution}", search, train_step if train else None,
                          check=lambda: {"received_bytes_per_rank": ring_bytes, "points_per_rank": count}))
    # The radius projector's aggregation on the uniform cloud, within the radius that holds 16
    # points on average (the density: the total over the unit cube, or the points per rank's cube).
    density = count if weak else count * world
    radius = (3 * 16 / (4 * math.pi * density)) ** (1 / 3)

    def radius_search(points=clouds["uniform"]):
        return distributed.radius(points, points, radius, 32)

    def radius_train_step(leaves=trainable(clouds["uniform"]) if train else None):
        out = distributed.radius_aggregate(leaves[0], leaves[0], leaves[1], radius, sigma=radius / 2)
        out.square().mean().backward()
        return out

    cases.append(Case("distributed.radius, uniform", radius_search, radius_train_step if train else None,
                      check=lambda: {"received_bytes_per_rank": ring_bytes, "points_per_rank": count,
                                     "radius": radius}))
    # Shards of random points (every rank's points anywhere in the cloud's space), made into
    # slabs by distributed.partition before the search: the partition is part of the time.
    scattered = _shard("uniform", count, rank, 1, device, weak=weak)

    def partitioned(points=scattered):
        part = distributed.partition(points)
        return distributed.knn(part.points, part.points, k)

    cases.append(Case("partition + knn, uniform", partitioned,
                      check=lambda: {"points_per_rank": count}))
    return cases


register(Workload(
    name="knn-sharded",
    description="kNN (forward) and a kNN-aggregation train step over a 3-D cloud sharded across the ranks of "
                "torchrun (uniform and clustered clouds; every point's k nearest among all ranks' points), and "
                "radius search with the radius projector's aggregation as the train step (uniform)",
    sizes={"seed": {"points": 200_000_000, "k": 16, "train": False},
           "weak": {"points": 250_000_000, "k": 16, "per_rank": True, "train": False},
           # 2 x 10^8 a GPU: the weak size before 2.5 x 10^8 fitted two H100s.
           "weak-h100": {"points": 200_000_000, "k": 16, "per_rank": True, "train": False},
           # The largest size whose train steps fit one GPU (their neighbour rows: ~0.7 KB a query).
           "medium": {"points": 20_000_000, "k": 16},
           "small": {"points": 1_000_000, "k": 16},
           "tiny": {"points": 4_000, "k": 16}},
    build=_knn_sharded,
    notes=["each rank receives the other ranks' reference shards once per call (the ring): "
           "(ranks - 1) x points per rank x 12 bytes; the train step also exchanges the neighbours' rows",
           "the distributed.knn rows shard by region (slabs); 'partition + knn' starts from shards of random "
           "points and times distributed.partition with the search"],
    baseline="distributed.knn, uniform",
    collective=True,
))
