import sys, torch
sys.path.insert(0, "benchmarks")
from replay_profile import graphed_ms
from fullgraph.ops.neighbors.triton import grid as g
gen = torch.Generator(device="cuda").manual_seed(0)
# the seed grid: 27,000 + 100,000 sorted slots in 2 x 400,001; the pair keys: 189,000 in 100,001
cases = {"grid slots": (torch.cat([torch.randint(0, 400_001, (27_000,), device="cuda", generator=gen).sort().values,
                                   torch.randint(0, 400_001, (100_000,), device="cuda", generator=gen).sort().values]).int(), 400_002, 27_000),
         "pair keys": (torch.randint(0, 100_001, (189_000,), device="cuda", generator=gen).sort().values.int(), 100_001, None)}
for name, (values, count, split) in cases.items():
    parts = [values] if split is None else [values[:split], values[split:]]
    def torch_way():
        slots = torch.arange(count, dtype=values.dtype, device="cuda")
        return [torch.searchsorted(p, slots, out_int32=True) for p in parts]
    ref = torch.stack(torch_way())
    print(f"{name}: torch arange + searchsorted {graphed_ms(torch_way) * 1000:.1f} us", flush=True)
    for setting in ((1024, 4), (256, 8), (128, 4), (256, 4), (64, 2), (512, 16)):
        g.LOWER_BOUNDS_BLOCK = setting
        assert torch.equal(g.lower_bounds(values, count, split).long(), ref.long())
        print(f"{name}: lower_bounds {setting} {graphed_ms(lambda: g.lower_bounds(values, count, split)) * 1000:.1f} us", flush=True)
