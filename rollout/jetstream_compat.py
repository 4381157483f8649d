"""Make google-jetstream 0.2.2 importable on jax 0.10 without seqio / TensorFlow.

JetStream 0.2.2 (the newest release on PyPI; the project is archived) has three traps on a
modern stack (docs/design.md §6 Third-party notes):

1. ``jetstream.engine.token_utils`` imports ``seqio.vocabularies`` at module level, and every
   useful module (``engine_api``, ``orchestrator``, ``server_lib``) imports ``token_utils``.
   Real seqio drags in TensorFlow, so we register a tiny stub -- only when seqio is absent.
2. ``orchestrator.delete_pytree`` calls ``jax.tree_map``, removed from jax. Inside a Driver
   thread that AttributeError SIGKILLs the process. We alias it to ``jax.tree.map``.
3. Importing ``jetstream.core.orchestrator`` sets the root logger to DEBUG and attaches a
   stdout handler, which floods every log with JAX compile messages. We restore the previous
   root level and remove the handler it added.

Everything in this project imports JetStream through the helpers below, e.g.::

    from rollout.jetstream_compat import engine_api, orchestrator_module
    engine_api = engine_api()
"""

from __future__ import annotations

import abc
import logging
import sys
import types
from types import ModuleType

import jax

_INSTALLED = False
_ADAPTERS: dict[str, list[type]] = {"Engine": [], "Tokenizer": []}  # registered on JetStream's ABCs once loaded


def register_adapter(abc_name: str, cls: type) -> None:
    """Make ``cls`` a virtual subclass of JetStream's ``engine_api.Engine`` (``abc_name="Engine"``) or
    ``tokenizer_api.Tokenizer`` (``"Tokenizer"``) without importing JetStream: registered now when that
    module is loaded, else when :func:`engine_api` / :func:`tokenizer_api` first loads it. (The adapters
    implement the API themselves; the ABCs only make ``isinstance`` hold for JetStream's Driver.)"""
    _ADAPTERS[abc_name].append(cls)
    mod = sys.modules.get("jetstream.engine.engine_api" if abc_name == "Engine" else "jetstream.engine.tokenizer_api")
    if mod is not None:
        getattr(mod, abc_name).register(cls)


def _register_all(mod: ModuleType, abc_name: str) -> ModuleType:
    for cls in _ADAPTERS[abc_name]:
        getattr(mod, abc_name).register(cls)
    return mod


def install() -> None:
    """Apply the three compatibility fixes. Idempotent; cheap after the first call."""
    global _INSTALLED
    if _INSTALLED:
        return
    try:
        import seqio.vocabularies  # noqa: F401  (real seqio present: leave it alone)
    except ImportError:
        voc = types.ModuleType("seqio.vocabularies")

        class Vocabulary(abc.ABC):  # base class of jetstream.engine.mock_utils.TestVocab
            pass

        class SentencePieceVocabulary(Vocabulary):
            def __init__(self, *args, **kwargs):
                raise NotImplementedError(
                    "SentencePieceVocabulary needs the real seqio (TensorFlow); "
                    "jax-rl engines provide their own tokenizer via build_tokenizer()"
                )

        voc.Vocabulary = Vocabulary
        voc.SentencePieceVocabulary = SentencePieceVocabulary
        pkg = types.ModuleType("seqio")
        pkg.vocabularies = voc
        pkg.__path__ = []  # mark as a package so `import seqio.vocabularies` works
        sys.modules["seqio"] = pkg
        sys.modules["seqio.vocabularies"] = voc
    if not hasattr(jax, "tree_map"):
        jax.tree_map = jax.tree.map  # used by jetstream.core.orchestrator.delete_pytree
    _INSTALLED = True


def _import_orchestrator() -> ModuleType:
    """Import ``jetstream.core.orchestrator`` without leaving the root logger at DEBUG."""
    install()
    if "jetstream.core.orchestrator" in sys.modules:
        return sys.modules["jetstream.core.orchestrator"]
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    from jetstream.core import orchestrator

    root.setLevel(level)
    for h in list(root.handlers):
        if h not in handlers:  # the stdout DEBUG handler orchestrator.py attaches
            root.removeHandler(h)
    return orchestrator


def engine_api() -> ModuleType:
    """``jetstream.engine.engine_api`` (Engine, ResultTokens, SlotData)."""
    install()
    from jetstream.engine import engine_api as mod

    return _register_all(mod, "Engine")


def tokenizer_api() -> ModuleType:
    """``jetstream.engine.tokenizer_api`` (the Tokenizer ABC the Driver detokenizes with)."""
    install()
    from jetstream.engine import tokenizer_api as mod

    return _register_all(mod, "Tokenizer")


def tokenizer_pb2() -> ModuleType:
    """``jetstream.engine.tokenizer_pb2`` (TokenizerParameters)."""
    install()
    from jetstream.engine import tokenizer_pb2 as mod

    return mod


def token_utils() -> ModuleType:
    """``jetstream.engine.token_utils`` (pad_tokens, process_result_tokens)."""
    install()
    from jetstream.engine import token_utils as mod

    return mod


def orchestrator() -> ModuleType:
    """``jetstream.core.orchestrator`` (Driver, LLMOrchestrator), root logger level preserved."""
    return _import_orchestrator()


def server_lib() -> ModuleType:
    """``jetstream.core.server_lib`` (imports the orchestrator; root logger level preserved)."""
    _import_orchestrator()
    from jetstream.core import server_lib as mod

    return mod


def jetstream_pb2() -> ModuleType:
    """``jetstream.core.proto.jetstream_pb2`` (DecodeRequest / DecodeResponse)."""
    install()
    from jetstream.core.proto import jetstream_pb2 as mod

    return mod


def jetstream_pb2_grpc() -> ModuleType:
    """``jetstream.core.proto.jetstream_pb2_grpc`` (OrchestratorStub, servicer registration)."""
    install()
    from jetstream.core.proto import jetstream_pb2_grpc as mod

    return mod
