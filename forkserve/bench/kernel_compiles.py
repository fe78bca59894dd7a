"""Kernel specializations a timed region met for the first time in this process.

A Triton kernel is built per constexpr/dtype/alignment specialization on its first launch:
compiled (~0.5-2 s) or loaded from Triton's on-disk cache (~ms). A benchmark whose warm-up
missed a specialization pays that inside its timed run, and on a fresh machine (empty disk
cache) it pays the whole compile: one run of a system measured 10.6 s of prefill on a warm
machine and 18.5 s on a fresh one (docs/MULTILORA.md "Round 8"). ``KernelCompiles`` makes
that visible in every row instead of leaving it to be inferred from the spread.

Triton calls ``knobs.runtime.jit_cache_hook`` before it builds a specialization and
``jit_post_compile_hook`` after; the time between them is the build (compile or disk load).
Inductor (torch.compile) builds its kernels outside those hooks, so dynamo's compiled-graph
count is read too. The hooks are process-wide: one recorder is installed at a time, and it
restores the hooks it found on ``close``.
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass

_TOP = 6  # kernel names kept per window (the most built first)


@dataclass(frozen=True)
class CompileCounts:
    """What a window built: Triton specializations, their seconds (compile or disk load),
    the kernels that built most, and the graphs dynamo compiled."""

    triton: int = 0
    triton_s: float = 0.0
    top: tuple[str, ...] = ()
    dynamo_graphs: int = 0
    # The first builds' constexpr values ("name(K=v, ...)"): which specialization the
    # warm-up missed.
    specs: tuple[str, ...] = ()
    # FlashAttention-4 kernels compiled (~3 s each on the H200; kernels/fa4_op.py).
    fa4: int = 0


def _fa4_compiled() -> frozenset:
    """The keys of the kernels FlashAttention-4's forward has compiled in this process (its
    in-memory JIT cache), none where it was never imported: it compiles outside Triton's
    hooks."""
    interface = sys.modules.get("flash_attn.cute.interface")
    cache = getattr(getattr(getattr(interface, "_flash_attn_fwd", None), "compile_cache", None),
                    "cache", None)
    return frozenset(cache) if isinstance(cache, dict) else frozenset()


def _dynamo_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # a torch without dynamo compiles nothing
        return 0
    return int(counters["stats"]["unique_graphs"])


class KernelCompiles:
    """Counts the kernel builds of a process from ``install()`` to ``close()``; ``window()``
    starts a region and ``since(mark)`` reads what it built. Without Triton (or on a CPU run
    that never launches a kernel) every count stays zero."""

    def __init__(self) -> None:
        self._started: dict[int, float] = {}
        self._names: Counter[str] = Counter()
        self._count = 0
        self._seconds = 0.0
        self._specs: list[str] = []
        self._saved: tuple | None = None

    def install(self) -> KernelCompiles:
        """Hook Triton's compile path; a second call (already installed) does nothing."""
        if self._saved is not None:
            return self
        try:
            from triton import knobs
        except ImportError:
            return self
        rt = knobs.runtime
        self._saved = (rt.jit_cache_hook, rt.jit_post_compile_hook)
        before, after = self._saved

        def on_build(**kw):
            self._started[id(kw["compile"]["key"])] = time.perf_counter()
            return before(**kw) if before else False

        def on_built(**kw):
            start = self._started.pop(id(kw["compile"]["key"]), None)
            if start is not None:
                self._seconds += time.perf_counter() - start
            self._count += 1
            self._names[kw["fn"].name] += 1
            self._specs.append(_spec(kw))
            return after(**kw) if after else None

        rt.jit_cache_hook, rt.jit_post_compile_hook = on_build, on_built
        return self

    def close(self) -> None:
        if self._saved is not None:
            from triton import knobs

            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved
            self._saved = None

    def window(self) -> tuple[int, float, Counter[str], int, frozenset]:
        return (self._count, self._seconds, Counter(self._names), _dynamo_graphs(),
                _fa4_compiled())

    def since(self, mark: tuple[int, float, Counter[str], int, frozenset]) -> CompileCounts:
        count, seconds, names, graphs, fa4 = mark
        built = self._names - names
        # FA4's new kernels by their compile key (which configuration the warm-up missed).
        fa4_new = sorted(str(key)[:400] for key in _fa4_compiled() - fa4)
        return CompileCounts(self._count - count, round(self._seconds - seconds, 3),
                             tuple(f"{n} x{c}" for n, c in built.most_common(_TOP)),
                             _dynamo_graphs() - graphs,
                             tuple(self._specs[count:count + _TOP])
                             + tuple(f"flash_attn.cute fwd {k}" for k in fa4_new[:_TOP]),
                             len(fa4_new))


def _spec(kw: dict) -> str:
    """A build's launch options, constexpr values (by parameter name where Triton says it) and
    the integer arguments it specialized as divisible by 16: an integer that changes class
    from step to step (a table width, a split count) builds again unless the kernel lists it
    in ``do_not_specialize``."""
    fn = kw["fn"]
    names = getattr(getattr(fn, "jit_function", None), "arg_names", None) or []
    build = kw["compile"]

    def name_of(key: object) -> str:
        at = key[0] if isinstance(key, tuple) and key else key
        return names[at] if isinstance(at, int) and at < len(names) else str(key)

    consts = ", ".join(f"{name_of(k)}={v}" for k, v in (build.get("constants") or {}).items())
    signature = build.get("signature") or {}
    attrs = (build.get("configs") or [{}])[0] or {}
    divisible = [name_of(k) for k, found in attrs.items()
                 if str(signature.get(name_of(k), "")).startswith(("i", "u"))
                 and any("divisibility" in str(a[0]) for a in found)]
    return (f"{kw.get('repr', fn.name)} constexprs({consts})"
            + (f" div16({', '.join(divisible)})" if divisible else ""))
