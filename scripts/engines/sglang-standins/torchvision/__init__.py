"""An import-only stand-in for torchvision (see kvpool's scripts/engines/sglang-env.sh).

PyPI's torchvision wheels link CUDA torch and fail to import beside the +cpu torch, yet
``sglang.srt.configs`` (imported by SGLang's memory pools) imports ``torchvision.transforms`` at
module level for one vision model's preprocessing, and transformers then imports a few names.
Every ``torchvision.*`` module imports; every name in it is a placeholder that raises when called.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stand-in"


class _Placeholder:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is an import-only stand-in in this venv")

    def __repr__(self):
        return f"<torchvision stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())


def __getattr__(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return importlib.import_module(f"torchvision.{attr}")
