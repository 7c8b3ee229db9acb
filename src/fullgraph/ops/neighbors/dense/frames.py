"""Both clouds of every batch item in the frame the dense backend measures them in: scaled
by the item's power of two, and centred on the mean valid reference for the products."""

from __future__ import annotations

import math

import torch

from ...._triton import lazy
from .. import pairs, reference
from ..cpu import native as select
from ... import scaling

triton_dense = lazy(f"{__package__}.kernels")

# On CPUs the clouds stay uncentred while their mean reference lies within 1 / CENTRED_SHARE of
# the farthest reference from the origin (``Frames._from_norms``).
CENTRED_SHARE = 8


def _squared_norms(x: torch.Tensor) -> torch.Tensor:
    """[B, L]: |x|^2 of each row of x [B, L, D] (the certificate takes any order of the sums). On
    CPUs in C++ where it runs, else a large cloud by a batched product, with no copy of x * x
    (2-core CPU, [200000, 768]: 65 against 409 ms; small clouds the other way, [16384, 64] 0.58
    against 0.38)."""
    if not torch.compiler.is_compiling():
        found = select.squared_norms(x)
        if found is not None:
            return found
    if scaling.large_on_cpu(x):
        return torch.einsum("bnd,bnd->bn", x, x)
    return (x * x).sum(-1)


