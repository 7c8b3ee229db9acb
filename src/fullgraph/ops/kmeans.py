"""k-means written in NumPy and compiled through ``fullgraph.numpy`` (the NumPy-compilation tutorial).

The assignment step is the tutorial's NumPy code; a Lloyd iteration adds the centroid
update. Both run where the data is (CPU or CUDA) without copies. The loop follows
scikit-learn's Lloyd iteration (same stopping rule, same relabelling at the end), so a run
from the same initial centroids gives the same result; it reads three flags back per
iteration in one transfer (labels unchanged, an empty cluster, shift below tol).
"""

from __future__ import annotations

import importlib.util
import math
import numbers
from typing import NamedTuple

import numpy as np
import torch

from .. import _contract, _validate
from ..numpy import jit
from .scaling import safe_scale


def _nearest(x, centroids):
    """[n] index of each point's nearest centroid (ties to the lower index). ``diff * diff``,
    not ``** 2``: the compiler makes a power a general pow, twice as slow on a GPU."""
    diff = x - centroids[:, None]  # [k, n, d]
    return np.argmin((diff * diff).sum(2), axis=0)


def _cluster_totals(x, labels, clusters, weights):
    """Per cluster, the float64 weighted sum of its points [..., k, d] and their total weight
    [..., k], for points [..., n, d] with labels [..., n] and weights [..., n] (float64)."""
    member = labels[..., None] == clusters  # [..., n, k]
    weighted = x.astype(np.float64) * weights[..., None]
    sums = np.where(member[..., None], weighted[..., None, :], 0.0).sum(-3)
    return sums, np.where(member, weights[..., None], 0.0).sum(-2)


@jit(dynamic=False)
def _assign(x, centroids):
    return _nearest(x, centroids)


@jit(dynamic=False)
def _lloyd_step(x, centroids, clusters, blocks, weights):
    """(labels [n], new centroids [k, d] float64, weight per cluster [k] float64) after one
    assignment and update (weighted means: ``weights`` [n] float64); ``clusters`` is arange(k)
    on x's device. Rows are summed in
    ``blocks`` contiguous blocks, then the blocks: on a GPU a reduction of millions of rows
    into a few outputs otherwise runs on as few programs as outputs (256 there; 1 on CPUs).
    An empty cluster keeps its centroid (the caller re-seeds it)."""
    n, d = x.shape
    labels = _nearest(x, centroids)
    rows = n // blocks * blocks
    body_sums, body_counts = _cluster_totals(x[:rows].reshape(blocks, -1, d), labels[:rows].reshape(blocks, -1),
                                             clusters, weights[:rows].reshape(blocks, -1))
    tail_sums, tail_counts = _cluster_totals(x[rows:], labels[rows:], clusters, weights[rows:])
    sums, counts = body_sums.sum(0) + tail_sums, body_counts.sum(0) + tail_counts
    means = sums / np.where(counts > 0, counts, 1.0)[:, None]
    return labels, np.where(counts[:, None] > 0, means, centroids), counts


def lloyd_step(x: torch.Tensor, centroids: torch.Tensor, weights: torch.Tensor | None = None):
    """One Lloyd iteration on tensors: (labels [n], new centroids [k, d] in x's dtype, the
    weight of each cluster [k] float64: its point count without ``weights`` [n])."""
    clusters = torch.arange(centroids.shape[0], device=x.device)
    if weights is None:
        weights = torch.ones(x.shape[0], dtype=torch.float64, device=x.device)
    labels, new, counts = _lloyd_step(x, centroids, clusters, 256 if x.is_cuda else 1, weights)
    return labels, new.to(x.dtype), counts


def lloyd_step_numpy(x: np.ndarray, centroids: np.ndarray):
    """The same iteration run by NumPy itself on arrays (what the compiled one is measured against)."""
    return _lloyd_step.fn(x, centroids, np.arange(len(centroids)), 1, np.ones(len(x)))


class KMeansResult(NamedTuple):
    centroids: torch.Tensor  # [k, d]
    labels: torch.Tensor  # [n] int64
    inertia: torch.Tensor  # [] sum of squared distances to the assigned centroids
    n_iter: int


