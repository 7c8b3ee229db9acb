"""Triton kernels of the "dense" backend on GPUs: the products on tensor cores, reduced to
per-chunk minima so that no M x N matrix is stored.

``chunk_minima``: for every query i and every chunk c of ``chunk`` consecutive references,
``min_{j in c} |r_j|^2 - 2 q_i . r_j`` (one tile of products per program, ``tl.dot`` in
TF32, or three TF32 products that carry float32's significand, "tf32x3"). ``member_distances``:
the squared distances from each query to every reference of the chunks chosen for it,
summed from the differences (no cancellation: within (D + 2) u of the truth, relatively).
``smallest``: the least values of each row with their positions, ties to the smaller position
(a sort of packed (value, position) keys in registers; ``torch.topk`` beyond SORT_MAX columns).
``dense.py`` says why the k nearest lie in the chosen chunks and how that is certified.
"""

from __future__ import annotations

import torch

from ..._triton import tl, triton

# Tiles of chunk_minima: the best of 8 configurations on the H100 (tf32x3; 8 x 4096^2 D=64,
# 10^4 x 10^6 D=128, 2 x 10^4 x 2 x 10^5 D=16: benchmarks/results/h100-torch2.11/dense-tile-sweep.log);
# BLOCK_K 16 for D <= 16 (5.0 against 6.3 ms), else 32.
BLOCK_M, BLOCK_N, NUM_WARPS = 128, 128, 8
BLOCK_MEMBERS = 128
# The widest rows ``smallest`` sorts in registers, and the keys one program sorts.
SORT_MAX, SORT_KEYS = 2048, 4096


def product_error(precision: str) -> float:
    """The largest relative error of one product q_d r_d on the tensor cores in ``precision``,
    before the float32 accumulation: "tf32" rounds (or truncates) each operand to 10 bits,
    2 x 2^-10 + 2^-20; "tf32x3" splits each into two TF32 parts and drops low x low, every
    term below 2^-20, 4 x 2^-20 in all."""
    return {"ieee": 0.0, "tf32x3": 2.0**-18, "tf32": 2.0**-9 + 2.0**-20}[precision]


