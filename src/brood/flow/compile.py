"""Compiling a valid `FlowSpec` into the `Machine` the executor runs, the same for the state
form and the equivalent DAG form.

Compiling reads the view the checks resolved (DAG inputs bound to their dependencies'
outputs, the implicit inputs added, input types, the flow inputs collected), so the
compiler is the checker of `brood.flow.check` plus `compile`, and `compile_spec` compiles
only a view the checks found no problem in.
"""

from __future__ import annotations

from brood.flow.check import Checker, raise_problems, view_from_spec
from brood.flow.guards import Condition
from brood.flow.machine import (
    AgentSettings,
    FlowParam,
    Machine,
    MachineForeach,
    MachineInput,
    MachineOutput,
    MachineState,
    MachineTransition,
    RunConfig,
)
from brood.flow.schema import MAX_TRANSITIONS, TRANSITIONS_PER_STATE, FlowSpec, Node, State

__all__ = ["compile_spec"]


def compile_spec(spec: FlowSpec) -> Machine:
    """The `Machine` of a spec, the same for the state form and the equivalent DAG form.

    Re-runs `check_spec` first and raises `InvalidSpec` listing every problem, so a spec
    built without `load_spec` cannot compile into a broken machine.
    """
    view = view_from_spec(spec)
    checker = _Compiler(view)
    raise_problems(f"(FlowSpec {spec.name!r})" if spec.name else "(FlowSpec)", checker.run())
    return checker.compile(spec)


class _Compiler(Checker):
    """The checker that can also build the machine, once `run` found no problem."""

    def compile(self, spec: FlowSpec) -> Machine:
        """The machine of a view that `run` found no problem in."""
        assert self.view.items is not None and not self.problems
        states: dict[str, MachineState] = {}
        for item in self.view.items:
            step = item.step
            assert step is not None and item.id is not None
            sub = self.view.subagents.get(step.subagent) if step.subagent else None
            prompt = step.prompt if step.prompt is not None else sub.prompt if sub else ""
            settings = AgentSettings(
                **{
                    key: getattr(step, key)
                    if getattr(step, key) is not None
                    else getattr(sub, key, None)
                    for key in ("model", "temperature", "max_tokens", "max_iterations")
                }
            )
            outputs = tuple(MachineOutput(name=o.name, type=o.type) for o in step.outputs)
            inputs = []
            for _, inp in item.inputs:
                source, _, output = (inp.from_ or "").partition(".")
                inputs.append(
                    MachineInput(
                        name=inp.name,
                        type=self._input_type(inp),
                        source=source or None,
                        output=output or None,
                        optional=inp.optional,
                    )
                )
            states[item.id] = MachineState(
                id=item.id,
                entry=item.entry,
                prompt=prompt,
                subagent=step.subagent,
                settings=settings,
                inputs=tuple(inputs),
                outputs=outputs,
                retries=step.retries,
                budget=step.budget,
                failure_policy=step.failure_policy or spec.run.failure_policy,
                foreach=MachineForeach(over=step.foreach.over, max=step.foreach.max)
                if step.foreach
                else None,
                max_entries=step.max_entries if isinstance(step, State) else 1,
                lifecycle=step.lifecycle,
                pool=step.pool,
            )
        transitions: list[MachineTransition] = []
        if self.view.form == "nodes":
            for item in self.view.items:
                assert isinstance(item.step, Node)
                transitions.extend(
                    MachineTransition(source=dep, target=item.step.id)
                    for dep in dict.fromkeys(item.step.depends_on)
                )
        else:
            for edge in self.view.edges:
                assert edge.transition is not None
                guard = edge.transition.when
                condition = (
                    Condition(output=guard.output, op=guard.op, path=guard.path, value=guard.value)
                    if guard is not None
                    else None
                )
                transitions.append(
                    MachineTransition(
                        source=edge.transition.from_, target=edge.transition.to, guard=condition
                    )
                )
        params = {
            name: FlowParam(name=name, type=kind, optional=optional)
            for name, (kind, optional, _) in self.params.items()
        }
        return Machine(
            name=spec.name,
            run=RunConfig(
                **spec.run.model_dump(exclude={"max_transitions"}),
                max_transitions=spec.run.max_transitions
                or min(TRANSITIONS_PER_STATE * len(states), MAX_TRANSITIONS),
            ),
            states=states,
            transitions=tuple(transitions),
            entry=tuple(s.id for s in states.values() if s.entry),
            params=params,
        )