def _points(x: torch.Tensor) -> None:
    _validate.floating("x", x)
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"x: expected float32 or float64 points (k-means computes in their dtype), got {x.dtype}")
    _validate.rank("x", x, (2,), "[n, d]")
    if x.shape[1] < 1:
        raise ValueError(f"x: expected at least one coordinate (d >= 1), got shape {tuple(x.shape)}")


def _scale(name: str, *tensors: torch.Tensor) -> float:
    """Refuse non-finite values (k-means has no meaning for them, as in scikit-learn) and
    return the power of two to divide the data by so that squared distances neither overflow
    nor underflow (1 in the usual range; exact). One reduction and one read back; skipped
    (1.0) where values cannot be read: while compiling or capturing a CUDA graph."""
    if not _validate.values_readable(tensors[0].device) or not all(t.numel() for t in tensors):
        return 1.0
    largest = torch.stack([t.abs().amax() for t in tensors]).amax()  # NaN and inf propagate
    if not torch.isfinite(largest):
        bad, values = next((n, t) for n, t in zip(name.split(", "), tensors) if not torch.isfinite(t).all())
        raise ValueError(f"{bad}: expected finite values (k-means has no meaning for NaN or inf: drop or impute "
                         f"those points), got {int((~torch.isfinite(values)).sum())} non-finite")
    return float(safe_scale(largest))


def _check_assign(x, centroids) -> None:
    _points(x)
    _validate.tensor("centroids", centroids)
    _validate.rank("centroids", centroids, (2,), "[k, d]")
    _validate.same_dtype_and_device("centroids", centroids, "x", x)
    if centroids.shape[1] != x.shape[1] or centroids.shape[0] < 1:
        raise ValueError(f"centroids: expected [k >= 1, {x.shape[1]}] like x [n, d], got {tuple(centroids.shape)}")


