"""Read a Megatron-Bridge recipe function into the fields it sets, from its source, without running it.

Megatron-Bridge's recipes (src/megatron/bridge/perf_recipes/<family>/<gpu>/*.py, and the
recipes/ and training/ modules they call) are Python functions that build a ConfigContainer
statement by statement: `cfg = llama3_70b_pretrain_config()`, `cfg.model.tensor_model_parallel_size
= 4`, `_benchmark_common(cfg)`. Bridge cannot be imported here (it needs megatron-core, Transformer
Engine and CUDA), and nothing of it is executed: this module walks the functions' syntax trees
with a small evaluator of the statements they use (assignments, calls of Bridge's own functions
and dataclasses, `if`, `for` over literals, comparisons, getattr/hasattr/isinstance). A dataclass
instance is a `Record` of the fields Bridge's source gives it (class defaults, constructor
arguments, assignments); a class outside Bridge (megatron-core's TransformerConfig, torch) keeps
no defaults, so a field Bridge never sets is Megatron-LM's default. What the evaluator cannot
read raises `Unreadable` with the statement, so a recipe is never silently half-read.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge_eval import Evaluator, HFModel, Opaque, Record, Unreadable


@dataclass(frozen=True)
class Builtin:
    """One of Python's builtins the recipes call (len, isinstance, ...)."""

    name: str


@dataclass(frozen=True)
class _Function:
    module: str
    node: ast.FunctionDef


@dataclass(frozen=True)
class _Class:
    module: str
    node: ast.ClassDef


_PURE = {"len": len, "str": str, "int": int, "float": float, "bool": bool, "list": list,
         "dict": dict, "set": set, "tuple": tuple, "min": min, "max": max, "any": any, "all": all,
         "sorted": sorted, "range": range, "abs": abs}  # fmt: skip
# torch.cuda.get_device_capability() of the GPU a recipe folder names (NVIDIA's CUDA GPU compute
# capability table, developer.nvidia.com/cuda-gpus: H100 9.0, B200/GB200 10.0, B300/GB300 10.3);
# Bridge's DeepSeek-V4 recipes turn fused kernels on from it (deepseek_v4_bridge.py
# deepseek_v4_supports_blackwell_fused_kernels: `major >= 10`). A GPU not named here stays unread.
CAPABILITY = {"h100": (9, 0), "b200": (10, 0), "gb200": (10, 0), "b300": (10, 3),
              "gb300": (10, 3)}  # fmt: skip
# calls that only log or warn: nothing a recipe holds
_SILENT = ("print", "logger.", "logging.", "warnings.warn", "print_rank_0", "log.")


