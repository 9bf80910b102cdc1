"""Draft trees: several candidate continuations verified in one pass (docs/architecture.md).

A chain loses everything after its first wrong draft. A tree holds several branches from
the last committed token (row 0): the top-layer heads' chain, the step-0 alternatives of
those heads (siblings of the chain's first draft), and a prompt-lookup copy. Branches are
merged as a trie: a branch that starts with tokens already in the tree reuses those rows.

Layout of a verification step (the engine's `make_meta(positions, slots=, paths=)`):
row i sits at position `pos0 + depth(i)`, writes its KV at slot `pos0 + i`, and attends
to the committed prefix [0, pos0) plus the slots of its own path (root first, itself
last). The C++ row attention visits those path keys in depth order with the chain's
arithmetic, so each tree row computes exactly what the chain row at its position would.

Verification walks the trie from the root: while the model's token after the current row
is the token of one of its children, that child is accepted. The accepted rows' KV is then
moved to consecutive slots (`Engine.move_kv`), so the cache is exactly a chain's.
"""

from __future__ import annotations

from collections.abc import Sequence

from .candidates import Source, source_label


class DraftTree:
    """Rows of one tree cycle: row 0 is the last committed token; rows are only appended,
    a parent always before its children, so paths are increasing in row index."""

    def __init__(self, root_token: int, width: int):
        self.width = width
        self.tokens = [root_token]
        self.kinds = [Source.MODEL]  # who drafted each row
        self.steps = [0]  # for head rows: which head / chain step
        self.q: list = [None]  # sampling (chains): the distribution each draft was drawn from
        self.parent = [-1]
        self.depth = [0]
        self.children: list[dict[int, int]] = [{}]
        # each row's expected acceptance as its drafter weighed it (the root: 1), what a
        # batch's budget compares across sequences (batch.py)
        self.value = [1.0]
        # rows a drafter added with its own probability that the row's path is the model's
        # (the heads' path probability): compared with what is accepted (calibration)
        self.predicted: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def room(self) -> int:
        return self.width - len(self.tokens)

    def label(self, row: int) -> str:
        """The stats label of a row's token (source_label)."""
        return source_label(self.kinds[row], self.steps[row])

    def add(self, parent: int, token: int, source: Source, step: int = 0, q=None,
            value: float = 0.0) -> int | None:
        """The row holding `token` under `parent`: an existing child, else a new row (None
        when the tree is full); `value`: its expected acceptance."""
        existing = self.children[parent].get(token)
        if existing is not None:
            return existing
        if self.room <= 0:
            return None
        row = len(self.tokens)
        self.tokens.append(token)
        self.kinds.append(Source(source))
        self.steps.append(step)
        self.q.append(q)
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.children.append({})
        self.children[parent][token] = row
        self.value.append(value)
        return row

    def add_branch(self, tokens: Sequence[int], source: Source, parent: int = 0,
                   stop_tokens: frozenset[int] | set[int] = frozenset()) -> list[int]:
        """Insert a chain of tokens under `parent` (merging with rows already there) until
        the tree is full or a stop token (EOS) was placed. Returns the branch's rows."""
        rows = []
        for token in tokens:
            row = self.add(parent, int(token), source)
            if row is None:
                break
            rows.append(row)
            parent = row
            if token in stop_tokens:
                break
        return rows

    def truncate(self, rows: int) -> None:
        """Keep the first `rows` rows (a parent always precedes its children, so what is
        kept is a tree)."""
        if rows >= len(self.tokens):
            return
        for name in ("tokens", "kinds", "steps", "q", "parent", "depth", "children", "value"):
            del getattr(self, name)[rows:]
        self.predicted = {r: p for r, p in self.predicted.items() if r < rows}
        for kids in self.children:
            for token in [t for t, r in kids.items() if r >= rows]:
                del kids[token]

    def path(self, row: int) -> list[int]:
        """Rows from the root to `row`, root first."""
        rows = []
        while row >= 0:
            rows.append(row)
            row = self.parent[row]
        return rows[::-1]

    def layout(self, pos0: int) -> tuple[list[int], list[int], list[list[int]]]:
        """(positions, KV slots, path slots) of every row, for `Engine.make_meta`."""
        positions = [pos0 + d for d in self.depth]
        slots = [pos0 + i for i in range(len(self.tokens))]
        paths = [[pos0 + r for r in self.path(i)] for i in range(len(self.tokens))]
        return positions, slots, paths

    @property
    def drafts(self) -> list[int]:
        """The tokens of every row but the root."""
        return self.tokens[1:]

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parent))

    def walk(self, model_tokens: Sequence[int]) -> list[int]:
        """Accepted rows (not the root): from the root, follow the child whose token is the
        model's token after the current row, while there is one."""
        accepted, row = [], 0
        while True:
            child = self.children[row].get(int(model_tokens[row]))
            if child is None:
                return accepted
            accepted.append(child)
            row = child