@_contract.checked(_check_assign)
def kmeans_assign(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """The nearest centroid of every point (the tutorial's k-means step).

    Args:
        x: [n, d] float32/float64 points, any device. centroids: [k, d], same dtype and device.

    Returns:
        labels: [n] int64, argmin_j |x_i - c_j|^2 (ties to the lower j).

    Example:
        >>> import torch, fullgraph
        >>> points, centroids = torch.tensor([[0.0, 0.0], [9.0, 9.0]]), torch.tensor([[10.0, 10.0], [1.0, 1.0]])
        >>> fullgraph.kmeans_assign(points, centroids).tolist()
        [1, 0]
    """
    scale = _scale("x, centroids", x, centroids)
    if scale != 1.0:
        x, centroids = x / scale, centroids / scale
    return _assign(x.contiguous(), centroids.contiguous())


def _squared_distances(x: torch.Tensor, x_norms: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """[m, n] squared distances from points [m, d] to x [n, d] as one matrix product
    (|p|^2 + |x|^2 - 2 p.x, clamped at 0), as scikit-learn's k-means++ computes them: seeding
    only needs them approximately, and a product is ~10x faster than broadcasting [m, n, d]."""
    return torch.addmm((points * points).sum(-1)[:, None] + x_norms[None], points, x.T, alpha=-2).clamp_min_(0)


def _kmeans_plus_plus(x: torch.Tensor, k: int, generator: torch.Generator,
                      sample_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy k-means++ (2 + log k candidates per step, the one lowering the potential most);
    with ``sample_weight`` [n], draws and potentials weighted as scikit-learn weighs them."""
    n = x.shape[0]
    trials = 2 + int(math.log(k))
    x_norms = (x * x).sum(-1)
    if sample_weight is None:
        first = torch.randint(n, (1,), generator=generator, device=x.device)
    else:
        first = torch.multinomial(sample_weight, 1, generator=generator)
    centroids = [x[first]]
    closest = _squared_distances(x, x_norms, x[first])[0]
    scale = 1 if sample_weight is None else sample_weight.to(x.dtype)
    for _ in range(1, k):
        weights = torch.where((closest * scale).sum() > 0, closest * scale, torch.ones_like(closest) * scale)
        candidates = torch.multinomial(weights, trials, replacement=True, generator=generator)
        d2 = _squared_distances(x, x_norms, x[candidates])  # [trials, n]
        potentials = torch.minimum(closest[None], d2)
        best = (potentials * scale).sum(-1).argmin()
        centroids.append(x[candidates[best]][None])
        closest = potentials[best]
    return torch.cat(centroids)


def kmeans(x: torch.Tensor, n_clusters: int, *, init="k-means++", max_iter: int = 100, tol: float = 1e-4,
           seed: int | None = None, sample_weight: torch.Tensor | None = None) -> KMeansResult:
    """Lloyd's k-means on any device, its steps written in NumPy and compiled.

    Args:
        x: [n, d] float32/float64 points. n_clusters: k, 1 <= k <= n.
        init: "k-means++" (greedy, seeded by ``seed``) or a [k, d] tensor of initial centroids.
        max_iter: the most Lloyd iterations. tol: stop once the centroids move less than
            tol * mean(var(x, axis=0)) in total squared distance (scikit-learn's rule), or
            when the labels no longer change.
        seed: seeds the k-means++ draw (None: a random seed).
        sample_weight: [n] weights >= 0 of the points (None: 1 each), as scikit-learn's:
            weighted means, k-means++ draws and inertia.

    Returns:
        KMeansResult(centroids [k, d], labels [n] int64, inertia [] tensor, n_iter).
        Empty clusters are re-seeded at the points farthest from their centroids.

    Example:
        >>> import torch, fullgraph
        >>> x = torch.cat([torch.randn(50, 2), torch.randn(50, 2) + 10])
        >>> result = fullgraph.kmeans(x, 2, seed=0)
        >>> sorted(result.labels.bincount().tolist())
        [50, 50]
    """
    x, init, scale = _checked(x, n_clusters, init, max_iter, tol, seed)
    weights = _weights(sample_weight, x)
    return _rescaled(_lloyd(x, int(n_clusters), init, int(max_iter), float(tol), seed, weights), scale)


def _weights(sample_weight, x: torch.Tensor) -> torch.Tensor | None:
    """sample_weight checked, as float64 on x's device (None stays None)."""
    if sample_weight is None:
        return None
    if isinstance(sample_weight, np.ndarray):
        sample_weight = torch.from_numpy(sample_weight)
    _validate.tensor("sample_weight", sample_weight)
    if tuple(sample_weight.shape) != (x.shape[0],):
        raise ValueError(f"sample_weight: expected [n] = [{x.shape[0]}] (one weight per point), got "
                         f"{tuple(sample_weight.shape)}")
    if sample_weight.dtype == torch.bool or sample_weight.is_complex():
        raise TypeError(f"sample_weight: expected real weights, got {sample_weight.dtype}")
    weights = sample_weight.to(x.device, torch.float64)
    if _validate.values_readable(x.device) and not bool((torch.isfinite(weights) & (weights >= 0)).all()
                                                         & (weights.sum() > 0)):
        raise ValueError("sample_weight: expected finite weights >= 0, not all zero")
    return weights


def _checked(x, n_clusters, init, max_iter, tol, seed=None):
    """(x, init, scale): the arguments checked, x and a tensor init made contiguous and
    divided by ``scale``, the power of two of ``_scale``."""
    _points(x)
    n = x.shape[0]
    if isinstance(n_clusters, bool) or not isinstance(n_clusters, numbers.Integral) or not 1 <= n_clusters <= n:
        raise ValueError(f"n_clusters: expected an int in [1, {n}] (at most the number of points), got {n_clusters!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, numbers.Integral) or max_iter < 1:
        raise ValueError(f"max_iter: expected an int >= 1, got {max_iter!r}")
    if isinstance(tol, bool) or not (isinstance(tol, numbers.Real) and math.isfinite(tol) and tol >= 0):
        raise ValueError(f"tol: expected a finite number >= 0, got {tol!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise TypeError(f"seed: expected an int or None, got {_validate._describe(seed)}")
    if isinstance(init, str) and init != "k-means++":
        raise ValueError(f"init: expected 'k-means++' or a [{n_clusters}, {x.shape[1]}] tensor, got {init!r}")
    x = x.contiguous()
    if isinstance(init, torch.Tensor):
        _validate.same_dtype_and_device("init", init, "x", x)
        if tuple(init.shape) != (n_clusters, x.shape[1]):
            raise ValueError(f"init: expected [{n_clusters}, {x.shape[1]}] (n_clusters, d), got {tuple(init.shape)}")
        scale = _scale("x, init", x, init)
        init = init.contiguous() / scale
    else:
        scale = _scale("x", x)
    return (x, init, scale) if scale == 1.0 else (x / scale, init, scale)


def _rescaled(result: KMeansResult, scale: float) -> KMeansResult:
    """A result on data divided by ``scale``, in the data's own units."""
    if scale == 1.0:
        return result
    inertia = (result.inertia.double() * scale * scale).to(result.centroids.dtype)  # may exceed the dtype: inf
    return result._replace(centroids=result.centroids * scale, inertia=inertia)


def _lloyd(x, n_clusters, init, max_iter, tol, seed, weights=None) -> KMeansResult:
    """``kmeans`` on checked, scaled points (``weights``: [n] float64 or None)."""
    if isinstance(init, torch.Tensor):
        centroids = init.clone()
    elif init == "k-means++":
        generator = torch.Generator(device=x.device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(2**62, ())))
        centroids = _kmeans_plus_plus(x, n_clusters, generator, weights)
    else:
        raise ValueError(f'init: expected "k-means++" or a [{n_clusters}, {x.shape[1]}] tensor, got {init!r}')
    tolerance = tol * x.var(0, unbiased=False).mean()
    previous = None
    converged = False
    for step in range(1, max_iter + 1):
        labels, new, counts = lloyd_step(x, centroids, weights)
        same = (labels == previous).all() if previous is not None else x.new_zeros((), dtype=torch.bool)
        small = ((new - centroids) ** 2).sum() <= tolerance
        same, has_empty, small = torch.stack([same, (counts == 0).any(), small]).tolist()
        if has_empty:
            new = _reseed_empty(x, centroids, new, counts)
            small = bool(((new - centroids) ** 2).sum() <= tolerance)
        centroids = new
        if same:
            converged = True
            break
        if small:
            break
        previous = labels
    if not converged:
        labels = _assign(x, centroids)
    squared = ((x - centroids[labels]) ** 2).sum(-1)
    inertia = squared.sum() if weights is None else (squared * weights).sum().to(x.dtype)
    return KMeansResult(centroids, labels, inertia, step)


def _reseed_empty(x, previous, centroids, counts):
    """Move the centroids of empty clusters to the points farthest from their nearest
    ``previous`` centroid (the i-th empty cluster to the i-th farthest): deterministic."""
    empty = counts == 0
    d2 = ((x[:, None, :] - previous[None]) ** 2).sum(-1).amin(1)
    farthest = torch.topk(d2, int(empty.sum()), sorted=True).indices
    centroids = centroids.clone()
    centroids[empty] = x[farthest]
    return centroids


class NotFittedError(ValueError, AttributeError):
    """``predict``, ``transform`` or ``score`` before ``fit`` (scikit-learn's
    ``sklearn.exceptions.NotFittedError`` where scikit-learn is installed)."""


def _not_fitted(message: str) -> Exception:
    try:
        from sklearn.exceptions import NotFittedError as SklearnNotFittedError
    except ImportError:
        return NotFittedError(message)
    return SklearnNotFittedError(message)


class KMeans:
    """scikit-learn's ``KMeans`` estimator over ``kmeans``: NumPy arrays or tensors, any device.

    A scikit-learn estimator (``get_params`` / ``set_params``, ``clone``, pipelines, its
    ``check_estimator`` suite) without depending on scikit-learn.

    Args:
        n_clusters: k. init: "k-means++", "random" (k distinct rows) or initial centroids
            [k, d] (array or tensor).
        n_init: restarts, the fit with the lowest inertia kept; "auto": 1 for "k-means++"
            and explicit centroids, 10 for "random" (scikit-learn's rule).
        max_iter, tol: as in :func:`kmeans` (scikit-learn's stopping rule).
        random_state: an int, a ``numpy.random.RandomState`` or None (random).
        backend: "auto" (default): scikit-learn's KMeans for data on the CPU where it is
            installed (its cache-blocked C Lloyd loop is 3-10x faster there than the
            compiled NumPy step on a 2-core CPU),
            else fullgraph's ``kmeans`` (CUDA tensors: the compiled NumPy step on the GPU);
            "fullgraph" or "sklearn" to insist. ``backend_`` says which ran.

    Attributes after ``fit``: ``cluster_centers_`` [k, d], ``labels_`` [n] (int32, as
    scikit-learn's), ``inertia_`` (float), ``n_iter_`` (int), ``n_features_in_`` (and
    ``feature_names_in_`` for data frames); arrays are NumPy arrays when ``fit`` got one,
    else tensors. Parameters are checked by ``fit``, as scikit-learn's are.

    Example:
        >>> import numpy as np
        >>> x = np.concatenate([np.zeros((20, 2)), np.ones((20, 2)) * 9]).astype(np.float32)
        >>> model = fullgraph.KMeans(n_clusters=2, random_state=0).fit(x)
        >>> sorted(np.bincount(model.labels_).tolist()), type(model.cluster_centers_).__name__
        ([20, 20], 'ndarray')
    """

    BACKENDS = ("auto", "fullgraph", "sklearn")
    _PARAMETERS = ("n_clusters", "init", "n_init", "max_iter", "tol", "random_state", "backend")

    def __init__(self, n_clusters: int = 8, *, init="k-means++", n_init="auto", max_iter: int = 300,
                 tol: float = 1e-4, random_state=None, backend: str = "auto"):
        self.n_clusters, self.init, self.n_init = n_clusters, init, n_init
        self.max_iter, self.tol, self.random_state, self.backend = max_iter, tol, random_state, backend

    # scikit-learn's estimator protocol

    def get_params(self, deep: bool = True) -> dict:
        return {name: getattr(self, name) for name in self._PARAMETERS}

    def set_params(self, **params) -> KMeans:
        for name, value in params.items():
            if name not in self._PARAMETERS:
                raise ValueError(f"Invalid parameter {name!r} for estimator {type(self).__name__}. Valid parameters "
                                 f"are: {sorted(self._PARAMETERS)!r}.")
            setattr(self, name, value)
        return self

    def __repr__(self) -> str:
        changed = ", ".join(f"{name}={value!r}" for name, value in self.get_params().items()
                            if not isinstance(value, (np.ndarray, torch.Tensor)) and value != _DEFAULTS[name])
        return f"KMeans({changed})"

    def __sklearn_tags__(self):
        from sklearn.utils import Tags, TargetTags, TransformerTags

        return Tags(estimator_type="clusterer", target_tags=TargetTags(required=False),
                    transformer_tags=TransformerTags(), requires_fit=True)

    def __sklearn_is_fitted__(self) -> bool:
        return hasattr(self, "_centroids")

    # data

    def _tensor(self, name: str, x, reset: bool):
        """(tensor, whether it came as an array): tensors as they are (non-floating ones as
        float64); anything else through scikit-learn's ``check_array`` where it is installed
        (its messages, feature names and counts), else ``numpy.asarray`` to float64."""
        if isinstance(x, torch.Tensor):
            tensor = x if x.dtype.is_floating_point else x.to(torch.float64)
            if reset:
                self.n_features_in_ = tensor.shape[1] if tensor.dim() == 2 else None
            return tensor, False
        try:
            from sklearn.utils.validation import validate_data
        except ImportError:
            array = np.asarray(x)
            if array.dtype not in (np.float32, np.float64):
                if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
                    raise TypeError(f"{name}: expected an array of numbers, got dtype {array.dtype}")
                array = array.astype(np.float64)
            if reset and array.ndim == 2:
                self.n_features_in_ = array.shape[1]
        else:
            array = validate_data(self, x, reset=reset, dtype=[np.float64, np.float32], ensure_all_finite=False,
                                  order="C", copy=False)
        if not reset and getattr(self, "n_features_in_", None) is not None and array.ndim == 2 \
                and array.shape[1] != self.n_features_in_:
            raise ValueError(f"X has {array.shape[1]} features, but KMeans is expecting {self.n_features_in_} "
                             "features as input.")
        return torch.from_numpy(np.array(array, copy=not array.flags.writeable or not array.flags.c_contiguous)), True

    def _restarts(self) -> int:
        if self.n_init == "auto":
            return 10 if isinstance(self.init, str) and self.init == "random" else 1
        if isinstance(self.n_init, bool) or not isinstance(self.n_init, numbers.Integral) or self.n_init < 1:
            raise ValueError(f"n_init: expected 'auto' or an int >= 1, got {self.n_init!r}")
        return int(self.n_init)

    def _seeds(self, count: int) -> list[int]:
        state = self.random_state
        if isinstance(state, np.random.RandomState):
            return [int(v) for v in state.randint(0, 2**31 - 1, size=count)]
        if state is not None and (isinstance(state, bool) or not isinstance(state, numbers.Integral)):
            raise TypeError(f"random_state: expected an int, a numpy.random.RandomState or None, got "
                            f"{_validate._describe(state)}")
        return [int(v) for v in np.random.default_rng(None if state is None else int(state)).integers(0, 2**62,
                                                                                                        size=count)]

    def _chosen_backend(self, x: torch.Tensor) -> str:
        if self.backend not in self.BACKENDS:
            raise ValueError(f"backend: expected one of {self.BACKENDS}, got {self.backend!r}")
        if self.backend == "sklearn" and x.device.type != "cpu":
            raise ValueError(f'backend: "sklearn" clusters data on the CPU, got X on {x.device}')
        if self.backend != "auto":
            return self.backend
        if x.device.type == "cpu" and importlib.util.find_spec("sklearn") is not None:
            return "sklearn"
        return "fullgraph"

    def _fit_with_sklearn(self, x: torch.Tensor, init, weights, restarts: int, seed: int) -> KMeansResult:
        from sklearn.cluster import KMeans as SklearnKMeans

        # The same refusals and scaling whichever backend runs.
        x, init, scale = _checked(x, self.n_clusters, init, self.max_iter, self.tol)
        if isinstance(init, torch.Tensor):
            init = init.detach().numpy()
        model = SklearnKMeans(n_clusters=int(self.n_clusters), init=init, n_init=restarts, max_iter=int(self.max_iter),
                              tol=self.tol, random_state=seed % 2**31)
        model.fit(x.detach().numpy(), sample_weight=None if weights is None else weights.numpy())
        result = KMeansResult(torch.from_numpy(model.cluster_centers_).to(x.dtype),
                              torch.from_numpy(model.labels_.astype(np.int64)),
                              torch.tensor(model.inertia_, dtype=x.dtype), model.n_iter_)
        return _rescaled(result, scale)

    def _fit_with_fullgraph(self, x: torch.Tensor, init, weights, seeds: list[int]) -> KMeansResult:
        runs = []
        for seed in seeds:
            start = init
            if isinstance(init, str) and init == "random":
                generator = torch.Generator().manual_seed(seed)
                if isinstance(self.n_clusters, numbers.Integral) and 1 <= self.n_clusters <= x.shape[0]:
                    rows = torch.randperm(x.shape[0], generator=generator)[:int(self.n_clusters)].to(x.device)
                    start = x[rows].contiguous()
            runs.append(kmeans(x, self.n_clusters, init=start, max_iter=self.max_iter, tol=self.tol, seed=seed,
                               sample_weight=weights))
        return min(runs, key=lambda result: float(result.inertia))

    # fitting and using

    def fit(self, X, y=None, sample_weight=None) -> KMeans:
        """Cluster X [n, d] (``sample_weight`` [n]: weights >= 0 of the points, None: 1 each);
        ``y`` is ignored (scikit-learn's signature)."""
        x, from_numpy = self._tensor("X", X, reset=True)
        _points(x)
        if sample_weight is not None and not isinstance(sample_weight, (np.ndarray, torch.Tensor)):
            sample_weight = np.asarray(sample_weight, dtype=np.float64)
            if sample_weight.ndim == 0:
                sample_weight = np.full(x.shape[0], float(sample_weight))
        weights = _weights(sample_weight, x)
        init = self.init
        if isinstance(init, np.ndarray):
            init = torch.from_numpy(np.asarray(init, dtype=np.float64)).to(x.device, x.dtype)
        elif isinstance(init, str) and init not in ("k-means++", "random"):
            raise ValueError(f"init: expected 'k-means++', 'random' or a [{self.n_clusters}, {x.shape[1]}] array, "
                             f"got {init!r}")
        elif not isinstance(init, (str, torch.Tensor)):
            raise TypeError(f"init: expected 'k-means++', 'random' or an array of centroids, got "
                            f"{_validate._describe(init)}")
        restarts = 1 if isinstance(init, torch.Tensor) else self._restarts()
        seeds = self._seeds(restarts)
        self.backend_ = self._chosen_backend(x)
        if self.backend_ == "sklearn":
            best = self._fit_with_sklearn(x, init, weights, restarts, seeds[0])
        else:
            best = self._fit_with_fullgraph(x, init, weights, seeds)
        labels = best.labels.to(torch.int32)
        convert = (lambda t: t.cpu().numpy()) if from_numpy else (lambda t: t)
        self.cluster_centers_, self.labels_ = convert(best.centroids), convert(labels)
        self.inertia_, self.n_iter_ = float(best.inertia), best.n_iter
        self._centroids = best.centroids
        return self

    def _fitted(self, X):
        if not hasattr(self, "_centroids"):
            raise _not_fitted("This KMeans instance is not fitted yet. Call 'fit' with appropriate arguments "
                              "before using this estimator.")
        x, from_numpy = self._tensor("X", X, reset=False)
        _points(x)
        _scale("X", x)  # refuses NaN and inf
        if x.shape[1] != self._centroids.shape[1]:
            raise ValueError(f"X has {x.shape[1]} features, but KMeans is expecting {self._centroids.shape[1]} "
                             "features as input.")
        return x, self._centroids.to(x.device, x.dtype), from_numpy

    def predict(self, X):
        """The nearest fitted centroid of each row of X [n, d]: labels [n] int32."""
        x, centroids, from_numpy = self._fitted(X)
        labels = kmeans_assign(x, centroids).to(torch.int32)
        return labels.cpu().numpy() if from_numpy else labels

    def fit_predict(self, X, y=None, sample_weight=None):
        return self.fit(X, sample_weight=sample_weight).labels_

    def transform(self, X):
        """Distances [n, k] from each row of X to the fitted centroids."""
        x, centroids, from_numpy = self._fitted(X)
        distances = torch.cdist(x, centroids)
        return distances.cpu().numpy() if from_numpy else distances

    def fit_transform(self, X, y=None, sample_weight=None):
        return self.fit(X, sample_weight=sample_weight).transform(X)

    def score(self, X, y=None, sample_weight=None) -> float:
        """Minus the inertia of X [n, d] on the fitted centroids (larger is better)."""
        x, centroids, _ = self._fitted(X)
        squared = ((x - centroids[kmeans_assign(x, centroids)]) ** 2).sum(-1).double()
        weights = _weights(np.asarray(sample_weight, dtype=np.float64) if isinstance(sample_weight, (list, tuple))
                           else sample_weight, x)
        return -float(squared.sum() if weights is None else (squared * weights).sum())


_DEFAULTS = {"n_clusters": 8, "init": "k-means++", "n_init": "auto", "max_iter": 300, "tol": 1e-4,
             "random_state": None, "backend": "auto"}
