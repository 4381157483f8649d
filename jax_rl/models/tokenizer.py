"""Tokenizers and the Qwen3 chat format.

Two tokenizers share one chat format:

* a real Qwen3 ``tokenizer.json`` loaded with the ``tokenizers`` library
  (``load_tokenizer(path)``; vocab 151,669 incl. the 26 added tokens from id 151643);
* :func:`compact_tokenizer`, a byte-level demo tokenizer built in code: ids 0..255 are the
  raw bytes, ids 256..281 are Qwen3's 26 special / added tokens in Qwen3's order
  (``<|endoftext|>`` 256, ``<|im_start|>`` 257, ``<|im_end|>`` 258, ...). Vocab 282 < 384
  (the ``tiny_*`` model presets' vocab_size);
* :func:`train_bpe_tokenizer`, a small byte-level BPE trained with the ``tokenizers`` library on
  a corpus (the runtime uses the environment's reference demonstrations on training seeds,
  ``model.tokenizer: bpe``). Whole words, whole numbers and operator runs become single
  tokens, so a from-scratch model sees ~3x shorter sequences than with ``compact``.

Chat rendering follows Qwen3's Hugging Face ``chat_template`` character for character
(system/user/assistant/tool roles, the ``# Tools`` system block with a ``<tools></tools>``
list, tool calls as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``,
consecutive tool results merged in one user turn of ``<tool_response>\\n...\\n</tool_response>``
blocks, Qwen3's thinking-history rules, and the generation prompt).

Tokenisation is done per *segment* rather than over the whole string: the text of every
assistant turn (content, tool calls and the closing ``<|im_end|>``) is encoded separately from
the surrounding template text. This is exactly the token stream a policy sees when it
generates turn by turn (prompt ids, then its own sampled ids, then the next turn's ids), so
an SFT example or an RL trajectory rendered here lines up token for token with what the
rollout engine generated. It differs from encoding the whole string in one go only when
BPE would merge across an assistant-turn boundary (e.g. content that starts with ``\\n``
merging with the header's ``\\n``); ``decode(ids)`` always equals the rendered text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = [
    "QWEN3_SPECIAL_TOKENS",
    "ChatTokenizer",
    "compact_tokenizer",
    "train_bpe_tokenizer",
    "BPE_SPLIT_PATTERN",
    "load_tokenizer",
    "render_chat_text",
    "format_tool_call",
    "TOOLS_HEADER",
    "TOOLS_FOOTER",
]

# Qwen3's added tokens, ids 151643..151668 in the real vocab (in this order).
QWEN3_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
# In Qwen3's tokenizer.json these are added tokens with special=false (they are still matched
# as whole tokens in text); the rest are special=true.
_NON_SPECIAL_ADDED = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)

Message = dict[str, Any]


def _tojson(x: Any) -> str:
    """transformers' ``tojson`` jinja filter: ``json.dumps(x, ensure_ascii=False)``."""
    return json.dumps(x, ensure_ascii=False)


def format_tool_call(tool_call: dict) -> str:
    """Qwen3 text of one tool call: ``<tool_call>\\n{"name": "N", "arguments": {...}}\\n</tool_call>``.

    ``tool_call`` is ``{name, arguments}`` or OpenAI style ``{function: {name, arguments}}``;
    string ``arguments`` are inserted verbatim, anything else through ``tojson``.
    """
    if tool_call.get("function"):
        tool_call = tool_call["function"]
    args = tool_call.get("arguments", {})
    args_s = args if isinstance(args, str) else _tojson(args)
    return '<tool_call>\n{"name": "' + str(tool_call["name"]) + '", "arguments": ' + args_s + "}\n</tool_call>"


def _is_tool_response_text(c: Any) -> bool:
    return isinstance(c, str) and c.startswith("<tool_response>") and c.endswith("</tool_response>")


def _system_block(msgs: list, tools: Optional[Sequence[dict]]) -> str:
    """The template's opening system turn: the tools header and schemas (after a leading system message's text)
    when there are tools, else the leading system message alone; ``""`` when neither."""
    if tools:
        out = "<|im_start|>system\n"
        if msgs and msgs[0]["role"] == "system":
            out += str(msgs[0].get("content") or "") + "\n\n"
        out += TOOLS_HEADER
        for t in tools:
            out += "\n" + _tojson(t)
        return out + TOOLS_FOOTER
    if msgs and msgs[0]["role"] == "system":
        return "<|im_start|>system\n" + str(msgs[0].get("content") or "") + "<|im_end|>\n"
    return ""