class Reader(Evaluator):
    """Evaluate Bridge's recipe functions from the source tree under `src` (…/src); statements
    and expressions are bridge_eval.Evaluator's."""

    def __init__(self, src: Path, core: Path | None = None) -> None:
        self.src = src
        self.gpu = ""  # the recipe's GPU (its folder): what torch.cuda answers
        self.modules: dict[str, dict[str, Any]] = {}
        self.defaults = _core_defaults(core) if core is not None else {}

    def core_default(self, name: str) -> Any:
        """Return megatron-core's default of a config field Bridge never sets (None if unknown)."""
        return self.defaults.get(name)

    # -- modules -------------------------------------------------------------------------------
    def path_of(self, module: str) -> Path | None:
        base = self.src.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def names(self, module: str) -> dict[str, Any]:
        """Return a module's top-level names: functions, classes, constants, imports (lazily)."""
        if module in self.modules:
            return self.modules[module]
        table: dict[str, Any] = {}
        self.modules[module] = table
        path = self.path_of(module)
        if path is None:
            return table
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.parse(path.read_text()).body:
            self._bind_top(node, module, package, table)
        return table

    def _bind_top(self, node: ast.stmt, module: str, package: str, table: dict[str, Any]) -> None:
        if isinstance(node, ast.FunctionDef):
            table[node.name] = _Function(module, node)
            # training/mixed_precision.py's `@register` puts a recipe in MIXED_PRECISION_RECIPES
            # under its name and its hyphenated name
            if any(ast.unparse(d) == "register" for d in node.decorator_list):
                registry = table.setdefault("__registered__", {})
                registry[node.name] = registry[node.name.replace("_", "-")] = table[node.name]
        elif isinstance(node, ast.ClassDef):
            table[node.name] = _Class(module, node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            self._bind_import(node, package, table)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    table[target.id] = ("lazy", module, node.value)
        elif isinstance(node, ast.If):  # `if TYPE_CHECKING:` / try-imports: bind both arms
            for inner in node.body + node.orelse:
                self._bind_top(inner, module, package, table)
        elif isinstance(node, ast.Try):
            for inner in node.body:
                self._bind_top(inner, module, package, table)

    def _bind_import(self, node: ast.Import | ast.ImportFrom, package: str,
                     table: dict[str, Any]) -> None:  # fmt: skip
        if isinstance(node, ast.Import):
            for alias in node.names:
                table[alias.asname or alias.name.split(".")[0]] = ("module", alias.name)
            return
        source = node.module or ""
        if node.level:
            parts = package.split(".")
            parts = parts[: len(parts) - node.level + 1]
            source = ".".join(parts + ([source] if source else []))
        for alias in node.names:
            table[alias.asname or alias.name] = ("from", source, alias.name)

    def module_attribute(self, module: str, name: str) -> Any:
        """Return `module.name`: Bridge's own, or an Opaque name from outside Bridge."""
        if self.path_of(module) is None:
            return Opaque(f"{module}.{name}")
        return self.lookup(module, name)

    def lookup(self, module: str, name: str) -> Any:
        """Return what `name` means at the top of `module`."""
        table = self.names(module)
        if name not in table:
            if name in _PURE or name in ("getattr", "hasattr", "isinstance", "setattr"):
                return Builtin(name)
            if name == "__file__":
                return Opaque("__file__")
            if name in ("None", "True", "False"):
                return {"None": None, "True": True, "False": False}[name]
            raise Unreadable(f"{module}: name {name!r} is not defined")
        entry = table[name]
        if isinstance(entry, tuple) and entry and entry[0] == "lazy":
            table[name] = self.expr(entry[2], {}, entry[1])
            if table[name] == {} and name.endswith("_RECIPES"):
                table[name] = dict(table.get("__registered__", {}))
            return table[name]
        if isinstance(entry, tuple) and entry and entry[0] == "from":
            source, attr = entry[1], entry[2]
            if self.path_of(f"{source}.{attr}") is not None:
                return ("module", f"{source}.{attr}")
            if self.path_of(source) is None:
                return Opaque(f"{source}.{attr}")
            table[name] = self.lookup(source, attr)
            return table[name]
        return entry

    # -- calls ---------------------------------------------------------------------------------
    def call_function(self, func: _Function, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Interpret a Bridge function's body with its arguments bound."""
        spec = func.node.args
        scope: dict[str, Any] = {}
        positional = spec.posonlyargs + spec.args
        defaults = [None] * (len(positional) - len(spec.defaults)) + list(spec.defaults)
        for i, arg in enumerate(positional):
            if i < len(args):
                scope[arg.arg] = args[i]
            elif arg.arg in kwargs:
                scope[arg.arg] = kwargs.pop(arg.arg)
            elif defaults[i] is not None:
                scope[arg.arg] = self.expr(defaults[i], {}, func.module)
            else:
                raise Unreadable(f"{func.node.name}: argument {arg.arg!r} not given")
        for arg, default in zip(spec.kwonlyargs, spec.kw_defaults):
            if arg.arg in kwargs:
                scope[arg.arg] = kwargs.pop(arg.arg)
            elif default is not None:
                scope[arg.arg] = self.expr(default, {}, func.module)
        if spec.kwarg is not None:
            scope[spec.kwarg.arg] = dict(kwargs)
        elif kwargs:
            raise Unreadable(f"{func.node.name}: unexpected arguments {sorted(kwargs)}")
        return self.run_body(func.node.body, scope, func.module)

    def construct(self, cls: _Class, args: list[Any], kwargs: dict[str, Any]) -> Record:
        """Return a Bridge dataclass instance: its fields' defaults, then the arguments."""
        record = Record(cls.node.name, self._bases(cls))
        self._defaults(cls, record)
        names = [n for n in self._field_names(cls)]
        for name, value in zip(names, args):
            record.fields[name] = value
        record.fields.update(kwargs)
        return record

    def _bases(self, cls: _Class) -> tuple[str, ...]:
        found: list[str] = []
        for base in cls.node.bases:
            name = ast.unparse(base).split("[")[0]
            found.append(name.split(".")[-1])
            target = self._resolve_quietly(cls.module, name)
            if isinstance(target, _Class):
                found.extend(self._bases(target))
        return tuple(found)

    def _resolve_quietly(self, module: str, dotted: str) -> Any:
        try:
            return self.lookup(module, dotted.split(".")[0]) if "." not in dotted else None
        except Unreadable:
            return None

    def _defaults(self, cls: _Class, record: Record) -> None:
        for base in reversed(cls.node.bases):
            target = self._resolve_quietly(cls.module, ast.unparse(base).split("[")[0])
            if isinstance(target, _Class):
                self._defaults(target, record)
        for node in cls.node.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
                try:
                    record.fields[node.target.id] = self._default_value(node.value, cls.module)
                except Unreadable:
                    record.fields[node.target.id] = Opaque(ast.unparse(node.value))

    def _default_value(self, node: ast.expr, module: str) -> Any:
        # dataclasses.field(default=X) / field(default_factory=F)
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "field":
            for kw in node.keywords:
                if kw.arg == "default":
                    return self.expr(kw.value, {}, module)
                if kw.arg == "default_factory":
                    return self.call(kw.value, [], {}, {}, module)
            return None
        return self.expr(node, {}, module)

    def _field_names(self, cls: _Class) -> list[str]:
        return [n.target.id for n in cls.node.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]  # fmt: skip

    def call(self, func_node: ast.expr, args: list[Any], kwargs: dict[str, Any],
             scope: dict[str, Any], module: str) -> Any:  # fmt: skip
        dotted = ast.unparse(func_node)
        if dotted.startswith(_SILENT):
            return None
        if isinstance(func_node, ast.Attribute):
            owner = self.expr(func_node.value, scope, module)
            return self._method(owner, func_node.attr, args, kwargs, dotted)
        target = self.expr(func_node, scope, module)
        return self.apply(target, args, kwargs, dotted)

    def apply(self, target: Any, args: list[Any], kwargs: dict[str, Any], dotted: str) -> Any:
        if isinstance(target, _Function):
            return self.call_function(target, args, dict(kwargs))
        if isinstance(target, _Class):
            return self.construct(target, args, kwargs)
        if isinstance(target, Builtin):
            return self._builtin(target.name, args, kwargs)
        if isinstance(target, Opaque):  # outside Bridge: a class keeps its arguments only
            last = target.name.split(".")[-1]
            if last[:1].isupper() and not args:  # a config class: its keyword arguments
                return Record(last, (), dict(kwargs))
            return Opaque(f"{target.name}()")
        raise Unreadable(f"call of {dotted}")

    def _method(self, owner: Any, name: str, args: list[Any], kwargs: dict[str, Any],
                dotted: str) -> Any:  # fmt: skip
        if isinstance(owner, tuple) and owner[:1] == ("module",):
            return self.apply(self.module_attribute(owner[1], name), args, kwargs, dotted)
        if isinstance(owner, _Class):  # a classmethod: AutoBridge.from_hf_pretrained
            if name == "from_hf_pretrained":
                return HFModel(str(args[0]))
            raise Unreadable(f"call of {dotted}")
        if isinstance(owner, HFModel) and name in ("get_model_config", "to_megatron_provider"):
            return Record("HFModelProvider", (), {"hf_id": owner.hf_id})
        if isinstance(owner, Opaque) and owner.name == "torch.cuda" and self.gpu in CAPABILITY:
            if name in ("is_available", "get_device_capability"):
                return True if name == "is_available" else CAPABILITY[self.gpu]
        if isinstance(owner, Opaque):
            if owner.name.endswith("AutoBridge") and name == "from_hf_pretrained":
                return HFModel(str(args[0]))
            return Opaque(f"{owner.name}.{name}()")
        if isinstance(owner, dict) and name in ("get", "update", "items", "keys", "values", "pop",
                                                "copy", "setdefault"):  # fmt: skip
            return getattr(owner, name)(*args, **kwargs)
        if isinstance(owner, (list, set)) and name in ("append", "extend", "add", "remove",
                                                       "copy", "index", "count"):  # fmt: skip
            return getattr(owner, name)(*args, **kwargs)
        if isinstance(owner, str) and name in ("format", "lower", "upper", "startswith", "endswith",
                                               "split", "rsplit", "join", "replace", "strip"):  # fmt: skip
            return getattr(owner, name)(*args, **kwargs)
        if isinstance(owner, Record) and name in owner.fields and isinstance(owner.fields[name],
                                                                            _Function):  # noqa
            return self.apply(owner.fields[name], args, kwargs, dotted)
        raise Unreadable(f"call of {dotted}")

    def _builtin(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        if name == "getattr":
            owner, attr = args[0], args[1]
            default = args[2] if len(args) > 2 else kwargs.get("default")
            if isinstance(owner, Record):
                return owner.fields.get(attr, default)
            return default
        if name == "hasattr":
            return isinstance(args[0], Record) and args[1] in args[0].fields
        if name == "setattr":
            if not isinstance(args[0], Record):
                raise Unreadable("setattr on a value outside Bridge")
            args[0].fields[args[1]] = args[2]
            return None
        if name == "isinstance":
            kinds = args[1] if isinstance(args[1], tuple) else (args[1],)
            return any(self._is_instance(args[0], kind) for kind in kinds)
        return _PURE[name](*args, **kwargs)

    def _is_instance(self, value: Any, kind: Any) -> bool:
        if isinstance(kind, _Class):
            return isinstance(value, Record) and value.is_a(kind.node.name)
        if isinstance(kind, Opaque):
            return isinstance(value, Record) and value.is_a(kind.name.split(".")[-1])
        if isinstance(kind, Builtin):
            return isinstance(value, _PURE[kind.name])
        raise Unreadable("isinstance of an unknown kind")


# megatron-core's config dataclasses, whose literal defaults a field Bridge never sets keeps
_CORE_CONFIGS = ("model_parallel_config.py", "transformer/transformer_config.py")


def _core_defaults(core: Path) -> dict[str, Any]:
    """Return the literal defaults of megatron-core's ModelParallelConfig and TransformerConfig."""
    found: dict[str, Any] = {}
    for name in _CORE_CONFIGS:
        for node in ast.walk(ast.parse((core / name).read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
                try:
                    found.setdefault(node.target.id, ast.literal_eval(node.value))
                except ValueError:
                    continue
    return found
