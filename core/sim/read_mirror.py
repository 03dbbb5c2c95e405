"""A consumer of ``begin_step``'s deltas, and the oracle that checks them (V2).

An engine's worker keeps each request's read list between steps and patches it with what changed; this
class does exactly that, from ``StepRequest``'s ``rebuilt``, ``since``, ``evicted``, ``moved``,
``moved_slots``, ``joined`` and ``joined_slots`` alone, and ``check`` compares the result with the full lists the step computes from the token table.
The simulator checks it after every step and the fuzzer after every ``step`` rule: a delta that forgets an
eviction, or leaves out a token a relocation moved, reads wrong here before it reads wrong
K/V anywhere.
"""

from __future__ import annotations

from ..errors import InvariantViolation
from ..runtime import StepInputs
from ..token_table import NO_SLOT


class ReadListMirror:
    def __init__(self) -> None:
        self.lists: dict[object, tuple[list[int], list[int]]] = {}  # request -> (read tokens, read slots)
        self.versions: dict[object, int] = {}  # request -> the layout version its kept list is at

    def apply(self, inputs: StepInputs) -> None:
        """Patch every request's kept list with its delta (a request not in the step has left)."""
        for r in [r for r in self.lists if r not in inputs.requests]:
            del self.lists[r]
            del self.versions[r]
        for r, req in inputs.requests.items():
            if req.rebuilt:
                self.lists[r] = (list(req.read_tokens), list(req.read_slots))
                self.versions[r] = req.version
                continue
            if r not in self.lists:
                raise InvariantViolation("V2", f"step {inputs.iteration}: request {r!r} is new to the consumer but "
                                         f"its delta is not a full list (rebuilt is False)")
            if self.versions[r] != req.since:
                raise InvariantViolation("V2", f"step {inputs.iteration}: request {r!r}: a delta since layout version "
                                         f"{req.since}, the kept list is at {self.versions[r]}")
            self.versions[r] = req.version
            tokens, slots = self.lists[r]
            if req.moved:
                at = {t: i for i, t in enumerate(tokens)}
                slots = list(slots)
                for t, s in zip(req.moved, req.moved_slots):
                    if t not in at:
                        raise InvariantViolation("V2", f"step {inputs.iteration}: request {r!r}: moved token {t} is "
                                                 f"not in its read list")
                    slots[at[t]] = s
            if req.evicted:
                gone = set(req.evicted)
                kept = [i for i, t in enumerate(tokens) if t not in gone]
                if len(kept) != len(tokens) - len(gone):
                    raise InvariantViolation("V2", f"step {inputs.iteration}: request {r!r}: evicted tokens "
                                             f"{sorted(gone - set(tokens))[:8]} were not in its read list")
                tokens, slots = [tokens[i] for i in kept], [slots[i] for i in kept]
            joined = [(t, s) for t, s in zip(req.joined, req.joined_slots) if s != NO_SLOT]
            self.lists[r] = (tokens + [t for t, _ in joined], slots + [s for _, s in joined])

    def check(self, inputs: StepInputs) -> None:
        """The kept lists equal the step's full lists (V2); O(L), an oracle."""
        for r, req in inputs.requests.items():
            tokens, slots = self.lists[r]
            if tokens != req.read_tokens or slots != req.read_slots:
                i = next((i for i, (a, b) in enumerate(zip(zip(tokens, slots), zip(req.read_tokens, req.read_slots)))
                          if a != b), min(len(tokens), len(req.read_tokens)))
                raise InvariantViolation(
                    "V2", f"step {inputs.iteration}: request {r!r}: the read list patched from deltas differs from "
                    f"the table's at read index {i}: (token, slot) {list(zip(tokens, slots))[i:i + 1]} against "
                    f"{list(zip(req.read_tokens, req.read_slots))[i:i + 1]} (version {req.version}, "
                    f"{len(tokens)} against {len(req.read_tokens)} reads)")
