"""Bash's variable assignments (the base class of Shell, over Expansion): `NAME=value`,
`NAME+=value`, arrays `NAME=(...)` and `NAME[i]=value`, `local`, within the caps of runtime.py.
"""

from __future__ import annotations

from inspector.inputs.bash.context import Unknown
from inspector.inputs.bash.expand import Expansion
from inspector.inputs.bash.runtime import MAX_ELEMENTS, MAX_VALUE, Value, as_array
from inspector.inputs.bash.syntax import Assign, CmdSub, part_types


class Assignments(Expansion):
    """Assign variables as bash does; Shell holds the variables and the local scopes."""

    locals: list[dict[str, Value | None]]

    def do_assign(self, assign: Assign, local: bool = False) -> None:
        self.line = assign.line or self.line
        if local:
            self.make_local(assign.name)
        if assign.array is not None:
            elements = [v for w in assign.array for v in self.expand_fields(w)]
            old = self.vars.get(assign.name) if assign.append else None
            base = as_array(old) if old is not None else {}
            start = max(base) + 1 if base else 0
            base.update({start + i: v for i, v in enumerate(elements)})
            if len(base) > MAX_ELEMENTS or sum(len(v) for v in base.values()) > MAX_VALUE:
                raise self.fail(f"the array {assign.name} grows past {MAX_ELEMENTS} elements "
                                f"or {MAX_VALUE} characters")  # fmt: skip
            self.vars[assign.name] = base
            return
        assert assign.value is not None
        value = self.expand_string(assign.value)
        if self.ctx.bash_value(value) is None and CmdSub in part_types(assign.value):
            given = self.ctx.settings.get(assign.name)
            value = given if given is not None else self._command_output(assign, value)
        if assign.index is not None:
            array = as_array(self.vars.get(assign.name, {}))
            index = self.index_of(assign.index)
            array[index] = (array.get(index, "") + value) if assign.append else value
            if len(array[index]) > MAX_VALUE or len(array) > MAX_VALUE:
                raise self.fail(f"the array {assign.name} grows past {MAX_VALUE} characters")
            self.vars[assign.name] = array
        elif assign.append:
            old = self.vars.get(assign.name)
            before = old.get(0, "") if isinstance(old, dict) else (old or "")
            self.assign(assign.name, before + value)
        else:
            self.assign(assign.name, value)

    def _command_output(self, assign: Assign, value: str) -> str:
        unknown = self.ctx.unknown_in(value)
        assert unknown is not None
        return self.ctx.mark(
            Unknown(f"${assign.name}",
                    f"set on line {self.line} from {unknown.text}, which the reader never runs",
                    assign.name)  # fmt: skip
        )

    def assign(self, name: str, value: str) -> None:
        if name == "IFS":
            raise self.fail("the script changes IFS; the reader splits words on blanks only")
        if len(value) > MAX_VALUE:
            raise self.fail(f"{name} grows past {MAX_VALUE} characters")
        self.ctx.copied.spend(len(value))
        old = self.vars.get(name)
        if isinstance(old, dict):
            old[0] = value
        else:
            self.vars[name] = value

    def assign_array(self, name: str, elements: dict[int, str]) -> None:
        self.vars[name] = elements

    def make_local(self, name: str) -> None:
        if self.locals and name not in self.locals[-1]:
            self.locals[-1][name] = self.vars.get(name)
