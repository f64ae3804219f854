"""Which agents were sent which prompt prefixes: one bounded prefix tree per model.

The tree is kept as its nodes' hash chain, as vLLM's prefix cache and llm-d's prefix
scorer keep theirs: the prompt is the request's messages as the engine will see them
(role, then content, in order), each message's content cut into blocks of
`block_chars` characters, and block i's key hashes its text with block i-1's key, so
one key stands for the whole path from the root and a flat dict is the tree. A node
holds the agents the router sent that prefix to.

The router has no tokenizer, so blocks are characters: 1,024 by default (256 tokens at
4 characters per token). A block never spans two turns, so a conversation's earlier
messages match whole whatever the size, and only a long message that shares its head
with another is matched to the block. Larger blocks cost less: an 8k-token prompt is
33 blocks, 119 µs per decision at 100 agents where 256 characters (129 blocks) took
198 µs (bench.decision, loaded 2-core machine; gates alone 65 µs). Python's string
hash is salted per process, which is fine here: the tree lives in one router and is
rebuilt from traffic after a restart.

Memory is bounded by `max_blocks` nodes per tree, least recently used first out. An
insert touches a path leaf first and root last, so a root shared by many prompts is
the most recent and leaves go first; a node whose parent was evicted is unreachable
(a match walks from the root) and ages out in turn. The default, 65,536 nodes of 1,024
characters, remembers 2^26 characters per model, the `max_tree_size` of SGLang's and
vLLM's routers; each node is about 300 bytes with a few agents, ~20 MB per model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any


def prompt_text(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """(role, content) of each turn the engine will see, in order.

    OpenAI chat `messages`, Anthropic's top-level `system` before its `messages`, a
    completions `prompt` (one `prompt` turn), and the Responses API's `instructions` (a
    system turn) before its `input` (a string is one user turn; a list holds chat-like
    items). Content parts contribute their text; what has no text (images, tool calls)
    adds nothing.
    """
    turns: list[tuple[str, str]] = []
    system = payload.get("system", payload.get("instructions"))
    if system is not None:
        turns.append(("system", _text(system)))
    messages = payload.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                turns.append((str(message.get("role")), _text(message.get("content"))))
    items = payload.get("input")
    if isinstance(items, str):
        turns.append(("user", items))
    elif isinstance(items, list):
        for item in items:
            if isinstance(item, dict) and "role" in item:
                turns.append((str(item["role"]), _text(item.get("content"))))
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        turns.append(("prompt", prompt))
    return turns


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def blocks(turns: Iterable[tuple[str, str]], block_chars: int) -> tuple[list[int], list[int]]:
    """The hash chain of the prompt's blocks, each turn's role folded into its first, and
    the characters of content up to the end of each block (what a match of that many
    blocks covers, so a match can be weighed against the whole prompt).

    A tuple's hash over (previous key, text) is the cheapest chain Python offers: 47 µs
    for an 8k-token prompt in 256-character blocks, where folding the string hashes
    into one integer by hand took 101 µs (loaded 2-core machine).
    """
    keys: list[int] = []
    ends: list[int] = []
    key = 0
    total = 0
    for role, content in turns:
        key = hash((key, role))
        if not content:
            keys.append(key)
            ends.append(total)
            continue
        for start in range(0, len(content), block_chars):
            text = content[start : start + block_chars]
            key = hash((key, text))
            keys.append(key)
            total += len(text)
            ends.append(total)
    return keys, ends


class PrefixTree:
    """One model's prefix tree: block key -> the agents that were sent that prefix.

    `held` counts the nodes each agent is in: the router's picture of how much of that
    agent's cache its remembered prompts fill, which places a prompt that matches
    nowhere (as SGLang's router sends it to the worker with the smallest tree).
    """

    __slots__ = ("_held", "_nodes")

    def __init__(self) -> None:
        self._nodes: OrderedDict[int, set[str]] = OrderedDict()
        self._held: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __repr__(self) -> str:
        agents = set().union(*self._nodes.values()) if self._nodes else set()
        return f"<PrefixTree {len(self._nodes)} nodes, {len(agents)} agents>"

    @property
    def held(self) -> dict[str, int]:
        """Peer ID -> how many remembered blocks name it (absent: none). Read only."""
        return self._held

    def match(self, keys: list[int]) -> dict[str, int]:
        """How many leading blocks of `keys` each agent was sent; absent agents: none.

        The walk narrows one set of agents block by block and stops when it is empty,
        so it costs about one dict lookup per matched block, not per agent.
        """
        nodes = self._nodes
        depth: dict[str, int] = {}
        live: set[str] | None = None
        matched = 0
        for key in keys:
            holders = nodes.get(key)
            if not holders:
                break
            if live is None:
                live = holders
            elif not holders >= live:
                for peer_id in live - holders:
                    depth[peer_id] = matched
                live = live & holders
                if not live:
                    break
            matched += 1
        for peer_id in live or ():
            depth[peer_id] = matched
        return depth

    def insert(self, keys: list[int], peer_id: str, max_blocks: int) -> None:
        """Record that `peer_id` was sent this prefix, then evict down to `max_blocks`."""
        nodes = self._nodes
        added = 0
        for key in reversed(keys):
            holders = nodes.get(key)
            if holders is None:
                nodes[key] = {peer_id}
                added += 1
            else:
                if peer_id not in holders:
                    holders.add(peer_id)
                    added += 1
                nodes.move_to_end(key)
        held = self._held
        held[peer_id] = held.get(peer_id, 0) + added
        while len(nodes) > max_blocks:
            for gone in nodes.popitem(last=False)[1]:
                left = held[gone] - 1
                if left:
                    held[gone] = left
                else:
                    del held[gone]

    def forget(self, peer_id: str) -> None:
        """Drop an agent that left: its engine's cache left with it."""
        nodes = self._nodes
        for key in [k for k, holders in nodes.items() if peer_id in holders]:
            holders = nodes[key]
            holders.discard(peer_id)
            if not holders:
                del nodes[key]
        self._held.pop(peer_id, None)
