"""Feature-space kNN on CUDA: the "dense" backend against cdist + topk, the Triton search and
the reference, eager and graphed, with the rows its certificate sends back (normal clouds,
shifted by 1000, clustered), then a torch.profiler table of one call per small shape.

    python benchmarks/dense_profile.py > dense.log     (needs a CUDA device)
    python benchmarks/dense_profile.py --quick          (dense and cdist + topk only)
    python benchmarks/dense_profile.py --quick --shapes 8,4096,4096,64,20   (those shapes only)
    python benchmarks/dense_profile.py --sweep          (the fused kernel's tiles, graphed)
    python benchmarks/dense_profile.py --chunks         (the fused lists' chunk size and slack, graphed,
                                                         with the rows failed)
    python benchmarks/dense_profile.py --operators      (the capture path run eagerly: torch's operators
                                                         with their input shapes, by CUDA time)
    python benchmarks/dense_profile.py --keys           (the fused chunk lists against the stored
                                                         minima, by FUSED_MAX_KEYS, k up to 50)
    python benchmarks/dense_profile.py --brute          (every pair measured in one kernel against
                                                         the products' path, by size)
    python benchmarks/dense_profile.py --floor          (the fused lists beside their products alone;
                                                         the members in one kernel or apart)
    python benchmarks/dense_profile.py --points         (3-D clouds: dense against the grid)
    python benchmarks/dense_profile.py --host           (a tiny eager call's host time: cProfile, profiler)
    python benchmarks/dense_profile.py --brute-sweep    (the brute force's tile settings, graphed)
    python benchmarks/dense_profile.py --precision      (wide clouds: the first products of float16 operands
                                                         or in three TF32 products, the minima's queries held or not)
    python benchmarks/dense_profile.py --fused-precision (the fused lists' first products: tf32x3 alone or
                                                         float16 operands first, normal and clustered)
    python benchmarks/dense_profile.py --held-sweep     (the stored minima alone by the held kernel's tiles)
    python benchmarks/dense_profile.py --members-all    (every member measured exactly, or a first measure)
    python benchmarks/dense_profile.py --members-by-quad (the members re-measured four threads a member or in tiles)
    python benchmarks/dense_profile.py --tiles-sweep    (the minima's tiles at 10^6 references, D = 128)
    python benchmarks/dense_profile.py --settings       (the members' kernels, the candidates' tiles: SETTINGS)
    python benchmarks/dense_profile.py --wide-smallest  (the stored minima's selection against torch.topk)

CUDA-event medians after warm-up, all in one process; the profile is of one graphed call.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from torch.profiler import ProfilerActivity, profile

import fullgraph
from fullgraph.bench.timing import time_call
from fullgraph.ops.neighbors.dense import backend as dense, kernels as triton_dense

SHAPES = ((16, 256, 256, 64, 20), (32, 1024, 1024, 64, 20), (8, 4096, 4096, 64, 20), (1, 10000, 1000000, 128, 10),
          (1, 20000, 200000, 16, 10), (4, 4096, 16384, 32, 50))
SWEEP = {"FUSED_BLOCK_M": (32, 64, 128), "FUSED_NUM_WARPS": (2, 4, 8), "FUSED_CHUNK": (2, 4)}
FAILED: list[tuple[int, int]] = []


def median_ms(fn, runs=30) -> float:
    return time_call(fn, torch.device("cuda"), warmup=3, runs=runs).median_ms


def graphed(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _count_failed_rows():
    redo = dense._redo

    def counting(*args):
        failed = args[9]
        if not torch.cuda.is_current_stream_capturing():
            FAILED.append((int(failed.sum()), failed.numel()))
        return redo(*args)

    dense._redo = counting


def sweep(generator) -> None:
    """Graphed dense kNN of the first three shapes under every tile setting of SWEEP."""
    _under_settings([dict(zip(SWEEP, setting)) for setting in itertools.product(*SWEEP.values())], generator)


def _under_settings(settings, generator) -> None:
    """Graphed dense kNN of the first three shapes under each setting (``triton_dense``
    constants by name), each restored after."""
    clouds = [(torch.randn(b, m, d, device="cuda", generator=generator),
               torch.randn(b, n, d, device="cuda", generator=generator), k) for b, m, n, d, k in SHAPES[:3]]
    print("shapes:", "; ".join("B={} M={} N={} D={} k={}".format(*shape) for shape in SHAPES[:3]))
    for setting in settings:
        defaults = {name: getattr(triton_dense, name) for name in setting}
        for name, value in setting.items():
            setattr(triton_dense, name, value)
        try:
            times = [median_ms(graphed(lambda: fullgraph.knn(q, r, k, backend="dense"))) for q, r, k in clouds]
            print(setting or "defaults", " ".join(f"{t:.3f}" for t in times), "ms", flush=True)
        except Exception as error:  # a setting the kernels cannot take: say so, go on
            print(setting, "failed:", type(error).__name__, str(error)[:300], flush=True)
        for name, value in defaults.items():
            setattr(triton_dense, name, value)


CHUNK_SHAPES = ((8, 4096, 4096, 64, 20), (32, 1024, 1024, 64, 20), (4, 4096, 16384, 32, 50), (8, 4096, 4096, 64, 32))


def chunks(generator) -> None:
    """Graphed dense kNN by the fused lists' chunk size and chunk slack (FUSED_CHUNK,
    CHUNK_SLACK), with the rows a normal and a clustered cloud failed."""
    clouds = [(torch.randn(b, m, d, device="cuda", generator=generator),
               torch.randn(b, n, d, device="cuda", generator=generator), _clustered(b, m, n, d, generator), k)
              for b, m, n, d, k in CHUNK_SHAPES]
    for chunk, slack in ((4, 4), (2, 4), (2, 6), (4, 2)):
        triton_dense.FUSED_CHUNK, dense.CHUNK_SLACK = chunk, slack
        cells = []
        for (q, r, clustered, k), shape in zip(clouds, CHUNK_SHAPES):
            time = median_ms(graphed(lambda: fullgraph.knn(q, r, k, backend="dense")))
            FAILED.clear()
            fullgraph.knn(q, r, k, backend="dense")
            fullgraph.knn(*clustered, k, backend="dense")
            cells.append(f"{shape} {time:.3f} (failed {[f for f, _ in FAILED]})")
        print(f"chunk {chunk} slack {slack}:", "; ".join(cells), flush=True)


# (B, M, N, D) where the fused path may run (N <= FUSED_MAX_COLUMNS), each with k = 20, 32, 50.
KEY_SHAPES = ((8, 4096, 4096, 64), (32, 1024, 1024, 64), (4, 4096, 16384, 32), (1, 8192, 65536, 16))


def fused_keys(generator) -> None:
    """Graphed dense kNN with the fused chunk lists up to FUSED_MAX_KEYS 64, 32, 16 chunks a
    query (beyond: the stored minima), and lists of 64 keys allowed on clouds of up to 2^12,
    2^14, 2^16 references, beside cdist + topk graphed, ms; then the rows of a clustered
    cloud the certificate sent back under each setting."""
    for batch, rows, columns, dim in KEY_SHAPES:
        q = torch.randn(batch, rows, dim, device="cuda", generator=generator)
        r = torch.randn(batch, columns, dim, device="cuda", generator=generator)
        clustered = _clustered(batch, rows, columns, dim, generator)
        for k in (20, 32, 50):
            failed = {}
            times = {"cdist+topk": median_ms(graphed(lambda: torch.topk(torch.cdist(q, r), k, largest=False)))}
            def measure(name):
                times[name] = median_ms(graphed(lambda: fullgraph.knn(q, r, k, backend="dense")))
                FAILED.clear()
                fullgraph.knn(*clustered, k, backend="dense")
                failed[name] = sum(f for f, _ in FAILED)

            for keys in (64, 32, 16):
                triton_dense.FUSED_MAX_KEYS = keys
                measure(f"fused up to {keys}")
            triton_dense.FUSED_MAX_KEYS = 64
            columns_by_keys = dict(triton_dense.FUSED_MAX_COLUMNS)
            for most in (2**12, 2**14, 2**16):  # lists of 64 keys on wider clouds
                triton_dense.FUSED_MAX_COLUMNS = {**columns_by_keys, 64: most}
                measure(f"64 keys up to {most}")
            triton_dense.FUSED_MAX_COLUMNS = columns_by_keys
            print(f"B={batch} M={rows} N={columns} D={dim} k={k}:",
                  ", ".join(f"{name} {t:.3f}" for name, t in times.items()),
                  "| clustered rows failed:", ", ".join(f"{name} {n}" for name, n in failed.items()), flush=True)


# (B, M, N, k) of 3-D clouds: DGCNN's first layer (its xyz), smaller and larger items.
POINT_SHAPES = ((8, 4096, 4096, 20), (32, 1024, 1024, 20), (2, 16384, 16384, 16), (1, 100000, 100000, 16))


def points(generator) -> None:
    """Graphed 3-D kNN (uniform clouds in the unit cube, the query cloud the reference one):
    the dense backend against the grid ("triton") and cdist + topk, ms; where the products
    could serve D = 3 (CUDA_AUTO_MIN_DIM)."""
    for batch, rows, columns, k in POINT_SHAPES:
        r = torch.rand(batch, columns, 3, device="cuda", generator=generator)
        q = r[:, :rows].contiguous()
        row = {}
        for backend in ("triton", "dense"):
            row[backend] = median_ms(graphed(lambda: fullgraph.knn(q, r, k, backend=backend)))
        if batch * rows * columns <= 2**31:
            row["cdist+topk"] = median_ms(graphed(lambda: torch.topk(torch.cdist(q, r), k, largest=False)))
        print(f"B={batch} M={rows} N={columns} D=3 k={k}:", ", ".join(f"{n} {t:.3f}" for n, t in row.items()),
              flush=True)


def host(generator) -> None:
    """Where an eager dense call's time goes on the host, for a tiny batch (16 x 256^2 D=64
    k=20: launch-bound): the call's wall time beside cdist + topk's, then cProfile's functions
    by cumulative time and torch.profiler's operators by host time."""
    import cProfile
    import pstats

    q = torch.randn(16, 256, 64, device="cuda", generator=generator)
    r = torch.randn(16, 256, 64, device="cuda", generator=generator)
    call = lambda: fullgraph.knn(q, r, 20, backend="dense")  # noqa: E731
    print(f"eager dense {median_ms(call):.3f} ms, cdist+topk "
          f"{median_ms(lambda: torch.topk(torch.cdist(q, r), 20, largest=False)):.3f} ms", flush=True)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(35)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60), flush=True)


