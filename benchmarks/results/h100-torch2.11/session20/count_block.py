import sys, torch, fullgraph
sys.path.insert(0, "benchmarks")
from replay_profile import graphed_ms
from fullgraph.ops.neighbors.triton import grid as g
gen = torch.Generator(device="cuda").manual_seed(0)
axis = torch.linspace(-1, 1, 30, device="cuda")
q = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), -1).reshape(-1, 3)
cloud = torch.randn(100_000, 3, device="cuda", generator=gen)
feats = torch.randn(100_000, 25, device="cuda", generator=gen)
u = torch.rand(1_000_000, 3, device="cuda", generator=gen)
for block in (1024, 256, 128, 1024, 256):
    g._COUNT_BLOCK = block
    a = graphed_ms(lambda: fullgraph.knn_aggregate(q, cloud, feats, 7, sigma=0.1))
    b = graphed_ms(lambda: fullgraph.radius_aggregate(q, cloud[:25000], feats[:25000], 0.1, sigma=0.1))
    c = graphed_ms(lambda: fullgraph.knn(u, u, 16))
    print(f"_COUNT_BLOCK {block}: knn_aggregate seed {a*1000:.1f} us, radius_aggregate seed {b*1000:.1f} us, knn 1M uniform {c:.3f} ms", flush=True)
