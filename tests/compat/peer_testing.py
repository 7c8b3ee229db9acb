"""What the ported peer suites import from their own packages' testing helpers: the dtypes
and devices they run over, the tensor constructor, PyTorch3D's ``assertClose`` mixin and
the references its tests compare against (written here; the peers' helpers are not
installed)."""

from typing import Any

import torch

dtypes = [torch.half, torch.bfloat16, torch.float, torch.double, torch.int, torch.long]
grad_dtypes = [torch.half, torch.float, torch.double]
floating_dtypes = grad_dtypes + [torch.bfloat16]

devices = [torch.device("cpu")] + ([torch.device("cuda:0")] if torch.cuda.is_available() else [])


def tensor(x: Any, dtype: torch.dtype, device: torch.device):
    return None if x is None else torch.tensor(x, dtype=dtype, device=device)
