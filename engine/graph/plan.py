"""The memory plan: peak tensor bytes of a run, from shapes alone, before any compute.

It replays what the executor and the backward pass will hold, in their order:
each value from its step until its last use (inputs and outputs for the whole
run), values saved for backward until the backward pass releases their node,
gradients waiting at nodes, and the inputs' gradients. The engine's
MemoryTracker measures the same quantities while the run happens.
"""

from __future__ import annotations

from engine.dtypes import ITEMSIZE
from engine.graph.program import Program, Step
from engine.shapes import numel


def _slot_bytes(program: Program) -> list[int]:
    return [0 if m is None else numel(m.shape) * ITEMSIZE[m.dtype] for m in program.metas]


class _Ledger:
    """Live bytes per array; a slot's Tensor is one holder of its array while it lives."""

    def __init__(self, program: Program) -> None:
        self.nbytes = _slot_bytes(program)
        self.array = list(range(len(program.metas)))  # slot -> array id (detach aliases)
        self.holders = [0] * len(program.metas)  # per array
        self.refs = [0] * len(program.metas)  # per slot: references to its Tensor
        self.live = 0
        self.peak = 0

    def hold_array(self, array: int) -> None:
        if self.holders[array] == 0:
            self.live += self.nbytes[array]
            self.peak = max(self.peak, self.live)
        self.holders[array] += 1

    def drop_array(self, array: int) -> None:
        self.holders[array] -= 1
        if self.holders[array] == 0:
            self.live -= self.nbytes[array]

    def ref(self, slot: int) -> None:
        if self.refs[slot] == 0:
            self.hold_array(self.array[slot])
        self.refs[slot] += 1

    def unref(self, slot: int) -> None:
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self.drop_array(self.array[slot])

    def transient(self, nbytes: int) -> None:
        self.peak = max(self.peak, self.live + nbytes)


def _saved_slots(step: Step) -> set[int]:
    """The value slots whose Tensors a recorded step keeps for its backward (a variadic op's
    one argument name stands for all its operands)."""
    if step.op.variadic and any(i >= 0 for i in step.op.save_index):
        return {v for is_ref, v in step.args if is_ref}
    return {step.args[i][1] for i in step.op.save_index if i >= 0 and step.args[i][0]}


def plan_peak_bytes(program: Program) -> int:
    ledger = _Ledger(program)
    for slot in program.input_slots.values():
        ledger.ref(slot)  # the request holds its inputs for the whole run
    outputs = {slot for _, slot in program.outputs}
    producer: dict[int, Step] = {}
    recorded = not program.no_grad

    for step in program.steps:
        if step.op.returns_input:
            ledger.array[step.slot] = ledger.array[step.args[0][1]]
        ledger.ref(step.slot)
        if recorded and step.requires_grad:
            producer[step.slot] = step
            for s in _saved_slots(step):
                ledger.ref(s)
            if -1 in step.op.save_index:
                ledger.hold_array(ledger.array[step.slot])
        if step.slot in outputs:
            ledger.ref(step.slot)
        for s in step.frees:
            ledger.unref(s)

    if program.backward:
        _plan_backward(program, ledger, producer)
    return ledger.peak


def _plan_backward(program: Program, ledger: _Ledger, producer: dict[int, Step]) -> None:
    """Replay `engine.autograd.run_backward`: same roots, counts and ready order."""
    slots = dict(program.outputs)
    grad_of: dict[int, int] = {}  # node slot or leaf slot -> pending gradient bytes
    leaf_grads: set[int] = set()

    nbytes = ledger.nbytes

    def add_pending(key: int) -> None:
        if key not in grad_of:
            grad_of[key] = nbytes[key]
            ledger.live += grad_of[key]
            ledger.peak = max(ledger.peak, ledger.live)

    def deliver(leaf: int) -> None:
        if leaf in leaf_grads:
            ledger.transient(nbytes[leaf])  # old .grad and new sum exist together a moment
        else:
            leaf_grads.add(leaf)
            ledger.live += nbytes[leaf]
            ledger.peak = max(ledger.peak, ledger.live)

    roots = [slots[name] for name in program.roots]
    for slot in roots:
        add_pending(slot)
    roots = list(dict.fromkeys(roots))
    for slot in roots:
        if slot not in producer:
            ledger.live -= grad_of.pop(slot)
            deliver(slot)

    rg = program.requires_grad
    edge_cache: dict[int, list[int]] = {}

    def edges(step: Step) -> list[int]:
        found = edge_cache.get(step.slot)
        if found is None:
            mask = step.op.diff_mask
            found = edge_cache[step.slot] = [
                s for i, (is_ref, s) in enumerate(step.args)
                if is_ref and rg[s] and (mask is None or mask[i])
            ]
        return found

    deps: dict[int, int] = {}
    stack = [s for s in roots if s in producer]
    seen = set(stack)
    while stack:
        for s in edges(producer[stack.pop()]):
            if s in producer:
                deps[s] = deps.get(s, 0) + 1
                if s not in seen:
                    seen.add(s)
                    stack.append(s)

    ready = [s for s in roots if s in producer and deps.get(s, 0) == 0]
    while ready:
        slot = ready.pop()
        step = producer[slot]
        ledger.live -= grad_of.pop(slot)
        for s in _saved_slots(step):
            ledger.unref(s)
        if -1 in step.op.save_index:
            ledger.drop_array(ledger.array[slot])
        for s in edges(step):
            if s not in producer:
                deliver(s)
                continue
            add_pending(s)
            deps[s] -= 1
            if deps[s] == 0:
                ready.append(s)
    for name in program.grad_inputs:
        slot = program.input_slots[name]
        if slot not in leaf_grads:
            deliver(slot)  # an unused input gets zeros