def _item_largest(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the largest of each item's row values x [B, L] (0 where L = 0), ``like``'s shape."""
    return x.amax(-1, keepdim=True) if x.numel() else torch.zeros_like(like)


class Frames:
    """Both clouds of every item in the item's units (a power of two, ``scale`` [B, 1]): as
    the reference measures them (``q``, ``r``), and centred on the mean valid reference with
    invalid rows zeroed (``qc``, ``rc``, the operands of the products; their squared norms
    ``q_norms``, ``r_norms``, +inf at invalid references; the usual CPU clouds stay uncentred,
    ``_from_norms``). Built by torch here;
    on GPUs by ``triton_dense.frames`` (``Frames.of``: the same scaled clouds, the centre
    summed in another order). Each cloud's valid rows: ``query_ok`` [B, M], ``ref_ok`` [B, N]."""

    def __init__(self, query, ref, query_lengths, ref_lengths, acc):
        if (not query.is_cuda and query_lengths is None and ref_lengths is None and query.dtype == ref.dtype == acc
                and query.shape[-1] and self._from_norms(query, ref)):
            return
        self.query_ok, query_largest = pairs.valid_points_and_largest(query, query_lengths)
        self.ref_ok, ref_largest = pairs.valid_points_and_largest(ref, ref_lengths)
        query_ok, ref_ok = self.query_ok, self.ref_ok
        self.scale = reference.item_scales(query_largest, ref_largest, acc)[..., 0]
        self.largest = torch.maximum(query_largest, ref_largest).to(acc) / self.scale[:, 0]  # [B]
        # Each fresh tensor of a few MiB costs its page faults on CPUs, more than its arithmetic: no
        # copies where every scale is one and every point valid, which a CPU reads for free.
        on_host = not query.is_cuda
        if on_host and bool((self.scale == 1).all()):
            self.q, self.r = query.to(acc), ref.to(acc)  # (x / 1 == x)
        else:
            self.q, self.r = query.to(acc) / self.scale[..., None], ref.to(acc) / self.scale[..., None]
        if on_host and bool(query_ok.all()) and bool(ref_ok.all()):
            centre = self.r.mean(1, keepdim=True)
            self.qc, self.rc = self.q - centre, self.r - centre
        else:
            valid_r = torch.where(ref_ok[..., None], self.r, 0)
            centre = valid_r.sum(1, keepdim=True) / ref_ok.sum(1).clamp(min=1)[:, None, None]
            self.qc = torch.where(query_ok[..., None], self.q - centre, 0)
            self.rc = torch.where(ref_ok[..., None], self.r - centre, 0)
        self.q_norms, r_norms = _squared_norms(self.qc), _squared_norms(self.rc)
        self.reach = r_norms.amax(-1, keepdim=True).sqrt()  # [B, 1]
        # +inf for invalid references (zero rows): their products come out +inf, no mask pass.
        self.r_norms = r_norms.masked_fill(~ref_ok, math.inf)

    def _from_norms(self, query, ref) -> bool:
        """The usual CPU clouds (every point valid, no item scaled, the mean reference near the
        origin for the cloud's spread) framed from their squared norms alone: no |coordinate|
        pass, the clouds themselves the products' operands. False (nothing set) otherwise.

        Finite norms make every coordinate finite, and an item whose largest squared norm lies
        in [D 2^-56, 2^78] has its largest |coordinate| in [2^-30, 2^40], where no scale applies
        (``scaling.safe_scale``; the bounds leave the norms' rounding a margin). Where the mean
        reference is within 1 / CENTRED_SHARE of the farthest reference from the origin, centring
        would narrow the products' error bound by little (``reach``): 2-core CPU, 16 x 256^2
        D=256 k=16, 13.8 -> 10.6 ms a call with the |coordinate| pass, the centred copies and
        their norms left out."""
        q_norms, r_norms = _squared_norms(query), _squared_norms(ref)
        r_top = r_norms.amax(-1)  # [B] (NaN propagates)
        top = torch.maximum(q_norms.amax(-1), r_top)
        centre = ref.mean(1)
        usual = (top <= 2.0**78) & (top >= query.shape[-1] * 2.0**-56)
        usual &= (centre * centre).sum(-1) * CENTRED_SHARE**2 <= r_top
        if not bool(usual.all()):
            return False
        batch, device = query.shape[0], query.device
        self.query_ok = torch.ones(query.shape[:2], dtype=torch.bool, device=device)
        self.ref_ok = torch.ones(ref.shape[:2], dtype=torch.bool, device=device)
        self.scale = torch.ones((batch, 1), dtype=query.dtype, device=device)
        self.q = self.qc = query
        self.r = self.rc = ref
        self.q_norms, self.r_norms = q_norms, r_norms
        self.reach = r_top[:, None].sqrt()
        return True

    def __getattr__(self, name):
        if name == "largest":  # (frames from their norms: what ``halves`` reads, made when read)
            largest = torch.maximum(scaling.magnitude(self.q).amax(-1), scaling.magnitude(self.r).amax(-1))
            self.largest = largest / self.scale[:, 0]
            return self.largest
        raise AttributeError(name)

    @classmethod
    def of(cls, parts: dict) -> Frames:
        """Frames from their fields computed elsewhere (``triton_dense.frames``)."""
        frames = object.__new__(cls)
        frames.__dict__.update(parts)
        return frames

    def halves(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The products' operands in float16 (``triton_dense.half_operands``): ``qc`` and ``rc``
        times the item's power of two ``unit`` [B], the norms of what they left out per query
        [B, M] and the largest per item [B, 1], and 2 / unit^2 [B]."""
        if "qh" not in vars(self):  # (the GPU frames may hold them)
            self.unit = triton_dense.half_unit(self.largest)
            self.qh, self.q_lo = triton_dense.half_operands(self.qc, self.unit)
            self.rh, r_lo = triton_dense.half_operands(self.rc, self.unit)
            self.r_lo = _item_largest(r_lo, self.reach)
            self.twice = 2 / self.unit**2
        return self.qh, self.rh, self.q_lo, self.r_lo, self.twice

    def lows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The "fp16x3" products' low operands (``triton_dense.low_operands``) ``ql`` [B, M, D],
        ``rl`` [B, N, D] (float16), and a bound on |q.r - (qh.rh + qh.rl + ql.rh) / unit^2| in
        ``halves``' form, qx [B, M] and rx [B, 1]: qx R + (|q| + qx) rx (``_products``).

        With q = (qh + ql + q2) / unit and r likewise, what the products leave out is
        ql.rl + (qh + ql).r2 + q2.r over unit^2, at most |ql| max |rl| + (|q| + |q2|) max |r2| +
        |q2| R; the low terms, summed apart over 2 D products of at most |qh| |rl| + |ql| |rh|,
        add 2 D u (|q| max |rl| + |ql| R) and their sum with the main one u |q| R (u = 2^-24).
        So qx = |q2| + (|ql| max |rl| + 2 D u (|q| max |rl| + |ql| R)) / R + u |q| and rx = max
        |r2|, each with a margin of 2^-9 for these sums in float32."""
        if "ql" not in vars(self):
            qh, rh, _, _, _ = self.halves()
            self.ql, q_low, q_rest = triton_dense.low_operands(self.qc, qh, self.unit)
            self.rl, r_low, r_rest = triton_dense.low_operands(self.rc, rh, self.unit)
            u, dim = 2.0**-24, self.qc.shape[-1]
            reach, q_abs = self.reach, self.q_norms.sqrt()  # [B, 1], [B, M]
            share = torch.where(reach > 0, _item_largest(r_low, reach) / reach, 0.0)  # (R = 0: every rl is 0)
            self.qx = (q_rest + q_low * share + 2 * dim * u * (q_abs * share + q_low) + u * q_abs) * (1 + 2.0**-9)
            self.rx = _item_largest(r_rest, reach) * (1 + 2.0**-9)
        return self.ql, self.rl, self.qx, self.rx

    def tf32_references(self) -> torch.Tensor:
        """The references' [high | low | high] [B, N, 3 D] (``tf32_split`` of ``rc``): the right
        operands of the products in "tf32x3" (high; low | high), made once."""
        if "r_tf32" not in vars(self):
            high, low = tf32_split(self.rc)
            self.r_tf32 = torch.cat([high, low, high], -1)
        return self.r_tf32

    def items(self, chosen: slice) -> Frames:
        """The frames of the batch items ``chosen`` (views)."""
        part = object.__new__(Frames)
        part.__dict__.update({name: value[chosen] for name, value in vars(self).items()})
        return part


def tf32_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (float32) as high + low + rest: high its first 11 significant bits (TF32's), low those
    of x - high (exact), so |rest| < 2^-20 |x|. Of two such splits, high x high + high x low +
    low x high is within 3 x 2^-20 of x y (``product_error("tf32x3")`` bounds 2^-18)."""
    high = (x.view(torch.int32) & -(1 << 13)).view(torch.float32)
    return high, ((x - high).view(torch.int32) & -(1 << 13)).view(torch.float32)
