"""Statements and expressions of Megatron-Bridge's recipe functions, evaluated from their syntax.

The subset Bridge's recipes use: assignments to names, attributes, subscripts (and augmented
ones), calls, `if`/`elif`/`else`, `for` over known values, `return`, `assert` (skipped), literals,
f-strings, comparisons, boolean and arithmetic operators, comprehensions over known values.
Anything else raises `Unreadable` naming the statement (bridge_reader.py).
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass, field
from typing import Any


class Unreadable(Exception):
    """A statement or expression the evaluator does not read."""


class _Return(Exception):
    def __init__(self, value: Any) -> None:
        self.value = value


@dataclass
class Record:
    """A dataclass instance (or a class outside Bridge) as Bridge's source builds it."""

    kind: str  # class name
    bases: tuple[str, ...] = ()
    fields: dict[str, Any] = field(default_factory=dict)

    def is_a(self, name: str) -> bool:
        return name == self.kind or name in self.bases


@dataclass(frozen=True)
class HFModel:
    """`AutoBridge.from_hf_pretrained(ID)`: a model named by its Hugging Face id."""

    hf_id: str


@dataclass(frozen=True)
class Opaque:
    """A value from outside Bridge (torch.bfloat16, os.getcwd()): its dotted name."""

    name: str

    def __getitem__(self, key: Any) -> Opaque:  # an Enum's member by name: CudaGraphScope["attn"]
        return Opaque(f"{self.name}.{key}")


_BINOPS: dict[type, Any] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Div: operator.truediv, ast.Mod: operator.mod,
    ast.Pow: operator.pow, ast.BitOr: operator.or_,
}  # fmt: skip
_COMPARE: dict[type, Any] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}  # fmt: skip