def _products_only_kernel():
    """A kernel of the fused path's products and chunk minima alone (each query's least
    minimum kept, no lists): the floor under ``least_chunks``."""
    from fullgraph._triton import tl, triton

    @triton.jit
    def products_only(q_ptr, r_ptr, r_norms_ptr, out_ptr, rows, columns, dim, share, CHUNK: tl.constexpr,
                      PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        item = tl.program_id(2).to(tl.int64)
        part = tl.program_id(1)
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        least = tl.full((BLOCK_M, BLOCK_N // CHUNK), float("inf"), tl.float32)
        first = part * share
        for start in range(first, tl.minimum(first + share, columns), BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            least = tl.minimum(least, triton_dense._tile_minima(
                q_ptr + item * rows * dim, r_ptr + item * columns * dim, r_norms_ptr + item * columns, m, n, rows,
                columns, dim, CHUNK, PRECISION, BLOCK_K))
        tl.store(out_ptr + (item * rows + m) * tl.num_programs(1) + part, tl.min(least, 1), mask=m < rows)

    return products_only


def _clustered(batch, rows, columns, dim, generator):
    clusters = torch.randn(batch, 50, dim, device="cuda", generator=generator)
    cloud = clusters[:, torch.randint(0, 50, (columns,), device="cuda", generator=generator)]
    cloud = cloud + 0.1 * torch.randn(batch, columns, dim, device="cuda", generator=generator)
    return cloud[:, :rows], cloud


def floor(generator) -> None:
    """Graphed ms of the fused chunk lists (``least_chunks``) beside their products alone (the
    rows the certificate sent back, normal and clustered clouds), and of the whole dense call
    with the chosen chunks' members measured and ordered in one kernel a query
    (``triton_dense.nearest_members``, by its warps) or apart; cdist + topk beside."""
    products_only = _products_only_kernel()
    warps, most = triton_dense.MEMBERS_WARPS, triton_dense.MEMBERS_MAX
    for batch, rows, columns, dim in ((16, 256, 256, 64),) + KEY_SHAPES:
        q = torch.randn(batch, rows, dim, device="cuda", generator=generator)
        r = torch.randn(batch, columns, dim, device="cuda", generator=generator)
        clustered = _clustered(batch, rows, columns, dim, generator)
        norms = (r * r).sum(-1)
        block_n, chunk = triton_dense.FUSED_BLOCK_N, triton_dense.FUSED_CHUNK
        parts = triton_dense._shares(batch, rows, columns, block_n, q.device)
        share = -(-(-(-columns // parts)) // block_n) * block_n
        parts = -(-columns // share)
        out = torch.empty(batch * rows * parts, device="cuda")
        grid = (-(-rows // triton_dense.FUSED_BLOCK_M), parts, batch)
        k = 20 if columns <= 2**14 else 10
        count = k + dense.CHUNK_SLACK + 1
        cells = [f"k={k} cdist+topk {median_ms(graphed(lambda: torch.topk(torch.cdist(q, r), k, largest=False))):.3f}"]
        products = median_ms(graphed(lambda: products_only[grid](
            q, r, norms, out, rows, columns, dim, share, CHUNK=chunk, PRECISION=dense.TENSOR_CORE_PRECISION,
            BLOCK_M=triton_dense.FUSED_BLOCK_M, BLOCK_N=block_n, BLOCK_K=16 if dim <= 16 else 32,
            num_warps=triton_dense.FUSED_NUM_WARPS)))
        q_norms = (q * q).sum(-1)
        lists = median_ms(graphed(lambda: triton_dense.least_chunks(q, q_norms, r, norms, count, chunk,
                                                                    dense.TENSOR_CORE_PRECISION)))
        FAILED.clear()
        for query, ref in ((q, r), clustered):
            fullgraph.knn(query, ref, k, backend="dense")
        cells.append(f"products only {products:.3f} / lists {lists:.3f} (failed rows, normal / clustered: "
                     f"{' / '.join(str(f) for f, _ in FAILED)})")
        for name, setting in (("apart", (warps, 0)), *((f"{w} warps", (w, most)) for w in (1, 2))):
            triton_dense.MEMBERS_WARPS, triton_dense.MEMBERS_MAX = setting
            cells.append(f"{name} {median_ms(graphed(lambda: fullgraph.knn(q, r, k, backend='dense'))):.3f}")
        triton_dense.MEMBERS_WARPS, triton_dense.MEMBERS_MAX = warps, most
        print(f"B={batch} M={rows} N={columns} D={dim}:", ", ".join(cells), flush=True)


BRUTE_SHAPES = ((16, 256, 256, 64, 20), (16, 256, 256, 16, 20), (16, 256, 256, 128, 20), (64, 128, 128, 32, 16),
                (4, 512, 512, 64, 20), (2, 1024, 1024, 64, 20), (32, 1024, 1024, 64, 20), (32, 1024, 1024, 64, 50),
                (8, 2048, 2048, 64, 20), (8, 4096, 4096, 64, 20), (1, 2048, 8192, 16, 10), (1, 4096, 4096, 128, 10))


def brute(generator) -> None:
    """Eager and graphed ms of the dense backend with every pair measured in one kernel
    (``dense.BRUTE_FORCE_MAX_PAIRS`` unbounded, ``dense.BRUTE_FORCE_MAX_DIM`` the kernel's
    own limit) against its products' path (0), cdist + topk beside."""
    limit, widest = dense.BRUTE_FORCE_MAX_PAIRS, dense.BRUTE_FORCE_MAX_DIM
    dense.BRUTE_FORCE_MAX_DIM = triton_dense.BRUTE_FORCE_MAX_DIM
    for batch, rows, columns, dim, k in BRUTE_SHAPES:
        q = torch.randn(batch, rows, dim, device="cuda", generator=generator)
        r = torch.randn(batch, columns, dim, device="cuda", generator=generator)
        plain = lambda: torch.topk(torch.cdist(q, r), k, largest=False)
        times = {"cdist+topk": (median_ms(plain), median_ms(graphed(plain)))}
        for name, pairs_limit in (("products", 0), ("brute force", 2**62)):
            dense.BRUTE_FORCE_MAX_PAIRS = pairs_limit
            call = lambda: fullgraph.knn(q, r, k, backend="dense")
            times[name] = (median_ms(call), median_ms(graphed(call)))
        dense.BRUTE_FORCE_MAX_PAIRS = limit
        print(f"B={batch} M={rows} N={columns} D={dim} k={k} (pairs/item {rows * columns:,}), eager / graphed:",
              ", ".join(f"{name} {e:.3f} / {g:.3f}" for name, (e, g) in times.items()), flush=True)
    dense.BRUTE_FORCE_MAX_DIM = widest


# The brute force's settings, one at a time from the defaults (triton_dense.BRUTE_FORCE_*).
BRUTE_SWEEP = {"BRUTE_FORCE_BLOCK_M": (2, 8, 16), "BRUTE_FORCE_TILE": (4096, 16384), "BRUTE_FORCE_WARPS": (2, 8)}


def brute_sweep(generator) -> None:
    """Graphed ms of the brute force (as "auto" runs it) on small items under each setting of
    BRUTE_SWEEP, the defaults first."""
    clouds = [(torch.randn(b, m, d, device="cuda", generator=generator),
               torch.randn(b, n, d, device="cuda", generator=generator), k) for b, m, n, d, k in
              ((16, 256, 256, 64, 20), (16, 256, 256, 16, 20), (64, 128, 128, 32, 16))]
    defaults = {name: getattr(triton_dense, name) for name in BRUTE_SWEEP}
    settings = [{}] + [{name: value} for name, values in BRUTE_SWEEP.items() for value in values]
    for setting in settings:
        for name, value in {**defaults, **setting}.items():
            setattr(triton_dense, name, value)
        times = [median_ms(graphed(lambda: fullgraph.knn(q, r, k, backend="dense"))) for q, r, k in clouds]
        print(setting or defaults, "16 x 256^2 D=64 / D=16, 64 x 128^2 D=32:", " / ".join(f"{t:.3f}" for t in times),
              "ms", flush=True)
    for name, value in defaults.items():
        setattr(triton_dense, name, value)


def operators(generator) -> None:
    """The capture path's operators with their shapes (run eagerly, as a capture runs it), by
    CUDA time, for the first three shapes."""
    dense._capturing = lambda query: True
    for batch, rows, columns, dim, k in SHAPES[:3]:
        q = torch.randn(batch, rows, dim, device="cuda", generator=generator)
        r = torch.randn(batch, columns, dim, device="cuda", generator=generator)
        for _ in range(2):
            fullgraph.knn(q, r, k, backend="dense")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            fullgraph.knn(q, r, k, backend="dense")
            torch.cuda.synchronize()
        print(f"B={batch} M={rows} N={columns} D={dim} k={k}", flush=True)
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="cuda_time_total", row_limit=40, max_name_column_width=40, max_shapes_column_width=70), flush=True)


# The stored minima's settings ``--precision`` compares: (HALF_FIRST_MIN_DIM, MINIMA_HELD_MAX_DIM).
PRECISION_SETTINGS = {"tf32x3, tiles": (10**9, 0), "tf32x3, held": (10**9, 128), "fp16 first, tiles": (0, 0),
                      "fp16 first, held": (0, 128)}
PRECISION_SHAPES = SHAPES[3:5] + ((1, 10000, 200000, 64, 10), (1, 10000, 100000, 128, 10))


def precision(generator) -> None:
    """Graphed dense kNN on wide clouds (the stored minima) with the first products in tf32x3
    alone or of operands rounded to float16 (the rows they leave unproven again in tf32x3), the minima by tiles of both clouds or with a tile of queries held; the rows the
    first products left unproven (normal / clustered cloud) and the clustered cloud graphed.
    Then a profile of one graphed call of the first shape with the defaults."""
    proven, unproven = dense._proven_lists, []

    def counting(frames, rows, ref_ok, k, radius, precision, needed=None, slack=dense.CHUNK_SLACK):
        d, i, left = proven(frames, rows, ref_ok, k, radius, precision, needed, slack)
        if needed is None and not torch.cuda.is_current_stream_capturing():
            unproven.append(int(left.sum()))
        return d, i, left

    dense._proven_lists = counting
    defaults = dense.HALF_FIRST_MIN_DIM, dict(triton_dense.MINIMA_HELD_MAX_DIM)
    for batch, rows, columns, dim, k in PRECISION_SHAPES:
        q = torch.randn(batch, rows, dim, device="cuda", generator=generator)
        r = torch.randn(batch, columns, dim, device="cuda", generator=generator)
        clustered = _clustered(batch, rows, columns, dim, generator)
        runs = 10 if rows * columns > 1e8 else 30
        cells = []
        for name, (dense.HALF_FIRST_MIN_DIM, held) in PRECISION_SETTINGS.items():
            triton_dense.MINIMA_HELD_MAX_DIM = dict.fromkeys(defaults[1], held)
            try:
                time = median_ms(graphed(lambda: fullgraph.knn(q, r, k, backend="dense")), runs)
                on_clusters = median_ms(graphed(lambda: fullgraph.knn(*clustered, k, backend="dense")), runs)
            except Exception as error:  # (a setting out of shared memory, say)
                cells.append(f"{name} failed: {type(error).__name__}: {str(error)[:200]}")
                continue
            unproven.clear()
            for query, ref in ((q, r), clustered):
                fullgraph.knn(query, ref, k, backend="dense")
            cells.append(f"{name} {time:.3f} (clustered {on_clusters:.3f}; unproven first: {unproven})")
            torch.cuda.empty_cache()
        print(f"B={batch} M={rows} N={columns} D={dim} k={k}:", ", ".join(cells), flush=True)
    dense.HALF_FIRST_MIN_DIM, triton_dense.MINIMA_HELD_MAX_DIM = defaults
    batch, rows, columns, dim, k = PRECISION_SHAPES[0]
    q = torch.randn(batch, rows, dim, device="cuda", generator=generator)
    r = torch.randn(batch, columns, dim, device="cuda", generator=generator)
    replay = graphed(lambda: fullgraph.knn(q, r, k, backend="dense"))
    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60), flush=True)


# Shapes of the fused lists (N <= 2^14): (B, M, N, D, k).
FUSED_SHAPES = ((32, 1024, 1024, 64, 20), (8, 4096, 4096, 64, 20), (8, 4096, 4096, 128, 20), (4, 4096, 16384, 32, 50))


def fused_precision(generator) -> None:
    """Graphed dense kNN on the fused lists with the first products in tf32x3 alone or of
    float16 operands (the rows they leave unproven again in tf32x3), normal and clustered
    clouds, with the valid rows the float16 products left unproven and the rows redone (eager
    calls)."""
    certified, again = triton_dense.certified_lists, []

    def counting(*args, **kwargs):
        if kwargs.get("again", args[17] if len(args) > 17 else False) and not torch.cuda.is_current_stream_capturing():
            again.append(int(args[15].sum()))
        return certified(*args, **kwargs)

    triton_dense.certified_lists = counting
    default = dense.FUSED_HALF_FIRST_MIN_DIM
    for batch, rows, columns, dim, k in FUSED_SHAPES:
        q = torch.randn(batch, rows, dim, device="cuda", generator=generator)
        r = torch.randn(batch, columns, dim, device="cuda", generator=generator)
        clustered = _clustered(batch, rows, columns, dim, generator)
        cells = [f"cdist+topk {median_ms(graphed(lambda: torch.topk(torch.cdist(q, r), k, largest=False))):.3f}"]
        for name, dense.FUSED_HALF_FIRST_MIN_DIM in (("tf32x3", 2**30), ("fp16 first", 1)):
            time = median_ms(graphed(lambda: fullgraph.knn(q, r, k, backend="dense")))
            on_clusters = median_ms(graphed(lambda: fullgraph.knn(*clustered, k, backend="dense")))
            again.clear()
            FAILED.clear()
            for query, ref in ((q, r), clustered):
                fullgraph.knn(query, ref, k, backend="dense")
            cells.append(f"{name} {time:.3f} (clustered {on_clusters:.3f}; unproven first {again}, redone "
                         f"{[f for f, _ in FAILED]})")
        print(f"B={batch} M={rows} N={columns} D={dim} k={k}:", ", ".join(cells), flush=True)
    dense.FUSED_HALF_FIRST_MIN_DIM = default
    triton_dense.certified_lists = certified


def _operands(q, r, precision):
    """The minima kernels' operands in ``precision`` and their factor per item (``twice``)."""
    if precision != "fp16":
        return q, r, None
    unit = triton_dense.half_unit(torch.maximum(q.abs().amax((1, 2)), r.abs().amax((1, 2))))
    return triton_dense.half_operands(q, unit)[0], triton_dense.half_operands(r, unit)[0], 2 / unit**2


# (M, N, D, chunk) of the stored minima and the held tiles tried: (queries, references, warps, stages).
HELD_SHAPES = ((10000, 1000000, 128, 64), (10000, 200000, 64, 32), (20000, 200000, 16, 32))
HELD_TILES = ((128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 8, 2), (64, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
              (64, 128, 8, 3))


def held_sweep(generator) -> None:
    """The stored chunk minima alone of float16 operands, ms (TFLOP/s), by the held kernel's tiles and without it (tiles of both clouds, references first)."""
    defaults = dict(triton_dense.MINIMA_HELD_TILES), dict(triton_dense.MINIMA_HELD_MAX_DIM)
    half_tiles = dict(triton_dense.MINIMA_HELD_HALF_TILES)
    triton_dense.MINIMA_HELD_HALF_TILES.clear()
    for rows, columns, dim, chunk in HELD_SHAPES:
        q = torch.randn(1, rows, dim, device="cuda", generator=generator)
        r = torch.randn(1, columns, dim, device="cuda", generator=generator)
        norms = (r * r).sum(-1)
        padded = max(16, 1 << (dim - 1).bit_length())
        for precision in ("fp16",):  # (tf32 and tf32x3: session 32 run UC)
            cells = []
            operands = _operands(q, r, precision)
            for tiles in (None,) + HELD_TILES:
                triton_dense.MINIMA_HELD_MAX_DIM = dict.fromkeys(defaults[1], 0 if tiles is None else 128)
                if tiles is not None:
                    triton_dense.MINIMA_HELD_TILES[padded] = tiles
                name = "both tiles" if tiles is None else "held %dx%d/%dw/%d" % tiles
                try:
                    ms = median_ms(lambda: triton_dense.chunk_minima(operands[0], operands[1], norms, chunk, precision,
                                                                     twice=operands[2]), 10)
                except Exception as error:  # (out of shared memory)
                    cells.append(f"{name} {type(error).__name__}")
                    continue
                cells.append(f"{name} {ms:.3f} ({2 * rows * columns * dim / ms / 1e9:.0f})")
            print(f"M={rows} N={columns} D={dim} {precision}:", ", ".join(cells), flush=True)
    triton_dense.MINIMA_HELD_TILES.update(defaults[0])
    triton_dense.MINIMA_HELD_HALF_TILES.update(half_tiles)
    triton_dense.MINIMA_HELD_MAX_DIM = defaults[1]


def members_all(generator) -> None:
    """Graphed dense kNN with every chosen member measured in the reference's arithmetic
    (dense.MEASURED_ALL_MAX 64) or the k + SLACK least by a first measure (0), twice each."""
    default = dense.MEASURED_ALL_MAX
    for batch, rows, columns, dim, k in SHAPES[:3] + ((4, 4096, 16384, 32, 50), (8, 4096, 4096, 32, 16)):
        q = torch.randn(batch, rows, dim, device="cuda", generator=generator)
        r = torch.randn(batch, columns, dim, device="cuda", generator=generator)
        times = {0: [], 64: []}
        for most in (0, 64, 0, 64):
            dense.MEASURED_ALL_MAX = most
            times[most].append(median_ms(graphed(lambda: fullgraph.knn(q, r, k, backend="dense"))))
        print(f"B={batch} M={rows} N={columns} D={dim} k={k}:",
              ", ".join(f"all measured up to {most}: " + " / ".join(f"{t:.3f}" for t in ts)
                        for most, ts in times.items()), flush=True)
    dense.MEASURED_ALL_MAX = default


def members_by_quad(generator) -> None:
    """Graphed dense kNN with the members re-measured by four threads a member
    (``triton_dense.MEMBERS_BY_QUAD``) or in tiles of members by coordinates, twice each."""
    default = triton_dense.MEMBERS_BY_QUAD
    shapes = SHAPES[:3] + ((16, 256, 256, 64, 20), (4, 4096, 16384, 32, 50), (8, 4096, 4096, 128, 20),
                           (10000, 100000, 128, 10))
    for shape in shapes:
        (batch, rows, columns, dim, k) = shape if len(shape) == 5 else (1, *shape)
        q = torch.randn(batch, rows, dim, device="cuda", generator=generator)
        r = torch.randn(batch, columns, dim, device="cuda", generator=generator)
        times = {True: [], False: []}
        for by_quad in (True, False, True, False):
            triton_dense.MEMBERS_BY_QUAD = by_quad
            times[by_quad].append(median_ms(graphed(lambda: fullgraph.knn(q, r, k, backend="dense"))))
        print(f"B={batch} M={rows} N={columns} D={dim} k={k}:",
              ", ".join(("four threads a member: " if by_quad else "tiles: ") + " / ".join(f"{t:.3f}" for t in ts)
                        for by_quad, ts in times.items()), flush=True)
    triton_dense.MEMBERS_BY_QUAD = default


# Settings of ``settings``: the members re-measured in tiles, then the candidates' tiles. H100
# session 36 run YB (graphed ms, 32 x 1024^2 / 8 x 4096^2 / 16 x 256^2 D=64 k=20, a member a
# thread): defaults 0.273 / 0.484 / 0.053, FUSED_NUM_WARPS 8 0.278 / 0.571 / 0.052,
# FUSED_BLOCK_M 32 0.430 / 1.185 / 0.058.
SETTINGS = ({}, {"MEMBERS_BY_QUAD": False}, {"FUSED_NUM_WARPS": 8}, {})


def settings(generator) -> None:
    """Graphed dense kNN of the first three shapes under each of SETTINGS, the defaults first
    and last."""
    _under_settings(SETTINGS, generator)


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the minima's kernel on tiles of both clouds.
TILE_SETTINGS = {
    "fp16": ((128, 256, 32, 8, 3), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 3),
             (128, 128, 64, 4, 4), (256, 128, 64, 8, 3), (128, 256, 128, 8, 2), (256, 256, 64, 8, 2),
             (64, 256, 64, 4, 4), (128, 128, 128, 8, 2)),
    "tf32": ((128, 256, 32, 8, 3), (128, 128, 32, 8, 3)),
}


def tiles_sweep(generator) -> None:
    """The minima's kernel on tiles of both clouds (D = 128: ``MINIMA_HELD_MAX_DIM`` leaves
    it there) launched directly with each setting of TILE_SETTINGS, ms and TFLOP/s of one
    product a pair, by precision, at 10^4 x 10^6 D=128 (chunks of 64)."""
    rows, columns, dim, chunk = 10000, 1000000, 128, 64
    q = torch.randn(1, rows, dim, device="cuda", generator=generator)
    r = torch.randn(1, columns, dim, device="cuda", generator=generator)
    norms = (r * r).sum(-1)
    out = torch.empty(1, rows, columns // chunk, device="cuda")
    for precision, settings in TILE_SETTINGS.items():
        cells = []
        a, b, twice = _operands(q, r, precision)
        for block_m, block_n, block_k, warps, stages in settings:
            row_blocks, column_blocks = -(-rows // block_m), -(-columns // block_n)

            def launch():
                triton_dense._chunk_minima_kernel[(row_blocks * column_blocks, 1)](
                    a, b, norms, norms if twice is None else twice, norms, out, rows, columns, dim, columns // chunk,
                    row_blocks,
                    CHUNK=chunk, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                    NEEDED=False, num_warps=warps, num_stages=stages)

            name = f"{block_m}x{block_n}x{block_k}/{warps}w/{stages}s"
            try:
                ms = median_ms(launch, 10)
            except Exception as error:  # (out of shared memory)
                cells.append(f"{name} {type(error).__name__}")
                continue
            cells.append(f"{name} {ms:.3f} ({2 * rows * columns * dim / ms / 1e9:.0f})")
        print(f"M={rows} N={columns} D={dim} {precision}:", ", ".join(cells), flush=True)


def wide_smallest(generator) -> None:
    """The selection of the stored minima (rows wider than SORT_MAX): ``_wide_smallest``
    against torch.topk, ms, on the chunk minima of normal and clustered clouds (10^4 x 10^6
    D=128 chunks of 64, 10^4 x 10^5 D=128 chunks of 32, 2 x 10^4 x 2 x 10^5 D=16 chunks of 32)
    and on rows of few distinct values (the gathering overflows), with every row needed, 1 %,
    none."""
    for rows, columns, dim, chunk, count in ((10000, 1000000, 128, 64, 17), (10000, 100000, 128, 32, 17),
                                             (20000, 200000, 16, 32, 17)):
        normal = (torch.randn(1, rows, dim, device="cuda", generator=generator),
                  torch.randn(1, columns, dim, device="cuda", generator=generator))
        for name, (q, r) in (("normal", normal), ("clustered", _clustered(1, rows, columns, dim, generator)),
                             ("ties", (None, None))):
            if q is None:
                values = torch.round(torch.randn(1, rows, -(-columns // chunk), device="cuda", generator=generator))
            else:
                values = triton_dense.chunk_minima(q, r, (r * r).sum(-1), chunk, "tf32x3")
            want = torch.topk(values, count, dim=-1, largest=False, sorted=True)
            got = triton_dense._wide_smallest(values, count, None)
            same = torch.equal(got[0], want[0])
            cells = [f"topk {median_ms(lambda: torch.topk(values, count, dim=-1, largest=False), 20):.3f}"]
            for share in (1.0, 0.01, 0.0):
                needed = torch.rand(1, rows, device="cuda", generator=generator) < share
                cells.append(f"wide needed {share:g} "
                             f"{median_ms(lambda: triton_dense._wide_smallest(values, count, needed), 20):.3f}")
            print(f"M={rows} chunks={values.shape[-1]} count={count} {name} (values equal topk's: {same}):",
                  ", ".join(cells), flush=True)
        torch.cuda.empty_cache()


# (flag, function, help): the modes besides the default table.
MODES = (("sweep", sweep, "the fused kernel's tile settings"),
         ("chunks", chunks, "the fused lists' chunk size and slack"),
         ("operators", operators, "the capture path's operators and shapes"),
         ("keys", fused_keys, "fused chunk lists against stored minima by k"),
         ("brute", brute, "every pair measured against the products' path"),
         ("floor", floor, "the fused lists beside their products alone"),
         ("points", points, "3-D clouds: dense against the grid"),
         ("host", host, "a tiny eager call's host time"),
         ("brute-sweep", brute_sweep, "the brute force's settings"),
         ("precision", precision, "wide clouds: the first products' precision, the minima's kernel"),
         ("fused-precision", fused_precision, "the fused lists' first products: tf32x3 or float16 operands"),
         ("held-sweep", held_sweep, "the stored minima's held tiles"),
         ("tiles-sweep", tiles_sweep, "the minima's tiles of both clouds at 10^6 references, D = 128"),
         ("members-all", members_all, "every member measured exactly or the least by a first measure"),
         ("members-by-quad", members_by_quad, "the members re-measured four threads a member or in tiles"),
         ("settings", settings, "the members' kernels and the candidates' tiles under SETTINGS"),
         ("wide-smallest", wide_smallest, "the stored minima's selection against torch.topk"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="dense and cdist + topk only")
    parser.add_argument("--shapes", nargs="+", metavar="B,M,N,D,k", help="the table's shapes (default: SHAPES)")
    for name, _, text in MODES:
        parser.add_argument(f"--{name}", action="store_true", help=text)
    args = parser.parse_args()
    _count_failed_rows()
    generator = torch.Generator(device="cuda").manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for name, mode, _ in MODES:
        if getattr(args, name.replace("-", "_")):
            return mode(generator)
    shapes = [tuple(int(x) for x in shape.split(",")) for shape in args.shapes] if args.shapes else SHAPES
    for batch, rows, columns, dim, k in shapes:
        q = torch.randn(batch, rows, dim, device="cuda", generator=generator)
        r = torch.randn(batch, columns, dim, device="cuda", generator=generator)
        runs = 10 if rows * columns > 1e8 else 30
        row = {"cdist+topk": median_ms(lambda: torch.topk(torch.cdist(q, r), k, largest=False), runs)}
        for backend in ("dense",) if args.quick else ("dense", "triton", "torch"):
            too_slow = batch * rows * columns * (dim if backend == "torch" else 3) > 3e9
            if backend != "dense" and too_slow:
                continue
            row[backend] = median_ms(lambda: fullgraph.knn(q, r, k, backend=backend), runs)
        FAILED.clear()
        for query, ref in ((q, r), (q + 1000, r + 1000), _clustered(batch, rows, columns, dim, generator)):
            fullgraph.knn(query, ref, k, backend="dense")
        row["failed rows (normal, +1000, clustered)"] = list(FAILED)
        replays = {}
        for name, fn in (("dense graphed", lambda: fullgraph.knn(q, r, k, backend="dense")),
                         ("cdist+topk graphed", lambda: torch.topk(torch.cdist(q, r), k, largest=False))):
            try:
                replays[name] = graphed(fn)
                row[name] = median_ms(replays[name], runs)
            except torch.OutOfMemoryError:
                row[name] = "out of memory"
        cells = (f"{n} {v:.3f} ms" if isinstance(v, float) else f"{n} {v}" for n, v in row.items())
        print(f"B={batch} M={rows} N={columns} D={dim} k={k}: " + ", ".join(cells), flush=True)
        if batch * rows * columns <= 2e8 and "dense graphed" in replays:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                replays["dense graphed"]()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60)
            print(table, flush=True)


if __name__ == "__main__":
    main()
