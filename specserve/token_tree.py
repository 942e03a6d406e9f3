"""A static draft token tree (`speculative_token_tree`, vLLM's format): several candidates per
draft position, verified in one target pass.

A tree is a list of paths of child ranks, e.g. `[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]`:
`(0,)` is the drafter's best first token, `(1,)` its second best, `(0, 1)` the second best token
after `(0,)`. Nodes are kept in depth-first order (sorted paths): every parent comes before its
children, so the first `n` nodes of a tree are again a tree (how a smaller draft budget
truncates it), and the best-first chain comes first, so when it is accepted its KV is already
where a chain's would be.
On the wire a draft tree is flat: the node tokens plus, per node, the index of its parent
(-1 = the last verified token).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class TokenTree:
    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def parse(cls, spec: str | list | tuple) -> TokenTree:
        """From a list of paths (or its string form). Raises ValueError saying what is wrong."""
        hint = ("speculative_token_tree must be a list of paths of child ranks, e.g. "
                "[(0,), (1,), (0, 0)]: every path's parent path present, no duplicates")
        if isinstance(spec, str):
            try:
                spec = ast.literal_eval(spec)       # literals only: no code runs
            except (ValueError, SyntaxError):
                raise ValueError(f"{hint}; could not parse {spec!r} as a list") from None
        if not isinstance(spec, (list, tuple)) or not spec:
            raise ValueError(f"{hint}; got {spec!r}")
        paths = []
        for p in spec:
            if not isinstance(p, (list, tuple)) or not p or not all(
                    isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p):
                raise ValueError(f"{hint}; path {p!r} is not a non-empty tuple of ranks >= 0")
            paths.append(tuple(p))
        if len(set(paths)) != len(paths):
            raise ValueError(f"{hint}; a path appears twice")
        have = set(paths)
        for p in paths:
            if len(p) > 1 and p[:-1] not in have:
                raise ValueError(f"{hint}; path {p} has no parent path {p[:-1]}")
        return cls(tuple(sorted(paths)))

    @classmethod
    def chain(cls, k: int) -> TokenTree:
        return cls(tuple((0,) * d for d in range(1, k + 1)))

    def __len__(self) -> int:
        return len(self.paths)

    # cached: a drafter asks for these every step (frozen dataclasses allow cached_property)
    @cached_property
    def parents(self) -> list[int]:
        """Index of each node's parent, -1 for children of the root."""
        index = {p: i for i, p in enumerate(self.paths)}
        return [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]

    @cached_property
    def ranks(self) -> list[int]:
        return [p[-1] for p in self.paths]

    @property
    def depth(self) -> int:
        return max(map(len, self.paths), default=0)

    @cached_property
    def is_chain(self) -> bool:
        return self.paths == TokenTree.chain(len(self)).paths

    def truncated(self, n: int) -> TokenTree:
        """The first n nodes: still a tree, since parents come before their children."""
        if n >= len(self):
            return self
        return TokenTree(self.paths[:n])


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each node (children of the root: 1); parents precede children."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def ancestors(parents: list[int], i: int) -> list[int]:
    """Node i and its ancestors, root-most first."""
    chain = []
    while i >= 0:
        chain.append(i)
        i = parents[i]
    return chain[::-1]


def draft_paths(drafts: list[int], parents: list[int] | None) -> list[list[int]]:
    """The draft tokens before each verify row: none before row 0, and before the row after
    node i the tokens of node i's path (a chain's: its first i + 1 drafts)."""
    return [[]] + [[drafts[j] for j in ancestors(parents, i)] if parents is not None
                   else drafts[:i + 1] for i in range(len(drafts))]


def accepted_path(parents: list[int], drafts: list[int], emitted: list[int]) -> list[int]:
    """Indices of the draft nodes behind the accepted tokens `emitted[:-1]` (siblings carry
    distinct tokens, so the tokens name the path)."""
    path, cur = [], -1
    for tok in emitted[:-1]:
        cur = next(i for i, (p, d) in enumerate(zip(parents, drafts)) if p == cur and d == tok)
        path.append(cur)
    return path
