"""The package's public ops must survive the lazy import of its Triton modules: a submodule
named like an op replaces the op on the package when it is first imported (on CUDA only, so
a CPU run never sees it)."""
import importlib
import pkgutil
import types

import forkserve.kernels as kernels


def test_no_submodule_shadows_a_public_op():
    modules = {m.name for m in pkgutil.iter_modules(kernels.__path__)}
    assert not modules & set(kernels.__all__) - {"reference"}


def test_public_ops_stay_functions_after_every_submodule_is_imported():
    for m in pkgutil.iter_modules(kernels.__path__):
        try:
            importlib.import_module(f"forkserve.kernels.{m.name}")
        except ImportError:  # a Triton module on a machine without triton
            continue
    for name in kernels.__all__:
        if name != "reference":
            assert not isinstance(getattr(kernels, name), types.ModuleType), name
