"""PyG batch vectors: flat clouds [N, D] whose items are marked by a sorted int64 vector.

torch_cluster and PyTorch Geometric concatenate a batch's clouds and mark each point's item
with ``batch`` [N] (sorted, 0-based). The neighbour operators work on padded [B, L, D]
tensors with lengths; ``Padded`` converts one way (a scatter into the padded layout) and
back (a gather), without copies of the features beyond that.

The padded shape depends on the data (B = the number of items, L = the largest item), so
the conversion reads those two numbers back to the host once: calls with batch vectors
synchronize and cannot be captured in a CUDA graph. Padded tensors with lengths (the
operators' own form) never do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import _validate


def check_batch(name: str, batch, points: torch.Tensor) -> torch.Tensor:
    """A sorted, non-negative int64 vector [N] on the device of ``points`` [N, D]."""
    _validate.tensor(name, batch)
    if batch.dtype != torch.int64:
        raise TypeError(f"{name}: expected an int64 batch vector, got {batch.dtype}")
    if batch.dim() != 1 or batch.shape[0] != points.shape[0]:
        raise ValueError(f"{name}: expected shape ({points.shape[0]},), one item id per point, "
                         f"got {tuple(batch.shape)}")
    if batch.device != points.device:
        raise ValueError(f"{name}: expected a tensor on {points.device}, got {batch.device}")
    if batch.numel() and _validate.values_readable(batch.device):
        low, high, unsorted = _validate.read(*torch.aminmax(batch), (batch[1:] < batch[:-1]).any())
        if low < 0:
            raise ValueError(f"{name}: expected item ids >= 0, got {low}")
        # Every id up to the largest is an item (empty ones too): the padded layout holds them all.
        most = 2 * batch.shape[0] + 1024
        if high >= most:
            raise ValueError(f"{name}: expected item ids below 2 N + 1024 = {most} for N = {batch.shape[0]} points "
                             f"(each id up to the largest is an item), got {high}")
        if unsorted:
            raise ValueError(f"{name}: expected a sorted batch vector (torch_cluster's convention: items "
                             "concatenated in order), got an unsorted one")
    return batch


@dataclass(frozen=True)
class Padded:
    """Where each point of a flat cloud sits in the padded layout [B, L]."""

    items: int  # B
    width: int  # L
    lengths: torch.Tensor  # [B] int64
    starts: torch.Tensor  # [B] int64, the first flat row of each item
    slots: torch.Tensor  # [N] int64, the flat padded position b * L + j of each point

    @classmethod
    def of(cls, batch: torch.Tensor | None, count: int, device, items: int | None = None) -> Padded:
        """The layout of ``count`` points marked by ``batch`` (None: one item); ``items``
        forces B (so that query and reference batches line up)."""
        if batch is None:
            batch = torch.zeros(count, dtype=torch.int64, device=device)
        found = int(batch.max()) + 1 if count else 0
        items = found if items is None else max(items, found)
        lengths = torch.bincount(batch, minlength=items)
        width = int(lengths.max()) if items else 0
        starts = torch.cumsum(lengths, 0) - lengths
        slots = batch * width + (torch.arange(count, device=device) - starts[batch])
        return cls(items, width, lengths, starts, slots)

    def pad(self, values: torch.Tensor) -> torch.Tensor:
        """[N, C] -> [B, L, C] (zeros in the padding)."""
        out = values.new_zeros((self.items * self.width, values.shape[-1]))
        out[self.slots] = values
        return out.reshape(self.items, self.width, values.shape[-1])

    def unpad(self, values: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] -> [N, ...]: the rows of the real points."""
        return values.reshape(self.items * self.width, *values.shape[2:])[self.slots]

    def global_index(self, local: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        """Indices within items (-1 kept) -> rows of the flat cloud, for points of items ``item``."""
        return torch.where(local >= 0, local + self.starts[item].reshape(-1, *(1,) * (local.dim() - 1)), -1)
