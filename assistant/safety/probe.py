"""The second opinion: a head on the packaged chat model's own hidden states, for the messages the
fast heads leave in doubt.

Design notes:
  * Why the chat model. The heads on small sentence embedders (assistant/safety/head.py) reach about
    93% caught at 4% blocked on held-out user messages, and each new writer's set finds the same
    kinds of misses: phishing and DDoS asked politely, threats worded as letters, requests in Dutch or
    Portuguese, look-alikes ("rats without poisoning the cat"). An instruction-tuned model reads
    intent: its middle layers separate harmful from harmless requests along a few directions, in
    every language it speaks. The packaged Qwen2.5-Coder-0.5B-Instruct is already on the machine.
  * Features: the hidden states after layers PROBE_LAYERS (6, 9, 12 of 24) of the message's own
    tokens (its first MAX_TOKENS), mean-pooled, side by side: (3 * 896,). They are read by the
    engine itself (assistant/engine/taps.py), from the int8 model that answers, while it prefills
    the turn: the message sits in the chat template after the system prompt, where the turn puts it.
  * Why from the turn's own prefill. Computed by a forward pass of its own (transformers, bfloat16,
    12 layers), the features cost 118 ms p50 / 160 ms p95 on one thread here; a short chat turn
    prefills in ~90 ms, so its first token waited ~165 ms more (+168% TTFT, bench/safety.py). The
    turn's prefill computes these very hidden states: tapped there they cost a few row sums, and the
    verdict is ready when the prompt is.
  * When the turn cannot lend them (a document turn on the large model, a remote engine, a model other
    than the packaged one, a check outside any turn: `/v1/moderations`, `eval safety`), the probe asks
    the packaged model itself: a one-token request with the same layout (system prompt, then the
    message), on the assistant's own small engine when it is this model (int8, CPU), else on an engine
    of its own (loaded on first use, ~0.5 GB). The head was trained on those same requests.
  * Measured on the held-out sets v1-v11 and "short" (2,501 user messages, no longer blind), the
    default policy's rule (head score in [0.02, 0.95): mean of head and probe >= 0.5), a probe trained
    on the training file alone: transformers' float32 features (fixed system line; layers 6+9+12 did
    as well as 9+15+21 for half the layers) 97.2% caught / 2.8% blocked, the engine's int8 features
    (per-row int8 activations) 97.3% / 2.6%; leave-one-set-out, training on the other sets too,
    98.2% / 2.2% for both. So the int8 model that answers reads intent as well as float32 does.
  * What precedes the message shifts its hidden states (cosine ~0.98 after one exchange): a probe
    trained on first messages alone, read after a benign exchange it had not seen, blocked 4.2%
    (98.7% caught). Trained with the message after PROBE_CONTEXTS in turn, 97.4% / 2.7% there and
    97.1% / 2.5% as first messages; so a later turn of a conversation can lend its prefill too.
  * The head itself is head.py's: multinomial logistic regression over benign and every input
    category, standardised features folded into one linear map, plain arrays plus a hashed JSON card,
    trained by `assistant safety train` (`--only probe`), never pickled.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from assistant.errors import ModelError

PROBE_MODEL = "qwen2.5-coder-0.5b"  # the packaged chat model (assistant/models/manifest.json)
PROBE_LAYERS = (6, 9, 12)  # hidden states read (of 24 layers)
PROBE_FEATURIZER = "qwen2.5-coder-0.5b-engine-int8-cpu"  # the engine that computes them (taps must match it)
PROBE_HEAD_NAME = "safety_probe"
HIDDEN = 896  # the 0.5B model's hidden size
MAX_TOKENS = 200  # of the message read
# The probe also learns from the held-out sets whose mistakes earlier sessions read (no longer blind,
# eleven different writers): leave-one-set-out over them, training on the rest, took the default
# policy's input stage from 97.2% caught / 2.8% blocked to 97.8% / 2.2% on the set left out. v12 and
# later stay held out. The heads (head.py) keep learning from the training file alone.
PROBE_EXTRA_DATA = ("safety_heldout.jsonl", "safety_heldout_short.jsonl", *(f"safety_heldout_v{n}.jsonl"
                                                                           for n in range(2, 12)))
IN_FLIGHT = 8  # requests a featurizer keeps in the engine at once (they are batched)
# What precedes the message when the probe learns it: nothing (a first message), or one of these benign
# exchanges, taking turns row by row. A message's hidden states depend on what came before it: a head
# trained on first messages alone, read after an exchange it had not seen, caught 98.7% but blocked 4.2%
# of the 2,501 held-out messages (2.6% as first messages).
PROBE_CONTEXTS: tuple[tuple[tuple[str, str], ...], ...] = (
    (),
    (("What's a good name for a cat?", "How about Miso, Pepper or Luna?"),),
    (("Can you explain what a hash table is?",
      "A hash table stores key-value pairs and finds a key by hashing it to a slot."),),
    (("Translate 'good morning' into French.", "Bonjour."), ("Thanks!", "You're welcome.")),
)


class ProbeFeaturizer:
    """Probe features of texts, computed by a LocalEngine running the packaged chat model."""

    name = PROBE_FEATURIZER

    def __init__(self, engine: Any, system_prompt: str | None = None) -> None:
        from assistant.config import DEFAULT_SYSTEM_PROMPT
        from assistant.engine.taps import tap_source

        if tap_source(engine) != PROBE_FEATURIZER:
            raise ModelError(f"The safety probe reads {PROBE_FEATURIZER}, not {tap_source(engine)}.")
        self.engine, self.system_prompt = engine, system_prompt or DEFAULT_SYSTEM_PROMPT

    def tap(self, text: str) -> Any:
        from assistant.engine.taps import HiddenTap

        return HiddenTap(text, PROBE_LAYERS, MAX_TOKENS, source=PROBE_FEATURIZER)

    def embed(self, texts: Sequence[str], progress: Callable[[int], Any] | None = None, *,
              contexts: Sequence[int] | None = None) -> np.ndarray:
        """(N, 896 * len(PROBE_LAYERS)) float32: one one-token request per text, IN_FLIGHT at a time
        (`progress(1)` after each). `contexts[i]`: the PROBE_CONTEXTS entry text i follows (default: none,
        a first message)."""
        from assistant.engine.base import SamplingParams

        out: list[np.ndarray] = []
        params = SamplingParams(max_tokens=1, temperature=0.0)
        for i in range(0, len(texts), IN_FLIGHT):
            batch = [(self.tap(t), t, contexts[j] if contexts is not None else 0)
                     for j, t in enumerate(texts[i:i + IN_FLIGHT], start=i)]
            streams = [self.engine.generate(self._prompt(t, PROBE_CONTEXTS[c]), params, tap=tap) for tap, t, c in batch]
            for (tap, text, _), stream in zip(batch, streams):
                for _ in stream:
                    pass
                features = tap.wait(60)
                if features is None:
                    raise ModelError(f"The safety probe could not read {text[:40]!r}: {tap.reason or 'timed out'}.")
                out.append(features)
                if progress is not None:
                    progress(1)
        return np.stack(out).astype(np.float32) if out else np.zeros((0, HIDDEN * len(PROBE_LAYERS)), np.float32)


    def _prompt(self, text: str, context: Sequence[tuple[str, str]]) -> list[dict]:
        messages = [{"role": "system", "content": self.system_prompt}]
        for question, answer in context:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return [*messages, {"role": "user", "content": text or " "}]


_SHARED: dict[str, ProbeFeaturizer] = {}
_SHARED_LOCK = threading.Lock()


def load_probe_featurizer(models_dir: Path) -> ProbeFeaturizer:
    """The featurizer of a models dir on an engine of its own, one per process (loading takes a few
    seconds and ~0.5 GB); an assistant whose engine runs the probe's model lends it instead
    (detectors.ProbeDetector.use_engine)."""
    key = str(Path(models_dir).resolve())
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = ProbeFeaturizer(_own_engine(Path(models_dir)))
        return _SHARED[key]


def _own_engine(models_dir: Path) -> Any:
    """The packaged chat model on its own LocalEngine, as the probe reads it: int8 on the CPU."""
    try:
        from assistant.config import AssistantConfig
        from assistant.engine.local import LocalEngine
        from assistant.engine.loading import load_model
    except ImportError as e:
        raise ModelError(f"The safety probe needs torch and transformers ({e.name} is missing): run `make setup`.") from e
    from assistant.models import prepared_path, resolve_model_name

    if prepared_path(resolve_model_name(PROBE_MODEL), models_dir) is None:
        raise ModelError(f"The safety probe reads the chat model {PROBE_MODEL}, which is not prepared in "
                         f"{models_dir}: run `assistant models prepare {PROBE_MODEL}` (or `make run`).")
    config = AssistantConfig.load(env={}, overrides={
        "models_dir": str(models_dir), "engine.model": PROBE_MODEL, "engine.device": "cpu", "engine.dtype": "float32",
        "engine.quantize": "int8", "engine.speculation": "off", "engine.large_model": "", "engine.draft_model": "",
        "engine.remote_url": "", "engine.kv_cache_mb": 128})
    return LocalEngine(load_model(config), config.engine)


def train_probe(rows: Sequence[dict], featurizer: Any, *, seed: int = 0, c: float = 0.03, folds: int = 5,
                progress: Callable[[int], Any] | None = None) -> tuple[Any, dict]:
    """Fit the probe head on the user messages of `rows` (as head.train_heads does: benign plus every
    input category): (head, card with the cross-validated catch and false positives by threshold)."""
    from assistant.safety.head import _fit, _folds, _harmful, _rates, training_label

    kept = [(r["text"], label) for r in rows
            if r.get("where", "input") == "input" and (label := training_label(r)) is not None]
    texts, labels = [t for t, _ in kept], np.array([lab for _, lab in kept])
    x = featurizer.embed(texts, progress, contexts=[i % len(PROBE_CONTEXTS) for i in range(len(texts))])

    def fit(xs: np.ndarray, y: np.ndarray) -> Any:
        return _fit(xs, y, c=c, seed=seed, featurizer=featurizer.name, layers=PROBE_LAYERS)

    cv_scores = np.zeros(len(texts))
    for train_idx, test_idx in _folds(folds, seed).split(x, labels):
        cv_scores[test_idx] = _harmful(fit(x[train_idx], labels[train_idx]), x[test_idx])
    card = {"seed": seed, "C": c, "standardised": True, "num_rows": len(texts), "model": PROBE_MODEL,
            "contexts": [list(map(list, context)) for context in PROBE_CONTEXTS],
            "class_counts": {str(k): int(v) for k, v in zip(*np.unique(labels, return_counts=True))},
            f"cv{folds}_user_messages_by_threshold": _rates(cv_scores, labels)}
    return fit(x, labels), card


def load_probe_head(directory: Path | None = None) -> Any:
    """The trained probe head (its arrays checked against the card's sha256)."""
    from assistant.safety.head import HEAD_DIR, SafetyHead, read_arrays

    arrays, card = read_arrays(Path(directory or HEAD_DIR), PROBE_HEAD_NAME, "safety probe")
    layers = tuple(int(k) for k in card.get("layers", ()))
    if card.get("featurizer") != PROBE_FEATURIZER or layers != PROBE_LAYERS or \
            arrays["weights"].shape[1] != HIDDEN * len(PROBE_LAYERS):
        raise ModelError(f"The safety probe in {directory or HEAD_DIR} was trained on other features "
                         f"({card.get('featurizer')}, layers {layers}): run `assistant safety train --only probe`.")
    return SafetyHead(tuple(card["classes"]), arrays["weights"], arrays["bias"], card["featurizer"], layers,
                      int(card.get("version", 1)), card)
