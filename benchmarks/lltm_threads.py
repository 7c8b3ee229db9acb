"""fullgraph.lltm on a CPU: the extension against the plain-PyTorch reference, forward and
forward + backward, at 1 and 2 threads and three batch sizes (medians, microseconds). The
rule that "auto" follows on CPUs (ops/lltm/api.py) cites its output.

    python benchmarks/lltm_threads.py
"""
import torch, time, fullgraph, statistics
torch.manual_seed(0)
def t(fn, n=30):
    for _ in range(3): fn()
    ts=[]
    for _ in range(n):
        s=time.perf_counter(); fn(); ts.append((time.perf_counter()-s)*1e6)
    return statistics.median(ts)
for threads in (1, 2):
    torch.set_num_threads(threads)
    for B in (16, 256, 2048):
        cell = fullgraph.models.LLTM(32, 128)
        x=torch.randn(B,32,requires_grad=True); h=torch.randn(B,128); c=torch.randn(B,128)
        row=[]
        for be in ("extension","torch"):
            f=lambda: fullgraph.lltm(x, cell.weights, cell.bias, h, c, backend=be)
            def fb():
                a,b=f(); (a.sum()+b.sum()).backward()
            row.append((t(f), t(fb)))
        print(f"threads={threads} B={B} ext fwd {row[0][0]:.0f} fb {row[0][1]:.0f} | torch fwd {row[1][0]:.0f} fb {row[1][1]:.0f} us", flush=True)