if triton is not None:

    @triton.jit
    def _chunk_minima_kernel(q_ptr, r_ptr, r_norms_ptr, out_ptr, rows, columns, dim, chunks,
                             CHUNK: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        item = tl.program_id(2).to(tl.int64)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        q_base = q_ptr + item * rows * dim
        r_base = r_ptr + item * columns * dim
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, dim, BLOCK_K):
            d = start + kk
            in_d = d[None, :] < dim
            q = tl.load(q_base + m[:, None] * dim + d[None, :], mask=(m[:, None] < rows) & in_d, other=0.0)
            r = tl.load(r_base + n[:, None].to(tl.int64) * dim + d[None, :], mask=(n[:, None] < columns) & in_d,
                        other=0.0)
            acc += tl.dot(q, tl.trans(r), input_precision=PRECISION)
        norms = tl.load(r_norms_ptr + item * columns + n, mask=n < columns, other=float("inf"))
        approx = norms[None, :] - 2.0 * acc
        minima = tl.min(tl.reshape(approx, (BLOCK_M, BLOCK_N // CHUNK, CHUNK)), axis=2)
        c = tl.program_id(0) * (BLOCK_N // CHUNK) + tl.arange(0, BLOCK_N // CHUNK)
        tl.store(out_ptr + item * rows * chunks + m[:, None] * chunks + c[None, :], minima,
                 mask=(m[:, None] < rows) & (c[None, :] < chunks))

    @triton.jit
    def _member_distances_kernel(q_ptr, r_ptr, r_norms_ptr, chosen_ptr, out_ptr, rows, columns, dim, n_chosen,
                                 CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
        item = tl.program_id(2).to(tl.int64)
        row = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        members = n_chosen * CHUNK
        query = item * rows + row
        chunk = tl.load(chosen_ptr + query * n_chosen + j // CHUNK, mask=j < members, other=0)
        ref = chunk * CHUNK + j % CHUNK
        ok = (j < members) & (ref < columns)
        norms = tl.load(r_norms_ptr + item * columns + ref, mask=ok, other=float("inf"))
        kk = tl.arange(0, BLOCK_K)
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, dim, BLOCK_K):
            d = start + kk
            q = tl.load(q_ptr + query * dim + d, mask=d < dim, other=0.0)
            r = tl.load(r_ptr + (item * columns + ref[:, None]) * dim + d[None, :],
                        mask=ok[:, None] & (d[None, :] < dim), other=0.0)
            diff = q[None, :] - r
            total += tl.sum(diff * diff, axis=1)
        # +inf norms mark invalid references (past a length, or NaN rows)
        total = tl.where(norms == float("inf"), float("inf"), total)
        tl.store(out_ptr + query * members + j, total, mask=j < members)


    @triton.jit
    def _smallest_kernel(values_ptr, out_values_ptr, out_index_ptr, rows, width, count,
                         ROWS: tl.constexpr, WIDTH: tl.constexpr):
        r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        c = tl.arange(0, WIDTH)
        inside = (r[:, None] < rows) & (c[None, :] < width)
        x = tl.load(values_ptr + r[:, None] * width + c[None, :], mask=inside, other=float("inf"))
        # float32 bits -> int32 in the floats' order (negatives: flip the magnitude bits), then
        # (value, position) packed into one int64 so that one sort orders both.
        bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)  # -0.0 ties with 0.0
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        keys = tl.sort((ordered.to(tl.int64) << 32) | c[None, :].to(tl.int64), dim=1)
        top = (keys >> 32).to(tl.int32)
        value = (top ^ ((top >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        keep = (r[:, None] < rows) & (c[None, :] < count)
        tl.store(out_values_ptr + r[:, None] * count + c[None, :], value, mask=keep)
        tl.store(out_index_ptr + r[:, None] * count + c[None, :], keys & 0xFFFFFFFF, mask=keep)


def smallest(values: torch.Tensor, count: int, in_registers: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., W] float32 (no NaN) -> the ``count`` least per row, ascending, and their
    positions (int64), ties to the smaller position: ``torch.topk(largest=False)`` with a
    defined tie order. ``in_registers`` (default: on GPUs up to SORT_MAX columns) sorts in
    Triton; otherwise ``torch.topk`` (wide rows) or a stable sort (CPU tensors, where Triton
    is interpreted and its sort takes seconds)."""
    width = values.shape[-1]
    if in_registers is None:
        in_registers = values.is_cuda and width <= SORT_MAX
    if not in_registers:
        if values.is_cuda:
            return torch.topk(values, count, dim=-1, largest=False, sorted=True)
        found, position = torch.sort(values, dim=-1, stable=True)
        return found[..., :count], position[..., :count]
    rows = values.numel() // max(width, 1)
    out_values = torch.empty((*values.shape[:-1], count), dtype=torch.float32, device=values.device)
    out_index = torch.empty((*values.shape[:-1], count), dtype=torch.int64, device=values.device)
    if rows and count:
        padded = triton.next_power_of_2(width)
        per_program = max(1, SORT_KEYS // padded)
        _smallest_kernel[(triton.cdiv(rows, per_program),)](values.contiguous(), out_values, out_index, rows, width,
                                                            count, ROWS=per_program, WIDTH=padded, num_warps=4)
    return out_values, out_index


def chunk_minima(q: torch.Tensor, r: torch.Tensor, r_norms: torch.Tensor, chunk: int, precision: str) -> torch.Tensor:
    """q [B, M, D], r [B, N, D] (float32, contiguous), r_norms [B, N] (|r|^2, +inf where
    invalid) -> [B, M, ceil(N / chunk)]: per chunk, the least ``r_norms - 2 q.r``."""
    q, r, r_norms = q.contiguous(), r.contiguous(), r_norms.contiguous()
    batch, rows, dim = q.shape
    columns = r.shape[1]
    chunks = triton.cdiv(columns, chunk)
    out = torch.empty((batch, rows, chunks), dtype=torch.float32, device=q.device)
    if out.numel():
        grid = (triton.cdiv(columns, BLOCK_N), triton.cdiv(rows, BLOCK_M), batch)
        block_k = 16 if dim <= 16 else 32
        _chunk_minima_kernel[grid](q, r, r_norms, out, rows, columns, dim, chunks, CHUNK=chunk, PRECISION=precision,
                                   BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=NUM_WARPS,
                                   num_stages=4 if block_k == 16 else 3)
    return out


def member_distances(q: torch.Tensor, r: torch.Tensor, r_norms: torch.Tensor, chosen: torch.Tensor,
                     chunk: int) -> torch.Tensor:
    """q [B, M, D], r [B, N, D] (float32, contiguous), chosen [B, M, C] chunk numbers ->
    [B, M, C * chunk]: squared distances to every reference of the chosen chunks (member
    ``c * chunk + s`` is reference ``chosen[c] * chunk + s``; +inf past N or where r_norms is)."""
    q, r, r_norms = q.contiguous(), r.contiguous(), r_norms.contiguous()
    batch, rows, dim = q.shape
    n_chosen = chosen.shape[-1]
    out = torch.empty((batch, rows, n_chosen * chunk), dtype=torch.float32, device=q.device)
    if out.numel():
        grid = (rows, triton.cdiv(n_chosen * chunk, BLOCK_MEMBERS), batch)
        _member_distances_kernel[grid](q, r, r_norms, chosen.contiguous(), out, rows, r.shape[1], dim, n_chosen,
                                       CHUNK=chunk, BLOCK=BLOCK_MEMBERS, BLOCK_K=32, num_warps=4)
    return out
