"""SASS instructions by class, for counts read on the CPU (ws_sass.py: a key tile's
instructions) and on the GPU (ncu_compare.py --source: what a launch executed)."""
from __future__ import annotations

import re

# By SASS opcode (the part before the first dot); the rest is "uniform" (the uniform
# datapath's: mostly the wgmma descriptors and TMA coordinates) or "int/other".
CLASSES = {
    "fp32": ("FMUL", "FADD", "FFMA", "FMNMX", "FSEL", "FSETP"),
    "exp2": ("MUFU",),
    "bf16x2": ("HFMA2", "HMUL2", "HADD2"),
    "convert": ("F2FP", "PRMT", "F2F"),
    "wgmma": ("HGMMA", "WARPGROUP"),
    "smem/sync": ("LDS", "STS", "LDSM", "STSM", "BAR", "SYNCS", "MEMBAR", "FENCE", "SHFL"),
}
OTHER_UNIFORM, OTHER = "uniform", "int/other"
ALL_CLASSES = (*CLASSES, OTHER_UNIFORM, OTHER)


def opcode(line: str) -> str:
    """The opcode of one SASS instruction's text, its predicate and modifiers dropped."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", line.strip()).split()[0].split(".")[0]


def op_class(op: str) -> str:
    for name, ops in CLASSES.items():
        if op in ops:
            return name
    return OTHER_UNIFORM if op.startswith("U") or op == "R2UR" else OTHER
