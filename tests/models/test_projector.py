"""The projector models: fullgraph aggregation equals the document's code."""

from __future__ import annotations

import pytest
import torch

from fullgraph.models import KNNProjector, RadiusProjector
from conftest import points


@pytest.mark.parametrize("model_cls, kwargs", [(KNNProjector, {"k": 5}), (RadiusProjector, {"radius": 0.3})])
def test_fullgraph_equals_document(model_cls, kwargs, generator):
    torch.manual_seed(0)
    ours = model_cls(**kwargs, hidden_dim=12, output_dim=2)
    document = model_cls(**kwargs, hidden_dim=12, output_dim=2, aggregation="document")
    document.load_state_dict(ours.state_dict())
    query = points("uniform", 50, 3, generator).float()
    ref = points("uniform", 300, 3, generator).float()
    got, want = ours(query, ref), document(query, ref)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    got.square().sum().backward()
    want.square().sum().backward()
    for a, b in zip(ours.parameters(), document.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_bad_model_arguments():
    with pytest.raises(ValueError, match="aggregation: expected one of"):
        KNNProjector(aggregation="dense")
    with pytest.raises(ValueError, match="k: expected an int >= 1"):
        KNNProjector(k=0)