def _last_query_index(msgs: list) -> int:
    """Index of the last user message that is not a tool response (the template's ``last_query_index``; the
    last message's index when there is none): assistant turns after it keep their think block."""
    for index in range(len(msgs) - 1, -1, -1):
        c = msgs[index].get("content")
        if msgs[index]["role"] == "user" and isinstance(c, str) and not _is_tool_response_text(c):
            return index
    return len(msgs) - 1


def _assistant_body(m: Message, content: str, after_last_query: bool, is_last: bool, preserve_thinking: bool) -> str:
    """An assistant turn's generated text before its ``<|im_end|>``: the content (its ``<think>`` block kept only
    after the last query, for the last turn or one with reasoning; verbatim with ``preserve_thinking``), then
    each tool call."""
    if preserve_thinking:
        body = content
    else:
        rc = m.get("reasoning_content")
        if isinstance(rc, str):
            reasoning = rc
        else:
            reasoning = ""
            if "</think>" in content:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
        if after_last_query and (is_last or reasoning):
            body = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
        else:
            body = content
    for j, tc in enumerate(m.get("tool_calls") or []):
        if (j == 0 and content) or j > 0:
            body += "\n"
        body += format_tool_call(tc)
    return body


def _tool_response(msgs: list, i: int, content: str) -> str:
    """Tool message ``i`` as a ``<tool_response>`` inside one user turn shared by consecutive tool messages
    (opened by the first, closed by the last)."""
    out = ""
    if i == 0 or msgs[i - 1]["role"] != "tool":
        out += "<|im_start|>user"
    out += "\n<tool_response>\n" + content + "\n</tool_response>"
    if i == len(msgs) - 1 or msgs[i + 1]["role"] != "tool":
        out += "<|im_end|>\n"
    return out


def _render_segments(
    messages: Sequence[Message],
    tools: Optional[Sequence[dict]] = None,
    add_generation_prompt: bool = False,
    enable_thinking: Optional[bool] = None,
    preserve_thinking: bool = False,
) -> list[tuple[str, bool]]:
    """Qwen3 chat template as a list of ``(text, is_assistant_generated)`` segments.

    ``"".join(text)`` equals Hugging Face's ``apply_chat_template(..., tokenize=False)`` with the
    Qwen3 template (when ``preserve_thinking`` is False). Assistant segments hold what the
    policy generates: the turn body and its ``<|im_end|>`` (not the ``<|im_start|>assistant\\n``
    header, not the ``\\n`` after ``<|im_end|>``).

    ``preserve_thinking=True`` renders every assistant ``content`` verbatim (no stripping of
    ``<think>`` history, no inserted empty think block): the layout of a trajectory built turn by
    turn from generated tokens.
    """
    msgs = list(messages)
    segs: list[tuple[str, bool]] = []

    def emit(text: str, assistant: bool = False) -> None:
        if text:
            if segs and segs[-1][1] == assistant:
                segs[-1] = (segs[-1][0] + text, assistant)
            else:
                segs.append((text, assistant))

    for m in msgs:
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"unknown chat role {m.get('role')!r} (expected system|user|assistant|tool)")
    emit(_system_block(msgs, tools))
    last_query_index = _last_query_index(msgs)
    n = len(msgs)
    for i, m in enumerate(msgs):
        role = m["role"]
        content = m.get("content") if isinstance(m.get("content"), str) else ""
        if role == "user" or (role == "system" and i != 0):
            emit("<|im_start|>" + role + "\n" + content + "<|im_end|>\n")
        elif role == "assistant":
            emit("<|im_start|>assistant\n")
            emit(_assistant_body(m, content, i > last_query_index, i == n - 1, preserve_thinking) + "<|im_end|>", True)
            emit("\n")
        elif role == "tool":
            emit(_tool_response(msgs, i, content))
    if add_generation_prompt:
        emit("<|im_start|>assistant\n")
        if enable_thinking is False:
            emit("<think>\n\n</think>\n\n")
    return segs


def render_chat_text(messages: Sequence[Message], tools: Optional[Sequence[dict]] = None, **kw: Any) -> str:
    """The rendered chat string (Qwen3 template); keyword args as :meth:`ChatTokenizer.render_chat`."""
    return "".join(t for t, _ in _render_segments(messages, tools, **kw))


