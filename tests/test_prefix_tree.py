"""The prefix-aware strategy's memory: the prompt as the engine sees it, its block hash
chain, and the bounded per-model tree (insert, match, evict, forget)."""

from __future__ import annotations

from router.policy.prefix_tree import PrefixTree, blocks, prompt_text


def block_keys(turns: list[tuple[str, str]], block_chars: int) -> list[int]:
    return blocks(turns, block_chars)[0]


def chat(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


def test_the_prompt_is_every_turn_in_order_with_its_role() -> None:
    payload = chat(("system", "be brief"), ("user", "hi"), ("assistant", "hello"))
    assert prompt_text(payload) == [("system", "be brief"), ("user", "hi"), ("assistant", "hello")]


def test_anthropic_system_comes_first_and_content_parts_give_their_text() -> None:
    payload = {
        "system": [{"type": "text", "text": "rules"}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image", "source": {}},
                    {"type": "text", "text": "here"},
                ],
            }
        ],
    }
    assert prompt_text(payload) == [("system", "rules"), ("user", "look\nhere")]


def test_a_completions_prompt_is_one_turn() -> None:
    assert prompt_text({"prompt": "once upon"}) == [("prompt", "once upon")]


def test_responses_input_reads_like_chat_turns() -> None:
    assert prompt_text({"instructions": "rules", "input": "hi"}) == [
        ("system", "rules"),
        ("user", "hi"),
    ]
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "look"}]},
        {"type": "function_call", "name": "f", "arguments": "{}"},
        {"role": "assistant", "content": "seen"},
    ]
    assert prompt_text({"input": items}) == [("user", "look"), ("assistant", "seen")]


def test_hostile_shapes_add_nothing_instead_of_failing() -> None:
    payload = {"messages": ["x", 3, None, {"content": 7}], "prompt": ["a"], "system": 5}
    assert prompt_text(payload) == [("system", ""), ("None", "")]
    assert prompt_text({"messages": "not a list"}) == []


def test_keys_chain_so_a_shared_prefix_shares_its_leading_keys() -> None:
    first = block_keys([("system", "s" * 100), ("user", "question one")], 32)
    second = block_keys([("system", "s" * 100), ("user", "question two")], 32)
    # system: 4 blocks (32+32+32+4 characters, the role in the first); user: 1 block
    assert len(first) == len(second) == 5
    assert first[:4] == second[:4]
    assert first[4] != second[4]
    assert block_keys([("user", "")], 32) == block_keys([("user", "")], 32)
    assert len(block_keys([("user", ""), ("user", "")], 32)) == 2


def test_the_same_words_from_another_role_are_another_prefix() -> None:
    assert block_keys([("user", "abc")], 32)[-1] != block_keys([("assistant", "abc")], 32)[-1]


def test_match_counts_each_agents_leading_blocks() -> None:
    tree = PrefixTree()
    conversation = block_keys([("system", "s" * 64), ("user", "u" * 64)], 32)
    other = block_keys([("system", "s" * 64), ("user", "v" * 64)], 32)
    tree.insert(conversation, "A", 100)
    tree.insert(other, "B", 100)
    # Both were sent the system prompt (2 blocks); only A the user turn (2 more).
    assert tree.match(conversation) == {"A": 4, "B": 2}
    assert tree.match(other) == {"A": 2, "B": 4}
    assert tree.match(block_keys([("user", "u" * 64)], 32)) == {}
    assert tree.match([]) == {}


def test_memory_is_bounded_and_a_shared_root_outlives_the_leaves() -> None:
    tree = PrefixTree()
    system = ("system", "s" * 64)
    first = block_keys([system, ("user", "a" * 320)], 32)
    assert len(first) == 12
    tree.insert(first, "A", 12)
    second = block_keys([system, ("user", "b" * 160)], 32)
    tree.insert(second, "A", 12)
    # 12 + 5 new nodes, 5 evicted: the oldest are the first prompt's last blocks.
    assert len(tree) == 12
    assert tree.match(second) == {"A": len(second)}
    assert tree.match(first) == {"A": 7}
    for n in range(200):
        tree.insert(block_keys([("user", f"{n}" * 40)], 32), "B", 12)
        assert len(tree) <= 12


def test_a_single_node_tree_keeps_working() -> None:
    tree = PrefixTree()
    keys = block_keys([("user", "x" * 1000)], 16)
    tree.insert(keys, "A", 1)
    assert len(tree) == 1
    # The root was touched last, so it is the node kept.
    assert tree.match(keys) == {"A": 1}


def test_forgetting_an_agent_drops_it_and_the_nodes_only_it_held() -> None:
    tree = PrefixTree()
    shared = block_keys([("system", "s" * 64)], 32)
    mine = block_keys([("system", "s" * 64), ("user", "u" * 64)], 32)
    tree.insert(mine, "A", 100)
    tree.insert(shared, "B", 100)
    tree.forget("A")
    assert tree.match(mine) == {"B": len(shared)}
    assert len(tree) == len(shared)
    tree.forget("B")
    assert len(tree) == 0
    assert tree.match(mine) == {}


def test_each_block_ends_where_its_content_does() -> None:
    keys, ends = blocks([("system", "s" * 70), ("user", ""), ("user", "u" * 10)], 32)
    # 32 + 32 + 6 characters of system prompt, the empty turn's key, 10 of user.
    assert ends == [32, 64, 70, 70, 80]
    assert len(keys) == len(ends)
    assert blocks([], 32) == ([], [])
