"""Host and device time of replaying CUDA graphs of N small kernels (is launch ~ nodes?)."""
import time, torch
x = torch.randn(1 << 16, device="cuda")
for n in (50, 300, 1000):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x.clone()
        for _ in range(n): y.mul_(1.0000001)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n): y.mul_(1.0000001)
    for _ in range(5): g.replay()
    torch.cuda.synchronize()
    host = []
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dev = []
    for _ in range(20):
        torch.cuda.synchronize()
        a.record(); t = time.perf_counter(); g.replay(); host.append((time.perf_counter() - t) * 1e6); b.record()
        torch.cuda.synchronize(); dev.append(a.elapsed_time(b) * 1e3)
    host.sort(); dev.sort()
    print(f"{n} kernels: replay host {host[10]:.1f} us, device {dev[10]:.1f} us ({dev[10] / n:.2f} us a kernel)")