class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` plus the Qwen3 chat format.

    Attributes:
        tokenizer: the underlying ``tokenizers.Tokenizer``.
        name: ``"compact"`` or the loaded file's path.
        im_start_id, im_end_id: ids of ``<|im_start|>`` / ``<|im_end|>``.
        eos_id: id of ``<|endoftext|>`` (document end; also used as ``pad_id``).
        stop_ids: ``(im_end_id, eos_id)``: generation of a turn stops on either.
        vocab_size: number of ids incl. added tokens (model vocab may be larger).
    """

    def __init__(self, tokenizer: Tokenizer, name: str = "tokenizer") -> None:
        self.tokenizer = tokenizer
        self.name = name
        ids = {}
        for tok in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                    "<tool_response>", "</tool_response>", "<think>", "</think>"):
            i = tokenizer.token_to_id(tok)
            if i is None:
                raise ValueError(f"tokenizer {name!r} lacks the Qwen3 token {tok!r}")
            ids[tok] = i
        self.special_ids: dict[str, int] = ids
        self.im_start_id: int = ids["<|im_start|>"]
        self.im_end_id: int = ids["<|im_end|>"]
        self.eos_id: int = ids["<|endoftext|>"]
        self.pad_id: int = ids["<|endoftext|>"]
        self.tool_call_id: int = ids["<tool_call>"]
        self.tool_call_end_id: int = ids["</tool_call>"]
        self.stop_ids: tuple[int, ...] = (self.im_end_id, self.eos_id)
        self._newline_ids = self.encode("\n")

    # ------------------------------------------------------------------ basic
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added; special tokens in the text are matched)."""
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens are kept unless ``skip_special_tokens``."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.tokenizer.token_to_id(token)

    def save(self, path: Union[str, os.PathLike]) -> Path:
        """Write the ``tokenizer.json`` (loadable with :func:`load_tokenizer`); returns its path."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(p))
        return p

    # ------------------------------------------------------------------ chat
    def render_chat(
        self,
        messages: Sequence[Message],
        tools: Optional[Sequence[dict]] = None,
        add_generation_prompt: bool = False,
        *,
        enable_thinking: Optional[bool] = None,
        preserve_thinking: bool = False,
    ) -> tuple[list[int], list[bool]]:
        """Render and tokenise a chat with the Qwen3 template.

        Args:
            messages: dicts ``{role: system|user|assistant|tool, content: str,
                tool_calls?: [{name, arguments}], reasoning_content?: str}``.
            tools: JSON tool schemas (``{"type": "function", "function": {...}}``), listed in the
                system turn's ``<tools></tools>`` block.
            add_generation_prompt: append ``<|im_start|>assistant\\n``.
            enable_thinking: ``False`` appends Qwen3's empty ``<think>\\n\\n</think>\\n\\n`` after the
                generation prompt (as the HF template does).
            preserve_thinking: render assistant contents verbatim (no think-history rewriting); the
                layout of turn-by-turn generated trajectories.

        Returns:
            ``(ids, assistant_mask)``: two lists of equal length T. ``assistant_mask[t]`` is True
            exactly on tokens of assistant turn bodies incl. their ``<|im_end|>`` (what a policy
            generates), False on headers, the ``\\n`` after ``<|im_end|>``, system/user/tool turns
            and the generation prompt.

        Raises:
            ValueError: unknown role.
        """
        segs = _render_segments(messages, tools, add_generation_prompt, enable_thinking, preserve_thinking)
        ids: list[int] = []
        mask: list[bool] = []
        for text, is_asst in segs:
            t = self.encode(text)
            ids.extend(t)
            mask.extend([is_asst] * len(t))
        return ids, mask

    def render_text(self, messages: Sequence[Message], tools: Optional[Sequence[dict]] = None, **kw: Any) -> str:
        """The rendered chat string (see :meth:`render_chat` for the arguments)."""
        return render_chat_text(messages, tools, **kw)

    def tool_turn_ids(self, observations: Sequence[str], add_generation_prompt: bool = True) -> list[int]:
        """Ids that follow an assistant turn's ``<|im_end|>`` when tools answered it.

        ``"\\n"`` + one user turn with a ``<tool_response>`` block per observation
        (+ ``<|im_start|>assistant\\n``). Equal to the template's rendering of
        consecutive ``tool`` messages after an assistant turn.
        """
        text = "\n"
        if observations:
            text += "<|im_start|>user"
            for obs in observations:
                text += "\n<tool_response>\n" + obs + "\n</tool_response>"
            text += "<|im_end|>\n"
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text)

    def user_turn_ids(self, content: str, add_generation_prompt: bool = True) -> list[int]:
        """Ids that follow an assistant ``<|im_end|>`` for a new user message (``"\\n"`` + turn)."""
        text = "\n<|im_start|>user\n" + content + "<|im_end|>\n"
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text)

    def __repr__(self) -> str:
        return f"ChatTokenizer({self.name!r}, vocab_size={self.vocab_size})"


# ---------------------------------------------------------------------- compact


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode char map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def compact_tokenizer() -> ChatTokenizer:
    """Byte-level demo tokenizer: id = byte value (0..255), then Qwen3's 26 added tokens (256..281).

    Built in code (no file). Every UTF-8 string encodes (one id per byte) and decodes back
    exactly. ``vocab_size`` 282.
    """
    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=t not in _NON_SPECIAL_ADDED, normalized=False) for t in QWEN3_SPECIAL_TOKENS]
    )
    for i, t in enumerate(QWEN3_SPECIAL_TOKENS):
        assert tok.token_to_id(t) == 256 + i, (t, tok.token_to_id(t))
    return ChatTokenizer(tok, name="compact")


# Pre-tokenisation of :func:`train_bpe_tokenizer`: digit runs alone (so "15" in a question and
# "15" in a tool call's JSON string are the same token), words with their leading space, runs of
# other symbols with an optional space on either side (" - ", '": "'), and whitespace runs.
# The alternatives cover every character, so every string encodes.
BPE_SPLIT_PATTERN = r"\d+| ?[A-Za-z]+| ?[^\sA-Za-z\d]+ ?|\s+"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2,
                        name: str = "bpe") -> ChatTokenizer:
    """Train a byte-level BPE on ``texts`` with ``tokenizers.trainers.BpeTrainer``.

    Pre-tokenisation splits with :data:`BPE_SPLIT_PATTERN`, then maps bytes to GPT-2's
    byte-level alphabet (all 256 bytes are in the initial alphabet, so any UTF-8 string encodes
    and ``decode(encode(s)) == s``). Qwen3's 26 added tokens get ids 0..25 and are matched whole.
    Training is deterministic: the same texts and arguments give the same vocabulary and merges.

    Args:
        texts: the corpus (e.g. rendered chat transcripts).
        vocab_size: upper bound on the vocabulary incl. the 256 byte tokens and 26 added tokens;
            training stops earlier when no pair occurs ``min_frequency`` times.
        min_frequency: minimum count of a pair to be merged.
        name: the returned tokenizer's ``name``.

    Returns:
        A :class:`ChatTokenizer` with ``vocab_size <= vocab_size``.

    Raises:
        ValueError: ``vocab_size`` < 282 (bytes + added tokens).
    """
    floor = 256 + len(QWEN3_SPECIAL_TOKENS)
    if vocab_size < floor:
        raise ValueError(f"vocab_size={vocab_size} is below {floor} (256 bytes + {len(QWEN3_SPECIAL_TOKENS)} added tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(BPE_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[AddedToken(t, special=t not in _NON_SPECIAL_ADDED, normalized=False)
                        for t in QWEN3_SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return ChatTokenizer(tok, name=name)


def load_tokenizer(name_or_path: Union[str, os.PathLike] = "compact") -> ChatTokenizer:
    """``"compact"`` -> :func:`compact_tokenizer`; else a ``tokenizer.json`` file or a dir holding one.

    Raises:
        FileNotFoundError: no tokenizer.json at that path.
        ValueError: the file is not a ``tokenizers`` tokenizer.json (message naming it), or the
            tokenizer lacks Qwen3's chat tokens.
    """
    if str(name_or_path) == "compact":
        return compact_tokenizer()
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {name_or_path!s} (expected 'compact', a tokenizer.json or a dir holding one)")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises a bare Exception for bad JSON / a bad schema
        raise ValueError(f"{p} is not a tokenizer.json ({' '.join(str(e).split())})") from None
    return ChatTokenizer(tok, name=str(p))
