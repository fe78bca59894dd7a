"""Structured outputs: grammars compiled by xgrammar, enforced token by token in the sampler.

xgrammar was picked over llguidance by the per-step mask cost on the CPU
(``benchmarks/grammar_bench.py``, ``benchmarks/results/grammar_bench_cpu.json``).
"""

from forkserve.interfaces.server.grammar.compiler import GrammarCompiler, GrammarError
from forkserve.interfaces.server.grammar.constraint import GrammarConstraint

__all__ = ["GrammarCompiler", "GrammarConstraint", "GrammarError"]
