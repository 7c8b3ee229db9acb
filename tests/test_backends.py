"""backends.py: how a family picks a backend for "auto" and words a refusal."""

from __future__ import annotations

import pytest
import torch

from conftest import HAVE_TRITON
from fullgraph import backends
from fullgraph.ops.neighbors.registration import BACKENDS

CPU = torch.device("cpu")


def _family(available: bool = True):
    fast = backends.Backend("fast", ops=("knn",), devices=("cpu",), dtypes=(torch.float32,), auto_devices=("cpu",),
                            dims=(3,), max_k=8, install="fastlib: pip install fastlib",
                            available=lambda device: available, note="computes in float32")
    plain = backends.Backend("plain", ops=("knn", "radius"), devices=(backends.ANY_DEVICE,),
                             auto_devices=(backends.ANY_DEVICE,))
    return backends.family("toy", fast, plain)


def test_auto_takes_the_first_that_fits():
    family = _family()
    assert family.resolve("auto", "knn", CPU, torch.float32, 3, 4).name == "fast"
    assert family.resolve("auto", "knn", CPU, torch.float64, 3, 4).name == "plain"  # dtype
    assert family.resolve("auto", "knn", CPU, torch.float32, 4, 4).name == "plain"  # D
    assert family.resolve("auto", "knn", CPU, torch.float32, 3, 9).name == "plain"  # k
    assert family.resolve("auto", "radius", CPU, torch.float32, 3, 4).name == "plain"  # op
    assert family.resolve("auto", "knn", torch.device("meta"), torch.float32, 3, 4).name == "plain"  # device
    assert _family(available=False).resolve("auto", "knn", CPU, torch.float32, 3, 4).name == "plain"


@pytest.mark.parametrize("op, device, dtype, dim, k, error, message", [
    ("radius", "cpu", torch.float32, 3, 1, ValueError, 'backend: "fast" provides knn, not radius'),
    ("knn", "meta", torch.float32, 3, 1, ValueError, 'backend: "fast" needs CPU tensors, got tensors on meta'),
    ("knn", "cpu", torch.float32, 2, 1, ValueError, 'query: backend="fast" needs D = 3, got D = 2'),
    ("knn", "cpu", torch.float64, 3, 1, TypeError, 'query: backend="fast" computes in float32, got torch.float64'),
    ("knn", "cpu", torch.float32, 3, 9, ValueError, 'k: backend="fast" supports up to 8 neighbours, got 9'),
])
def test_explicit_choice_is_refused_with_the_reason(op, device, dtype, dim, k, error, message):
    with pytest.raises(error) as raised:
        _family().resolve("fast", op, torch.device(device), dtype, dim, k)
    assert message in str(raised.value)


def test_a_missing_library_names_what_to_install():
    with pytest.raises(ImportError, match='backend="fast" needs fastlib: pip install fastlib'):
        _family(available=False).resolve("fast", "knn", CPU, torch.float32, 3, 1)


def test_unknown_names_and_types():
    with pytest.raises(ValueError, match=r"backend: expected one of \['auto', 'fast', 'plain'\], got 'gpu'"):
        _family().resolve("gpu", "knn", CPU, torch.float32, 3, 1)
    with pytest.raises(TypeError, match="backend: expected a str"):
        _family().resolve(None, "knn", CPU, torch.float32, 3, 1)
    with pytest.raises(ValueError, match="names must be unique"):
        backends.family("twice", backends.Backend("a", (), ()), backends.Backend("a", (), ()))


def test_neighbour_backends_are_declared_once():
    names = BACKENDS.names
    assert names == ("auto", "dense", "triton", "cpu", "torch", "warp", "cuml")
    for backend in BACKENDS.backends:
        assert backend.implementation is not None and backend.ops
    assert BACKENDS.resolve("auto", "knn", CPU, torch.float32, 3, 4).name == "cpu"
    assert BACKENDS.resolve("auto", "knn", CPU, torch.float64, 3, 4).name == "cpu"
    assert BACKENDS.resolve("auto", "knn", CPU, torch.float32, 16, 4).name == "dense"  # feature space
    assert BACKENDS.resolve("auto", "radius", CPU, torch.float32, 16, 4).name == "cpu"  # dense has no radius
    assert BACKENDS.resolve("auto", "knn", torch.device("meta"), torch.float32, 3, 4).name == "torch"
    if HAVE_TRITON:  # resolving needs no GPU
        cuda = torch.device("cuda")
        assert BACKENDS.resolve("auto", "knn", cuda, torch.float32, 3, 4).name == "triton"
        assert BACKENDS.resolve("auto", "knn", cuda, torch.float32, 4, 4).name == "dense"  # tensor cores from D = 4
        assert BACKENDS.resolve("auto", "knn", cuda, torch.float32, 64, 4).name == "dense"
        assert BACKENDS.resolve("auto", "knn", cuda, torch.float64, 64, 4).name == "torch"  # dense would sync
        assert BACKENDS.resolve("auto", "knn", cuda, torch.float32, 16, 256).name == "dense"  # beyond Triton's k
        # Inside a capture too, up to dense.CAPTURE_MAX_K (the op resolves "auto" when it runs).
        assert BACKENDS.resolve("auto", "knn", cuda, torch.float32, 16, 1024).name == "dense"
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.cuda, "is_available", lambda: True)
            patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
            assert BACKENDS.resolve("auto", "knn", cuda, torch.float32, 16, 1024).name == "dense"
            assert BACKENDS.resolve("auto", "knn", cuda, torch.float32, 16, 1025).name == "torch"
            assert BACKENDS.resolve("auto", "knn", cuda, torch.float64, 16, 256).name == "torch"


def test_a_size_rule_on_sizes_export_keeps_dynamic_adds_no_guard():
    """"auto" under torch.export with a dynamic size: a backend whose rule depends on that
    size is taken only where the rule holds for every size, so the export keeps the size
    dynamic (a guard would raise a constraint violation) and takes the backend after it."""
    rules = backends.family(
        "example",
        backends.Backend("few", ops=("op",), devices=(backends.ANY_DEVICE,), auto_devices=(backends.ANY_DEVICE,),
                         auto_when=lambda device_type, dtype, dim, k, size=None: size <= 100),
        backends.Backend("any", ops=("op",), devices=(backends.ANY_DEVICE,), auto_devices=(backends.ANY_DEVICE,)),
    )

    class Choose(torch.nn.Module):
        def forward(self, x):
            chosen = rules.resolve("auto", "op", x.device, x.dtype, size=x.shape[0])
            return x * 2 if chosen.name == "few" else x * 3

    x = torch.rand(50)
    assert Choose()(x).equal(x * 2)  # eagerly the rule decides
    program = torch.export.export(Choose(), (x,), dynamic_shapes=({0: torch.export.Dim("n", min=2)},))
    assert program.module()(torch.rand(500)).shape == (500,)
    assert program.module()(x).equal(x * 3)
    bounded = torch.export.export(Choose(), (x,), dynamic_shapes=({0: torch.export.Dim("n", min=2, max=100)},))
    assert bounded.module()(x).equal(x * 2)  # (the rule holds for every size allowed)
