"""DGCNN seed train step, compiled + CUDA graphs: host and device time of each phase
(forward, loss, backward, Adam), medians of 20 steps, no profiler."""
import time, torch, statistics
from fullgraph.models import DGCNN
torch.manual_seed(0)
model = DGCNN(out_channels=16, k=20).cuda()
xyz = torch.rand(8, 4096, 3, generator=torch.Generator().manual_seed(0)).cuda()
run = torch.compile(model, fullgraph=True, mode="reduce-overhead")
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
model.train()
names = ("forward", "loss", "backward", "adam")
host = {n: [] for n in names}; dev = {n: [] for n in names}; total = []
for step in range(30):
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
    torch.cuda.synchronize()
    t = [time.perf_counter()]; ev[0].record()
    opt.zero_grad(); out = run(xyz); ev[1].record(); t.append(time.perf_counter())
    loss = out.square().mean(); ev[2].record(); t.append(time.perf_counter())
    loss.backward(); ev[3].record(); t.append(time.perf_counter())
    opt.step(); ev[4].record(); t.append(time.perf_counter())
    torch.cuda.synchronize()
    if step >= 10:
        for i, n in enumerate(names):
            host[n].append((t[i + 1] - t[i]) * 1e3); dev[n].append(ev[i].elapsed_time(ev[i + 1]))
        total.append(ev[0].elapsed_time(ev[4]))
for n in names:
    print(f"{n:9s} host {statistics.median(host[n]):.3f} ms, device {statistics.median(dev[n]):.3f} ms")
print(f"step device {statistics.median(total):.3f} ms")
