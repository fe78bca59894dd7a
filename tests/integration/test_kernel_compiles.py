"""KernelCompiles: the Triton builds a timed region met, read through Triton's own hooks."""
from types import SimpleNamespace

import pytest

from forkserve.bench.kernel_compiles import KernelCompiles


def _knobs():
    # Imported in the test, not at collection: importing Triton before tests/kernels'
    # conftest sets TRITON_INTERPRET would leave the kernel tests without the interpreter.
    return pytest.importorskip("triton").knobs


def _build(name: str, key: tuple) -> None:
    """What Triton's JITFunction._do_compile calls around one specialization's build: ``X``
    a pointer and ``n`` an integer, both specialized as divisible by 16."""
    knobs = _knobs()
    fn = SimpleNamespace(name=name, jit_function=SimpleNamespace(arg_names=["X", "BLOCK", "n"]))
    sixteen = [["tt.divisibility", 16]]
    kw = dict(key=key, repr=f"{name}[num_warps=4]", fn=fn,
              compile={"key": key, "constants": {(1,): 64},
                       "signature": {"X": "*bf16", "BLOCK": "constexpr", "n": "i32"},
                       "configs": [{(0,): sixteen, (2,): sixteen}]},
              is_manual_warmup=False, already_compiled=False)
    before, after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    assert not (before and before(**kw))  # a true answer would make Triton skip the build
    if after:
        after(**kw)


def test_counts_builds_per_window_and_restores_the_hooks():
    knobs = _knobs()
    seen = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)
    try:
        rec = KernelCompiles().install()
        _build("warm", (1,))
        mark = rec.window()
        _build("decode", (2,))
        _build("decode", (3,))
        _build("prefill", (4,))
        counts = rec.since(mark)
        assert (counts.triton, counts.top) == (3, ("decode x2", "prefill x1"))
        assert counts.triton_s >= 0.0
        assert counts.specs[0] == "decode[num_warps=4] constexprs(BLOCK=64) div16(n)"
        assert rec.since(rec.window()).triton == 0
        rec.close()
        # The hook found at install still ran under ours, and is back in place.
        assert seen == ["warm", "decode", "decode", "prefill"]
        _build("after", (5,))
        assert seen[-1] == "after" and rec.since(mark).triton == 3
    finally:
        knobs.runtime.jit_post_compile_hook = None
        knobs.runtime.jit_cache_hook = None


def test_importing_the_bench_leaves_triton_unimported():
    """The bench modules that tests import at collection must not import Triton: it would fix
    its mode before tests/kernels' conftest sets TRITON_INTERPRET (161 kernel tests failed
    in CI that way)."""
    import subprocess
    import sys

    code = ("import sys, forkserve.bench.multilora, forkserve.bench.kernel_compiles; "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_fa4_compiles_counted_from_its_jit_cache(monkeypatch) -> None:
    """FlashAttention-4 compiles outside Triton's hooks: a window counts the entries its
    forward's in-memory JIT cache gained (none where it was never imported)."""
    import sys
    from types import SimpleNamespace

    from forkserve.bench.kernel_compiles import KernelCompiles
    monkeypatch.delitem(sys.modules, "flash_attn.cute.interface", raising=False)
    compiles = KernelCompiles()
    assert compiles.since(compiles.window()).fa4 == 0
    cache = SimpleNamespace(cache={"a": 1})
    interface = SimpleNamespace(_flash_attn_fwd=SimpleNamespace(compile_cache=cache))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    mark = compiles.window()
    cache.cache.update(b=2, c=3)
    counts = compiles.since(mark)
    assert counts.fa4 == 2 and counts.specs == ("flash_attn.cute fwd b", "flash_attn.cute fwd c")
