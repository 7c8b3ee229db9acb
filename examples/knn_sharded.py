"""kNN over a point cloud sharded across processes (README: "More than one GPU").

Run: torchrun --nproc-per-node 2 examples/knn_sharded.py
(NCCL where every process has a GPU of its own; gloo on the CPU otherwise.)
"""

import torch
import torch.distributed as dist

import fullgraph
from fullgraph import distributed

backend = distributed.process_group_backend()
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cpu")
if backend == "nccl":
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)

# This rank's shard of the queries and of the references (here: random points).
generator = torch.Generator().manual_seed(rank)
query = torch.rand(20_000, 3, generator=generator).to(device)
ref = torch.rand(50_000, 3, generator=generator).to(device)

dists, idx = distributed.knn(query, ref, k=16)  # idx: global reference numbers, rank after rank

# The same on one device, on every rank's references gathered.
shards = [torch.empty_like(ref) for _ in range(world)]
dist.all_gather(shards, ref)
same = torch.equal(idx, fullgraph.knn(query, torch.cat(shards), k=16)[1])
print(f"rank {rank} of {world}: neighbours {tuple(idx.shape)} on {device}, equal to one device: {same}")
dist.destroy_process_group()
