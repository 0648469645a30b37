"""Stand-ins for megatron-core modules that import DTensor (and torch.distributed.checkpoint)
without a fallback, used while megatron-core is imported (inspector.world.fastimport).

Each stands in for a module, or a package's __init__, that only saving or loading a checkpoint,
or Megatron FSDP, uses; whatever megatron calls of them imports the real module then and runs
megatron's own code. tests/test_fastimport.py checks that a build imports none of them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any


class _SafeGlobalsStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stand in for megatron.core.safe_globals (0.14+), imported by megatron.core's __init__.

    It registers megatron's classes with torch.load's allow-list (only loading checkpoints needs
    that) and imports megatron's optimizer package to name OptimizerConfig, which imports
    torch.distributed.checkpoint without a fallback, and so DTensor. Nothing here loads a
    checkpoint: the stand-in registers nothing.
    """

    NAME = "megatron.core.safe_globals"

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname == self.NAME else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.SAFE_GLOBALS = []  # type: ignore[attr-defined]
        module.register_safe_globals = lambda: None  # type: ignore[attr-defined]
        # 0.19's megatron.core.__init__ makes it torch.storage._load_from_bytes: megatron's own
        # (safe_globals.py `safe_load_from_bytes`), the real module imported when first called
        module.safe_load_from_bytes = _safe_load_from_bytes  # type: ignore[attr-defined]


def _safe_load_from_bytes(b: bytes) -> Any:
    """megatron.core.safe_globals.safe_load_from_bytes, the real module imported when called
    (the stand-in's finder is in place only while megatron-core is imported)."""
    sys.modules.pop(_SafeGlobalsStandIn.NAME, None)
    return importlib.import_module(_SafeGlobalsStandIn.NAME).safe_load_from_bytes(b)


SAFE_GLOBALS = _SafeGlobalsStandIn()  # in place only while megatron-core is imported


class _CalledLater(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stand in for a megatron module that imports DTensor without a fallback, until it is used.

    - megatron.core.transformer.fsdp_dtensor_checkpoint (0.15+): megatron's optimizer package
      imports two of its functions by name (optimizer/__init__.py `get_global_unique_param_name`,
      distrib_optimizer.py `handle_experts_in_state_dict`), and the module imports
      torch.distributed.checkpoint, and with it DTensor (~0.3 s). Both serve checkpoints only (a
      parameter-to-group map, expert names in a state dict).
    - megatron.core.dist_checkpointing.serialization (0.19 imports strategies/torch.py, and so
      torch.distributed.checkpoint, at its top): the package's __init__ imports its seven
      save/load entry points by name, and 0.19's megatron.core.utils imports the package at its
      own import (`from megatron.core.dist_checkpointing.mapping import ShardedTensor`). Nothing
      here saves or loads a checkpoint.

    The stand-in hands out, for the names it lists, functions that import the real module when
    first called and call it; any other name imports the real module at once and is its
    attribute. So whatever megatron calls runs megatron's own code.
    """

    def __init__(self, name: str, called_later: tuple[str, ...]) -> None:
        self.NAME = name
        self.CALLED_LATER = called_later
        self.real: ModuleType | None = None
        self.stepped_aside = False  # the real module is being, or has been, imported

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.NAME or self.stepped_aside:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        vars(module)["__getattr__"] = self._attribute  # PEP 562: names asked of the module

    def _attribute(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in self.CALLED_LATER:
            return getattr(self._load(), name)

        def called(*args: Any, **kwargs: Any) -> Any:
            return getattr(self._load(), name)(*args, **kwargs)

        called.__name__ = called.__qualname__ = name
        return called

    def _load(self) -> ModuleType:
        """Import the real module in the stand-in's place (sys.modules, its package's attribute)."""
        if self.real is None:
            self.stepped_aside = True
            sys.modules.pop(self.NAME, None)
            self.real = importlib.import_module(self.NAME)
        return self.real


_CALLED_LATER = _CalledLater(
    "megatron.core.transformer.fsdp_dtensor_checkpoint",
    ("get_global_unique_param_name", "handle_experts_in_state_dict"),
)
_SERIALIZATION = _CalledLater(
    "megatron.core.dist_checkpointing.serialization",
    ("load", "load_common_state_dict", "load_content_metadata", "load_plain_tensors",
     "load_tensors_metadata", "remove_sharded_tensors", "save"),
)  # fmt: skip


class _InitLater(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stand in for a package's __init__ until one of its names is asked for (PEP 562).

    0.19's pipeline_parallel/combined_1f1b.py imports megatron_fsdp.utils (`find_megatron_fsdp`,
    no DTensor), and with it the megatron_fsdp package, whose __init__ imports fully_shard.py and
    so DTensor. The stand-in is the package with its real folder (its submodules import as
    usual) and without its __init__'s imports: the first name asked of it that is not yet there
    (megatron's FSDP adapter asks for `MegatronFSDP`) runs the real __init__ in it first.
    """

    NAME = "megatron.core.distributed.fsdp.src.megatron_fsdp"

    def __init__(self) -> None:
        self.real: importlib.machinery.ModuleSpec | None = None

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.NAME or self.real is not None:
            return None
        self.real = importlib.machinery.PathFinder.find_spec(fullname, path)
        if self.real is None or self.real.loader is None:
            return self.real
        spec = importlib.util.spec_from_loader(
            fullname, self, origin=self.real.origin, is_package=True
        )
        assert spec is not None
        spec.submodule_search_locations = self.real.submodule_search_locations
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        def attribute(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            del vars(module)["__getattr__"]
            assert self.real is not None and self.real.loader is not None
            self.real.loader.exec_module(module)
            return getattr(module, name)

        vars(module)["__getattr__"] = attribute


_INIT_LATER = _InitLater()

# in place for the process: megatron may import these after its own import
FOR_THE_PROCESS = (_CALLED_LATER, _SERIALIZATION, _INIT_LATER)