class Evaluator:
    """Statements and expressions; the subclass resolves names (`lookup`) and calls (`call`)."""

    def lookup(self, module: str, name: str) -> Any:
        raise NotImplementedError

    def module_attribute(self, module: str, name: str) -> Any:
        raise NotImplementedError

    def core_default(self, name: str) -> Any:
        return None

    def call(self, func_node: ast.expr, args: list[Any], kwargs: dict[str, Any],
             scope: dict[str, Any], module: str) -> Any:  # fmt: skip
        raise NotImplementedError

    def run_body(self, body: list[ast.stmt], scope: dict[str, Any], module: str) -> Any:
        """Run a function body; return what it returns."""
        try:
            self.block(body, scope, module)
        except _Return as done:
            return done.value
        return None

    def block(self, body: list[ast.stmt], scope: dict[str, Any], module: str) -> None:
        for node in body:
            try:
                self.stmt(node, scope, module)
            except (TypeError, AttributeError) as error:  # a value from outside Bridge used as data
                raise Unreadable(f"{module} line {node.lineno}: {error}") from None

    def stmt(self, node: ast.stmt, scope: dict[str, Any], module: str) -> None:
        if isinstance(node, ast.Assign):
            value = self.expr(node.value, scope, module)
            for target in node.targets:
                self.assign(target, value, scope, module)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self.assign(node.target, self.expr(node.value, scope, module), scope, module)
        elif isinstance(node, ast.AugAssign):
            current = self.expr(_load(node.target), scope, module)
            value = _BINOPS[type(node.op)](current, self.expr(node.value, scope, module))
            self.assign(node.target, value, scope, module)
        elif isinstance(node, ast.Expr):
            if not isinstance(node.value, ast.Constant):  # a docstring
                self.expr(node.value, scope, module)
        elif isinstance(node, ast.Return):
            raise _Return(None if node.value is None else self.expr(node.value, scope, module))
        elif isinstance(node, ast.If):
            taken = node.body if self.expr(node.test, scope, module) else node.orelse
            self.block(taken, scope, module)
        elif isinstance(node, ast.For):
            for item in self.expr(node.iter, scope, module):
                self.assign(node.target, item, scope, module)
                self.block(node.body, scope, module)
        elif isinstance(node, ast.ImportFrom):  # an import inside a function
            for alias in node.names:
                scope[alias.asname or alias.name] = self.lookup(node.module or "", alias.name)
        elif isinstance(node, ast.Try):  # the body; on a Python error, the first handler
            try:
                self.block(node.body, scope, module)
            except (KeyError, AttributeError, ValueError, TypeError, IndexError):
                if not node.handlers:
                    raise
                self.block(node.handlers[0].body, scope, module)
        elif isinstance(node, (ast.Assert, ast.Pass, ast.Import)):
            pass
        elif isinstance(node, ast.Raise):
            raise Unreadable(f"the recipe raises: {ast.unparse(node)}")
        else:
            raise Unreadable(f"statement {ast.unparse(node)[:80]}")

    def assign(self, target: ast.expr, value: Any, scope: dict[str, Any], module: str) -> None:
        if isinstance(target, ast.Name):
            scope[target.id] = value
        elif isinstance(target, ast.Attribute):
            owner = self.expr(target.value, scope, module)
            if not isinstance(owner, Record):
                raise Unreadable(f"assignment to {ast.unparse(target)} (not a Bridge config)")
            owner.fields[target.attr] = value
        elif isinstance(target, ast.Subscript):
            owner = self.expr(target.value, scope, module)
            owner[self.expr(target.slice, scope, module)] = value
        elif isinstance(target, ast.Tuple):
            for item, part in zip(target.elts, value):
                self.assign(item, part, scope, module)
        else:
            raise Unreadable(f"assignment to {ast.unparse(target)}")

    def expr(self, node: ast.expr, scope: dict[str, Any], module: str) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return scope[node.id] if node.id in scope else self.lookup(module, node.id)
        if isinstance(node, ast.Attribute):
            return self.attribute(self.expr(node.value, scope, module), node.attr, node)
        if isinstance(node, ast.Call):
            args: list[Any] = []
            for arg in node.args:
                if isinstance(arg, ast.Starred):
                    args.extend(self.expr(arg.value, scope, module))
                else:
                    args.append(self.expr(arg, scope, module))
            kwargs: dict[str, Any] = {}
            for kw in node.keywords:
                value = self.expr(kw.value, scope, module)
                if kw.arg is None:
                    kwargs.update(value)
                else:
                    kwargs[kw.arg] = value
            return self.call(node.func, args, kwargs, scope, module)
        return self.compound(node, scope, module)

    def compound(self, node: ast.expr, scope: dict[str, Any], module: str) -> Any:
        def ev(item: ast.expr) -> Any:
            return self.expr(item, scope, module)

        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = [ev(e) for e in node.elts]
            return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
        if isinstance(node, ast.Dict):
            out: dict[Any, Any] = {}
            for key, value in zip(node.keys, node.values):
                if key is None:
                    out.update(ev(value))
                else:
                    out[ev(key)] = ev(value)
            return out
        if isinstance(node, ast.BoolOp):
            result: Any = None
            for value in node.values:
                result = ev(value)
                if isinstance(node.op, ast.And) != bool(result):
                    return result
            return result
        if isinstance(node, ast.UnaryOp):
            value = ev(node.operand)
            return {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos}[
                type(node.op)](value)
        if isinstance(node, ast.BinOp):
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Compare):
            left = ev(node.left)
            for op, right_node in zip(node.ops, node.comparators):
                right = ev(right_node)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            return ev(node.body) if ev(node.test) else ev(node.orelse)
        if isinstance(node, ast.Subscript):
            return ev(node.value)[ev(node.slice)]
        if isinstance(node, ast.Slice):
            return slice(*(None if p is None else ev(p) for p in (node.lower, node.upper, node.step)))
        if isinstance(node, ast.JoinedStr):
            return "".join(str(ev(v.value)) if isinstance(v, ast.FormattedValue) else str(v.value)
                           for v in node.values)  # fmt: skip
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            return self.comprehension(node, scope, module)
        raise Unreadable(f"expression {ast.unparse(node)[:80]}")

    def comprehension(self, node: Any, scope: dict[str, Any], module: str) -> Any:
        if len(node.generators) != 1:
            raise Unreadable(f"expression {ast.unparse(node)[:80]}")
        gen = node.generators[0]
        inner = dict(scope)
        out = []
        for item in self.expr(gen.iter, scope, module):
            self.assign(gen.target, item, inner, module)
            if all(self.expr(cond, inner, module) for cond in gen.ifs):
                out.append(self.expr(node.elt, inner, module))
        return set(out) if isinstance(node, ast.SetComp) else out

    def attribute(self, owner: Any, name: str, node: ast.expr) -> Any:
        if isinstance(owner, Record):
            if name not in owner.fields:  # a field Bridge never sets: megatron-core's default
                return self.core_default(name)
            return owner.fields[name]
        if isinstance(owner, tuple) and owner[:1] == ("module",):
            return self.module_attribute(owner[1], name)
        if isinstance(owner, Opaque):
            return Opaque(f"{owner.name}.{name}")
        if hasattr(owner, "node") and isinstance(owner.node, ast.ClassDef):  # Enum.MEMBER, class attr
            for item in owner.node.body:
                if isinstance(item, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id == name for t in item.targets):
                    return self.expr(item.value, {}, owner.module)
            return Opaque(f"{owner.node.name}.{name}")
        if isinstance(owner, str) and name in ("lower", "upper"):
            raise Unreadable(f"expression {ast.unparse(node)}")
        raise Unreadable(f"attribute {ast.unparse(node)[:80]}")


def _load(target: ast.expr) -> ast.expr:
    copy = ast.fix_missing_locations(ast.parse(ast.unparse(target), mode="eval").body)
    return copy
