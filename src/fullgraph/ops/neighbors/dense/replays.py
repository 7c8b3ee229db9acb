"""Small eager calls on GPUs replayed from CUDA graphs.

Eagerly a small call is host-bound: its ~40 launches (Triton's at ~40 us each) cost more than
the GPU's work (16 x 256^2 D=64 k=20: 0.54 ms as called, 0.05 ms graphed). A call whose
signature (shapes, dtype, device, k, radius, lengths, stream) comes back REPLAY_AFTER times is
captured once, on the capture path (``backend.plan``: no host read, the same lists), and
replayed from then on: the arguments copied in, the graph replayed, the outputs copied out.
The first calls of a signature run as before, so a shape seen once costs no capture.
"""

from __future__ import annotations

import collections
import math
import threading

import torch

from .... import _background, graphs

# The call of a signature that is captured (the earlier ones run eagerly): a shape seen once or
# twice costs no capture.
REPLAY_AFTER = 3
# Calls of up to this many query-reference pairs (all items) are replayed: beyond, the GPU's work
# outweighs the host's launches, and a graph would hold its blocks' memory.
REPLAY_MAX_PAIRS = 2**26
# Graphs kept (least recently used dropped) and signatures counted.
REPLAY_MAX_GRAPHS, SIGHTINGS_KEPT = 16, 256


class Replays:
    """``nearest(query, ref, k, radius, query_lengths, ref_lengths)`` replayed from CUDA graphs
    where it pays (module docstring); ``__call__`` returns None where the caller should run
    it eagerly."""

    def __init__(self, nearest):
        self._nearest = nearest
        self._graphs: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
        self._seen: collections.OrderedDict[tuple, int] = collections.OrderedDict()
        self._refused: set[tuple] = set()
        self._pools: dict[tuple, tuple] = {}
        self._lock = threading.Lock()
        self._capturing = threading.local()  # (the warm-up and capture call ``nearest`` again)
        self.captures = 0

    def __call__(self, query, ref, k, radius, query_lengths, ref_lengths):
        if query.shape[0] * query.shape[1] * ref.shape[1] > REPLAY_MAX_PAIRS or getattr(self._capturing, "on", False):
            return None
        args = (query, ref, query_lengths, ref_lengths)
        stream = torch.cuda.current_stream(query.device).cuda_stream
        key = (*(None if x is None else (tuple(x.shape), x.dtype) for x in args), k, radius, query.device, stream)
        with self._lock:
            found = self._graphs.get(key)
            if found is None:
                seen = self._seen.pop(key, 0) + 1
                self._seen[key] = seen
                if len(self._seen) > SIGHTINGS_KEPT:
                    self._seen.popitem(last=False)
                if seen < REPLAY_AFTER or key in self._refused:
                    return None
                found = self._capture(key, args, k, radius)
                if found is None:
                    return None
            else:
                self._graphs.move_to_end(key)
                for static, value in zip(found[1], args):
                    if value is not None:
                        static.copy_(value)
                found[0].replay()
            dists, idx, counts = found[2]
            # (plain kNN's counts are unspecified: ``pairs.Kernels.nearest``)
            return dists.clone(), idx.clone(), counts.clone() if radius < math.inf else torch.empty_like(counts)

    def _capture(self, key, args, k, radius):
        """Capture ``nearest`` on copies of ``args`` (query, ref and the lengths or None), cached
        under ``key``; None where it fails."""
        static = [None if x is None else x.clone() for x in args]
        query, ref, query_lengths, ref_lengths = static
        # One memory pool a stream: graphs that share a pool reuse each other's temporaries, safe
        # only where they replay one after another.
        pool = key[-2:]  # (device, stream)
        if pool not in self._pools:
            with torch.cuda.device(query.device):
                self._pools[pool] = torch.cuda.graph_pool_handle()
        self._capturing.on = True
        try:
            # (a kernel not compiled yet compiles in the background: captured on a later call)
            with _background.deferring():
                graph, output = graphs.capture(lambda: self._nearest(query, ref, k, radius, query_lengths, ref_lengths),
                                               query.device, warmup=1, pool=self._pools[pool])
        except graphs.GraphCaptureError as error:  # (the capture left the generator as it was)
            if not isinstance(error.__cause__, _background.Compiling):
                self._refused.add(key)
            return None
        finally:
            self._capturing.on = False
        graph.replay()  # (a capture records without running)
        self.captures += 1
        self._graphs[key] = found = (graph, static, output)
        if len(self._graphs) > REPLAY_MAX_GRAPHS:
            self._graphs.popitem(last=False)
        return found
