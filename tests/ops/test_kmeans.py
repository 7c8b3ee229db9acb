"""k-means written in NumPy and compiled: against NumPy and scikit-learn."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import DEVICES

import fullgraph


def _blobs(n_per: int, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[0.0, 0.0], [6.0, 1.0], [2.0, 8.0]], dtype=dtype)
    return torch.cat([torch.randn(n_per, 2, generator=generator, dtype=dtype) + c for c in centres])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_assign_is_the_document_step(device, dtype):
    x, means = _blobs(500, dtype), torch.tensor([[5.0, 5.0], [0.0, 1.0], [2.0, 7.0]], dtype=dtype)
    x[:3] = means[:3] + 0.5  # equidistant from nothing in particular; plus exact duplicates of a mean
    x[3] = means[1]
    want = np.argmin(np.linalg.norm(x.numpy() - means.numpy()[:, None], axis=2), axis=0)
    labels = fullgraph.kmeans_assign(x.to(device), means.to(device))
    assert labels.dtype == torch.int64 and labels.device.type == device
    np.testing.assert_array_equal(labels.cpu().numpy(), want)


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True])
def test_assign_inside_a_compiled_graph(dynamic):
    x, centroids = torch.rand(50, 3), torch.rand(4, 3)
    compiled = torch.compile(lambda x: fullgraph.kmeans_assign(x, centroids), fullgraph=True, dynamic=dynamic)
    assert torch.equal(compiled(x), fullgraph.kmeans_assign(x, centroids))


@pytest.mark.parametrize("device", DEVICES)
def test_kmeans_matches_scikit_learn_from_the_same_init(device):
    sklearn = pytest.importorskip("sklearn.cluster")
    x = _blobs(1000)
    init = x[torch.tensor([0, 1, 2])].clone()  # all from one blob: several iterations to converge
    result = fullgraph.kmeans(x.to(device), 3, init=init.to(device))
    want = sklearn.KMeans(3, init=init.numpy(), n_init=1, algorithm="lloyd", max_iter=100, tol=1e-4).fit(x.numpy())
    assert result.n_iter == want.n_iter_ > 2
    np.testing.assert_array_equal(result.labels.cpu().numpy(), want.labels_)
    np.testing.assert_allclose(result.centroids.cpu().numpy(), want.cluster_centers_, rtol=1e-10)
    np.testing.assert_allclose(float(result.inertia), want.inertia_, rtol=1e-10)


def test_empty_clusters_are_reseeded_deterministically():
    x = _blobs(200)
    init = torch.tensor([[0.0, 0.0], [6.0, 1.0], [100.0, 100.0]], dtype=torch.float64)  # the last owns no point
    first, second = fullgraph.kmeans(x, 3, init=init), fullgraph.kmeans(x, 3, init=init)
    assert torch.equal(first.centroids, second.centroids) and torch.equal(first.labels, second.labels)
    assert first.labels.bincount(minlength=3).min() > 0


def test_kmeans_plus_plus_finds_separated_blobs():
    x = _blobs(300, torch.float32)
    result = fullgraph.kmeans(x, 3, seed=0)
    from_truth = fullgraph.kmeans(x, 3, init=torch.tensor([[0.0, 0.0], [6.0, 1.0], [2.0, 8.0]]))
    assert float(result.inertia) <= 1.001 * float(from_truth.inertia)
    assert torch.equal(fullgraph.kmeans(x, 3, seed=0).centroids, result.centroids)


@pytest.mark.parametrize("call, message", [
    (lambda x: fullgraph.kmeans(x, 0), "n_clusters: expected an int in"),
    (lambda x: fullgraph.kmeans(x, 10_000), "n_clusters: expected an int in"),
    (lambda x: fullgraph.kmeans(x, 3, init=torch.zeros(2, 2, dtype=x.dtype)), r"init: expected \[3, 2\]"),
    (lambda x: fullgraph.kmeans(x, 3, init="random"), "init: expected"),
    (lambda x: fullgraph.kmeans(x, 3, tol=-1.0), "tol: expected a finite number"),
    (lambda x: fullgraph.kmeans(x, 3, max_iter=0), "max_iter: expected an int"),
    (lambda x: fullgraph.kmeans(x.long(), 3), "x: expected a floating-point tensor"),
    (lambda x: fullgraph.kmeans_assign(x, torch.zeros(3, 5, dtype=x.dtype)), r"centroids: expected \[k >= 1, 2\]"),
    (lambda x: fullgraph.kmeans(x[:, :0], 3), r"x: expected at least one coordinate \(d >= 1\)"),
    (lambda x: fullgraph.kmeans(x.bfloat16(), 3), "x: expected float32 or float64 points"),
    (lambda x: fullgraph.kmeans_assign(x.bfloat16(), x[:3].bfloat16()), "x: expected float32 or float64 points"),
    (lambda x: fullgraph.kmeans(x, 3, seed="abc"), "seed: expected an int or None, got str 'abc'"),
    (lambda x: fullgraph.kmeans(x, 3, max_iter=True), "max_iter: expected an int >= 1, got True"),
    (lambda x: fullgraph.KMeans(3, max_iter=True).fit(x), "max_iter: expected an int >= 1, got True"),
])
def test_bad_input(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call(_blobs(10))


@pytest.mark.parametrize("backend", ["fullgraph", "sklearn"])
def test_sample_weight_as_scikit_learn_weighs(backend):
    from sklearn.cluster import KMeans as SKLearnKMeans

    x = _blobs(100, torch.float64).numpy()
    weights = np.random.default_rng(0).uniform(0.1, 5.0, len(x))
    init = x[[0, 150, 250]]
    ours = fullgraph.KMeans(3, init=init, max_iter=50, backend=backend).fit(x, sample_weight=weights)
    theirs = SKLearnKMeans(3, init=init, n_init=1, max_iter=50).fit(x, sample_weight=weights)
    np.testing.assert_array_equal(ours.labels_, theirs.labels_)
    np.testing.assert_allclose(ours.cluster_centers_, theirs.cluster_centers_, rtol=1e-10)
    assert ours.inertia_ == pytest.approx(theirs.inertia_, rel=1e-10) and ours.n_iter_ == theirs.n_iter_


def test_integer_weights_count_points_again():
    x = _blobs(60, torch.float64)
    counts = torch.randint(0, 4, (len(x),), generator=torch.Generator().manual_seed(1))
    init = x[[0, 70, 130]]
    weighted = fullgraph.kmeans(x, 3, init=init, sample_weight=counts)
    repeated = fullgraph.kmeans(x.repeat_interleave(counts, 0), 3, init=init)
    torch.testing.assert_close(weighted.centroids, repeated.centroids)
    torch.testing.assert_close(weighted.inertia, repeated.inertia)
    with pytest.raises(ValueError, match="sample_weight: expected finite weights >= 0, not all zero"):
        fullgraph.kmeans(x, 3, sample_weight=-torch.ones(len(x)))
    with pytest.raises(ValueError, match=r"sample_weight: expected \[n\] = \[180\]"):
        fullgraph.kmeans(x, 3, sample_weight=torch.ones(5))


def test_the_estimator_takes_what_scikit_learn_takes():
    """Integer arrays (converted to float64) and NumPy integers for n_clusters."""
    x = np.concatenate([np.zeros((20, 2), dtype=np.int64), np.full((20, 2), 9, dtype=np.int64)])
    model = fullgraph.KMeans(np.int64(2), random_state=0, backend="fullgraph").fit(x)
    assert sorted(np.bincount(model.labels_).tolist()) == [20, 20]
    assert model.cluster_centers_.dtype == np.float64
    assert fullgraph.kmeans(torch.from_numpy(x).double(), np.int32(2), seed=0).centroids.shape == (2, 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_points_are_refused(bad):
    x = _blobs(50, torch.float32)
    x[7, 1] = bad
    with pytest.raises(ValueError, match=r"x: expected finite values .* got 1 non-finite"):
        fullgraph.kmeans(x, 3, seed=0)
    with pytest.raises(ValueError, match=r"x: expected finite values"):
        fullgraph.kmeans_assign(x, x[:3].nan_to_num())
    with pytest.raises(ValueError, match=r"init: expected finite values"):
        fullgraph.kmeans(_blobs(50, torch.float32), 3, init=x[5:8])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1e20, 1e-25, 1e36])
def test_any_finite_scale_clusters_like_unit_scale(device, scale):
    """float32 squared distances overflow beyond ~1.8e19 and underflow below ~1e-19; the
    data is divided by a power of two first, so the result is the unit-scale one, scaled."""
    x = _blobs(100, torch.float32).to(device)
    unit = fullgraph.kmeans(x, 3, seed=0)
    scaled = fullgraph.kmeans(x * scale, 3, seed=0)
    assert torch.equal(scaled.labels, unit.labels)
    torch.testing.assert_close(scaled.centroids / scale, unit.centroids, rtol=1e-5, atol=1e-6)
    assert torch.equal(fullgraph.kmeans_assign(x * scale, scaled.centroids), unit.labels)


@pytest.mark.parametrize("backend", ["fullgraph", "sklearn", "auto"])
def test_scikit_learn_estimator_interface(backend):
    from sklearn.cluster import KMeans as SKLearnKMeans

    x = _blobs(200, torch.float64).numpy()
    init = x[[0, 250, 500]]
    ours = fullgraph.KMeans(n_clusters=3, init=init, max_iter=50, backend=backend).fit(x)
    assert ours.backend_ == ("sklearn" if backend == "auto" else backend)  # auto: scikit-learn on CPUs
    assert ours.labels_.dtype == np.int32  # scikit-learn's
    theirs = SKLearnKMeans(n_clusters=3, init=init, n_init=1, max_iter=50).fit(x)
    assert isinstance(ours.cluster_centers_, np.ndarray) and isinstance(ours.labels_, np.ndarray)
    np.testing.assert_array_equal(ours.labels_, theirs.labels_)
    np.testing.assert_allclose(ours.cluster_centers_, theirs.cluster_centers_, rtol=1e-10)
    assert ours.inertia_ == pytest.approx(theirs.inertia_, rel=1e-10) and ours.n_iter_ == theirs.n_iter_
    np.testing.assert_array_equal(ours.predict(x[:40]), theirs.predict(x[:40]))
    restarts = fullgraph.KMeans(n_clusters=3, n_init=4, random_state=0)
    assert restarts.fit_predict(torch.from_numpy(x)).shape == (600,)
    assert isinstance(restarts.labels_, torch.Tensor)
    with pytest.raises(ValueError, match="not fitted yet"):
        fullgraph.KMeans(3).predict(x)
    assert fullgraph.KMeans(2, backend="fullgraph").fit([[0.0, 1.0], [5.0, 5.0]] * 10).labels_.shape == (20,)
    # scikit-learn's check_array words it where scikit-learn is installed, as its KMeans does
    with pytest.raises((TypeError, ValueError), match="X: expected an array of numbers|could not convert string"):
        fullgraph.KMeans(3).fit([["a", "b"]] * 10)


def test_estimator_backends_refuse_alike():
    x = _blobs(20, torch.float32)
    x[5, 1] = math.nan
    for backend in ("fullgraph", "sklearn"):
        with pytest.raises(ValueError, match="x: expected finite values"):
            fullgraph.KMeans(3, backend=backend).fit(x)
        with pytest.raises(ValueError, match=r"n_clusters: expected an int in \[1, 60\]"):
            fullgraph.KMeans(61, backend=backend).fit(x)
    with pytest.raises(ValueError, match=r'backend: "sklearn" clusters data on the CPU, got X on meta'):
        fullgraph.KMeans(3, backend="sklearn").fit(torch.empty(10, 2, device="meta"))
    with pytest.raises(ValueError, match=r"backend: expected one of \('auto', 'fullgraph', 'sklearn'\), got 'cuml'"):
        fullgraph.KMeans(3, backend="cuml").fit(x)


def test_huge_coordinates_cluster_through_either_backend():
    x = _blobs(30, torch.float64) * 1e200
    for backend in ("fullgraph", "sklearn"):
        model = fullgraph.KMeans(3, random_state=0, backend=backend).fit(x)
        assert sorted(np.bincount(model.labels_.numpy()).tolist()) == [30, 30, 30]
        assert torch.isfinite(model.cluster_centers_).all()


# scikit-learn's own KMeans fails this check too (it lists it as expected): k-means++ draws
# differ between weighted and repeated points.
_EXPECTED_FAILURES = {
    "check_sample_weight_equivalence_on_dense_data": "sample_weight is not equivalent to removing/repeating samples.",
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fullgraph", "sklearn"])
def test_passes_scikit_learn_check_estimator(backend):
    from sklearn.utils.estimator_checks import check_estimator

    results = check_estimator(fullgraph.KMeans(backend=backend), expected_failed_checks=_EXPECTED_FAILURES,
                              on_fail=None)
    failed = [(r["check_name"], str(r["exception"])[:200]) for r in results if r["status"] == "failed"]
    assert len(results) > 40 and not failed


def test_clones_and_runs_in_a_pipeline_as_scikit_learn_estimators_do():
    from sklearn.base import clone
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    model = fullgraph.KMeans(n_clusters=np.int64(3), n_init="auto", random_state=0)
    copy = clone(model).set_params(max_iter=50)
    assert copy.get_params()["max_iter"] == 50 and model.max_iter == 300
    x = _blobs(30, torch.float64).numpy()
    pipeline = make_pipeline(StandardScaler(), copy).fit(x)
    assert pipeline.predict(x).dtype == np.int32 and pipeline.transform(x).shape == (90, 3)
    assert pipeline.score(x) == pytest.approx(-copy.inertia_)
    assert copy.fit(x.astype(np.int64)).labels_.shape == (90,)  # int arrays, as scikit-learn accepts
