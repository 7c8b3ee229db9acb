"""fullgraph.graphs: capture once per signature, replay on new data, clear errors."""

from __future__ import annotations

import pytest
import torch

import fullgraph
from fullgraph.graphs import GraphCaptureError, graphed

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _mlp(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Mish(), torch.nn.Linear(32, 4)).to(device)


def test_cpu_tensors_are_refused_unless_eager_is_asked_for():
    model = _mlp()
    x = torch.randn(5, 8)
    with pytest.raises(ValueError, match="CUDA graphs capture CUDA work, got tensors on cpu"):
        graphed(model)(x)
    torch.testing.assert_close(graphed(model, eager_on_cpu=True)(x), model(x))


@pytest.mark.parametrize("call, error, message", [
    (lambda: graphed(3), TypeError, "fn: expected a callable"),
    (lambda: graphed(abs, max_graphs=0), ValueError, "max_graphs: expected an int >= 1"),
    (lambda: graphed(abs, warmup=0), ValueError, "warmup: expected an int >= 1"),
    (lambda: graphed(lambda n: n)(3), ValueError, "expected at least one CUDA tensor argument"),
])
def test_bad_arguments(call, error, message):
    with pytest.raises(error) as raised:
        call()
    assert message in str(raised.value)


@cuda
def test_replays_on_new_data_and_caches_per_signature():
    model = _mlp("cuda")
    step = graphed(model)
    with torch.no_grad():
        for batch in (5, 5, 5, 7, 5, 7):
            x = torch.randn(batch, 8, device="cuda")
            torch.testing.assert_close(step(x), model(x))
    assert step.captures == 2  # one per shape


@cuda
def test_outputs_are_static_views_unless_cloned():
    double = graphed(lambda x: x * 2)
    first = double(torch.ones(3, device="cuda"))
    double(torch.full((3,), 5.0, device="cuda"))
    assert first.tolist() == [10.0] * 3  # the next replay overwrote it
    cloning = graphed(lambda x: x * 2, clone_outputs=True)
    first = cloning(torch.ones(3, device="cuda"))
    cloning(torch.full((3,), 5.0, device="cuda"))
    assert first.tolist() == [2.0] * 3


@cuda
def test_least_recently_used_signatures_are_dropped():
    step = graphed(lambda x: x + 1, max_graphs=2)
    for n in (1, 2, 3, 1):
        step(torch.zeros(n, device="cuda"))
    assert step.captures == 4 and len(step._graphs) == 2


@cuda
def test_nested_arguments_and_device_scalars():
    def denoise(x, state):
        return {"x": x * state["scale"] + state["t"]}

    step = graphed(denoise)
    for t in range(3):
        out = step(torch.ones(4, device="cuda"), {"scale": torch.tensor(2.0, device="cuda"),
                                                  "t": torch.tensor(float(t), device="cuda")})
        assert out["x"].tolist() == [2.0 + t] * 4
    assert step.captures == 1


@cuda
def test_host_synchronization_is_named():
    def branchy(x):
        return x * 2 if x.sum().item() > 0 else x

    with pytest.raises(GraphCaptureError, match="synchronizes with the host"):
        graphed(branchy)(torch.ones(3, device="cuda"))


@cuda
def test_non_tensor_outputs_are_refused():
    with pytest.raises(GraphCaptureError, match="must return tensors"):
        graphed(lambda x: (x * 2, 3))(torch.ones(3, device="cuda"))


@cuda
def test_fused_ddpm_step_replays_every_timestep():
    from fullgraph.ops import ddpm

    alphas = ddpm.squaredcos_cap_v2(100, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    x, eps, noise = (torch.randn(2, 16, 2, device="cuda", generator=generator) for _ in range(3))
    step = graphed(lambda x, t, eps, noise: fullgraph.ddpm_step(eps, x, t, alphas, noise))
    for t in (99, 50, 1, 0):
        timestep = torch.tensor(t, device="cuda")
        torch.testing.assert_close(step(x, timestep, eps, noise), fullgraph.ddpm_step(eps, x, timestep, alphas, noise))
    assert step.captures == 1


@cuda
def test_a_failed_capture_leaves_the_process_working():
    def branchy(x):
        return torch.randn_like(x) * 0 + x * 2 if x.sum().item() > 0 else x

    with pytest.raises(GraphCaptureError):
        graphed(branchy)(torch.ones(3, device="cuda"))
    assert torch.isfinite(torch.randn(3, device="cuda")).all()
    assert graphed(lambda x: x * 2)(torch.ones(3, device="cuda")).tolist() == [2.0] * 3


@cuda
def test_recover_after_a_failed_capture_of_your_own():
    from fullgraph.graphs import recover

    x = torch.ones(3, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(Exception):
        with torch.cuda.graph(graph):
            y = torch.randn(3, device="cuda") + x
            y.sum().item()  # a host read: the capture is invalidated
    recover()
    assert torch.isfinite(torch.randn(3, device="cuda")).all()
    assert graphed(lambda t: t + 1)(x).tolist() == [2.0] * 3
