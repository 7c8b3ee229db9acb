"""Triton kernels compiled in background processes, so that a first call need not wait.

Within ``deferring()``, a Triton kernel that would compile (no binary in this process, and
none this module knows to be in Triton's disk cache) is neither compiled nor launched: its
specialization goes to a background process, which compiles it into the disk cache, and
``Compiling`` is raised before anything of it runs, so the caller answers another way (a
path of torch's own operators). Once that process is done, the next call loads the binary
from the cache (tens of milliseconds) and goes on to its next kernel, which may defer in
turn: the kernels of a path compile one after another, each in its own process, while the
calls are answered without them. Nothing here runs inside a CUDA graph capture (a capture
compiles where it stands).

``FULLGRAPH_BACKGROUND_COMPILE=0`` turns it off (kernels compile in the calling process, as
Triton does by itself).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import logging
import threading

log = logging.getLogger(__name__)
# Background processes compiling at once (each takes one core).
WORKERS = max(1, min(4, (os.cpu_count() or 2) // 2))
# A background compile that takes longer is given up (the kernel then compiles in the caller).
TIMEOUT_S = 600


class Compiling(Exception):
    """A kernel of this call is compiling in the background (``deferring``)."""


_lock = threading.Lock()
_slots = threading.Semaphore(WORKERS)
_running: dict[str, subprocess.Popen | None] = {}  # marker -> its process (None: waiting for a slot)
_failed: set[str] = set()
_active = threading.local()


def enabled() -> bool:
    """Whether kernels may compile in the background here: Triton with the hooks this needs,
    not interpreted, and not turned off by FULLGRAPH_BACKGROUND_COMPILE=0."""
    if os.environ.get("FULLGRAPH_BACKGROUND_COMPILE", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return hasattr(knobs.runtime, "jit_cache_hook") and hasattr(JITFunction, "preload")


def pending() -> bool:
    """Whether a kernel is compiling in the background now."""
    with _lock:
        return bool(_running)


def _ready_dir() -> str:
    from triton import knobs

    return os.path.join(knobs.cache.dir, "fullgraph-ready")


def _marker(function, specialization: str) -> str:
    """A name for one specialization of one kernel's source (``JITFunction.cache_key`` hashes
    the source and what it calls)."""
    return hashlib.sha256(f"{function.cache_key}\n{specialization}".encode()).hexdigest()


def _compile(marker: str, job: dict) -> None:
    """Compile ``job`` in a new process (a slot free), then mark it ready or failed."""
    with _slots:
        try:
            with _lock:
                if marker not in _running:  # (given up at exit)
                    return
                process = _running[marker] = subprocess.Popen(
                    [sys.executable, "-c", "from fullgraph._background import _main; _main()"],
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            _, error = process.communicate(json.dumps(job), timeout=TIMEOUT_S)
            done = process.returncode == 0
        except (OSError, subprocess.SubprocessError) as problem:
            done, error = False, str(problem)
        if not done:
            log.warning("compiling %s in the background failed (it compiles in the calling process): %s",
                        job["name"], error[-2000:])
        with _lock:
            if done:
                os.makedirs(_ready_dir(), exist_ok=True)
                with open(os.path.join(_ready_dir(), marker), "w"):
                    pass
            else:
                _failed.add(marker)
            _running.pop(marker, None)


def _hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
    """Triton's ``jit_cache_hook``: called before a kernel compiles in this process."""
    previous = getattr(_active, "previous", None)
    if previous is not None and previous(key=key, repr=repr, fn=fn, compile=compile,
                                         is_manual_warmup=is_manual_warmup, already_compiled=already_compiled):
        return True
    if not getattr(_active, "on", False) or is_manual_warmup:
        return None
    function = fn.jit_function
    marker = _marker(function, compile["specialization_data"])
    with _lock:
        if marker in _failed or os.path.exists(os.path.join(_ready_dir(), marker)):
            return None  # compiled here: from the disk cache, or the background's error raised here
        if marker not in _running:
            _running[marker] = None
            job = {"module": fn.module, "name": fn.name, "device": compile["device"],
                   "specialization": compile["specialization_data"],
                   "kinds": [type(value).__name__ for value in compile["constants"].values()]}
            threading.Thread(target=_compile, args=(marker, job), daemon=True).start()
    raise Compiling(f"{fn.name} is compiling in the background")


@contextlib.contextmanager
def deferring():
    """Within, a Triton kernel that would compile in this thread raises ``Compiling`` instead
    (module docstring). Nothing changes where ``enabled()`` is False."""
    if not enabled() or getattr(_active, "on", False):
        yield
        return
    from triton import knobs

    _active.previous = previous = knobs.runtime.jit_cache_hook  # (a hook set by someone else still runs)
    knobs.runtime.jit_cache_hook = _hook
    _active.on = True
    try:
        yield
    finally:
        _active.on, _active.previous = False, None
        knobs.runtime.jit_cache_hook = previous


@atexit.register
def _stop() -> None:
    """Background compiles end with the process (a later process starts them again)."""
    with _lock:
        for marker, process in list(_running.items()):
            if process is not None:
                process.kill()
        _running.clear()


def _main() -> None:
    """A background process: the kernel specialization on stdin compiled into Triton's cache."""
    import importlib

    import torch
    from triton.runtime.jit import JITFunction

    job = json.loads(sys.stdin.read())
    torch.cuda.set_device(job["device"])
    function = importlib.import_module(job["module"])
    for part in job["name"].split("."):
        function = getattr(function, part)
    while not isinstance(function, JITFunction):  # (autotuners and heuristics wrap it)
        function = function.fn
    _preload(function, job["device"], json.loads(job["specialization"]), job["kinds"])


def _preload(function, device: int, data: dict, kinds: list[str]) -> None:
    """``JITFunction.preload`` of Triton's specialization ``data``, each constant decoded as the
    type it had (``kinds``): preload takes every string that names a dtype for one ("fp16")."""
    import triton.language as tl
    from triton.runtime.jit import convert_to_tuple_if_list

    constants = {}
    for path, value, kind in zip(data["constant_keys"], data["constant_vals"], kinds):
        if isinstance(value, dict) and kind != "constexpr":  # (a kernel as a constant: preload's own)
            return function.preload(json.dumps(data))
        if kind == "dtype":
            value = tl.dtype(value)
        elif kind == "constexpr":
            value = tl.constexpr(convert_to_tuple_if_list(value["constexpr"]))
        else:
            value = convert_to_tuple_if_list(value)
        constants[tuple(path)] = value
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"]))
    signature = {name: convert_to_tuple_if_list(kind) for name, kind in data["signature"].items()}
    options = {name: tuple(value) if isinstance(value, list) else value for name, value in data["options"].items()}
    backend = function.device_caches[device][3]
    function._do_compile(data["key"], signature, device, constants, backend.parse_options(options), attrs, warmup=True)
