"""The dense backend's Triton kernels, by role (each module imports Triton at its top; the
backend loads this package on first use):

- ``products``: the products on tensor cores reduced to per-chunk minima or to each query's
  least chunks (``least_chunks``, ``least_chunk_keys``), never an M x N matrix;
- ``members``: the chosen chunks' members measured, re-measured in the reference's
  arithmetic, and the certified lists (``nearest_members``, ``certified_lists``);
- ``every_pair``: small items measured pair by pair (``brute_force``);
- ``clouds``: the frames (``frames``): scales, centres, both clouds centred;
- ``selection``: the least values of each row (``smallest``);
- ``ordering``: packed keys and sorting networks the others share.
"""

from . import clouds, every_pair, members, ordering, products, selection
from .clouds import frames
from .every_pair import brute_force, brute_force_takes
from .members import (certified_lists, measures, member_distances, nearest_members, orders_candidates, ranks_members,
                      squared_distances)
from .products import (chunk_minima, chunk_size, half_operands, half_unit, least_chunk_keys, least_chunks,
                       low_operands, product_error)
from .selection import smallest

__all__ = ["brute_force", "brute_force_takes", "certified_lists", "chunk_minima", "chunk_size", "clouds", "every_pair",
           "frames", "half_operands", "half_unit", "least_chunk_keys", "least_chunks", "low_operands", "measures",
           "member_distances", "members", "nearest_members", "orders_candidates", "ordering", "product_error", "products",
           "ranks_members", "selection", "smallest", "squared_distances"]
