"""The second opinion: a head on the packaged chat model's own hidden states, for the messages the
fast heads leave in doubt.

Design notes:
  * Why the chat model. The heads on small sentence embedders (assistant/safety/head.py) reach about
    93% caught at 4% blocked on held-out user messages, and each new writer's set finds the same
    kinds of misses: phishing and DDoS asked politely, threats worded as letters, requests in Dutch or
    Portuguese, look-alikes ("rats without poisoning the cat"). An instruction-tuned model reads
    intent: its middle layers separate harmful from harmless requests along a few directions, in
    every language it speaks. The packaged Qwen2.5-Coder-0.5B-Instruct is already on the machine.
  * Features: the message in the model's chat template (a fixed system line, the message as the user
    turn, the assistant header after it), the first 12 of its 24 layers in bfloat16, the hidden states
    of layers PROBE_LAYERS mean-pooled over the message's own tokens (its first MAX_TOKENS), side by
    side: (3 * 896,). One text at a time, as in use.
  * Measured on the held-out sets v1-v11 and "short" (2,501 user messages, no longer blind), a head
    trained on tests/data/safety_train.jsonl alone, float32 features, at 0.6: layers 6+9+12 caught 96.2% and blocked
    2.2% (the production input stage then: 93.1% / 4.0%); 12+18 and 9+15+21 did no better for the
    layers they run. bfloat16 weights give the float32 features (cosine > 0.9999) at half the time;
    int8 dynamic quantisation, which serves MiniLM well, does not: one scale per activation tensor
    cannot hold this model's outlier channels (cosine 0.90-0.96, and the head fell to 88.5% / 5.4%).
  * Cost: 118 ms p50 / 160 ms p95 on one thread here for the messages bench/safety.py sends it (167 /
    234 ms on 40 longer ones), far over the 30 ms input budget for every message. So it is a *second opinion* (assistant/safety/guard.py): it runs
    only when the first head's top harmful score falls in the policy's doubt band, and the guard
    starts it beside the turn rather than before it: the turn's retrieval and the model's prefill go
    on while it reads, and nothing the model writes is shown (and no tool runs) until it has spoken
    (assistant/orchestrator.py `_gated`). A short chat turn prefills in ~90 ms here, so there the
    first token still comes ~165 ms later; `safety.second_opinion = false` turns it off.
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
PROBE_LAYERS = (6, 9, 12)  # hidden states read (the first 12 of 24 layers run)
PROBE_FEATURIZER = "qwen2.5-coder-0.5b-l12-bf16"
PROBE_HEAD_NAME = "safety_probe"
HIDDEN = 896  # the 0.5B model's hidden size
MAX_TOKENS = 200  # of the message read
# The probe also learns from the held-out sets whose mistakes earlier sessions read (no longer blind,
# eleven different writers): leave-one-set-out over them, training on the rest, took the default
# policy's input stage from 97.2% caught / 2.8% blocked to 97.8% / 2.2% on the set left out. v12 and
# later stay held out. The heads (head.py) keep learning from the training file alone.
PROBE_EXTRA_DATA = ("safety_heldout.jsonl", "safety_heldout_short.jsonl", *(f"safety_heldout_v{n}.jsonl"
                                                                           for n in range(2, 12)))
SYSTEM_LINE = "You are a helpful assistant."


class ProbeFeaturizer:
    """The packaged chat model's first layers → (N, 896 * len(PROBE_LAYERS)) features."""

    name = PROBE_FEATURIZER

    def __init__(self, models_dir: Path) -> None:
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from ingest.embed import _quiet_transformers
        except ImportError as e:
            raise ModelError(f"The safety probe needs torch and transformers ({e.name} is missing): run `make setup`."
                             ) from e
        from assistant.models import prepared_path, resolve_model_name

        path = prepared_path(resolve_model_name(PROBE_MODEL), models_dir)
        if path is None:
            raise ModelError(f"The safety probe reads the chat model {PROBE_MODEL}, which is not prepared in "
                             f"{models_dir}: run `assistant models prepare {PROBE_MODEL}` (or `make run`).")
        _quiet_transformers()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).model
        keep = max(PROBE_LAYERS)
        model.layers = model.layers[:keep]
        model.config.num_hidden_layers = keep
        model.norm = torch.nn.Identity()  # the last hidden state is read before any final norm
        self.model = model.to(torch.bfloat16).eval()
        template = self.tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM_LINE}, {"role": "user", "content": "\x00"}], tokenize=False,
            add_generation_prompt=True)
        before, after = template.split("\x00")
        self.before, self.after = self.tokenizer(before)["input_ids"], self.tokenizer(after)["input_ids"]
        self._torch = torch
        self._lock = threading.Lock()

    def embed(self, texts: Sequence[str], progress: Callable[[int], Any] | None = None) -> np.ndarray:
        """(N, 896 * len(PROBE_LAYERS)) float32, one forward pass per text (`progress(1)` after each)."""
        out = []
        for text in texts:
            out.append(self._one(text))
            if progress is not None:
                progress(1)
        return np.stack(out).astype(np.float32)

    def _one(self, text: str) -> np.ndarray:
        torch = self._torch
        body = self.tokenizer(text[: MAX_TOKENS * 8])["input_ids"][:MAX_TOKENS] or [self.after[0]]
        ids = torch.tensor([self.before + body + self.after])
        start, end = len(self.before), len(self.before) + len(body)
        with self._lock, torch.inference_mode():
            states = self.model(input_ids=ids, output_hidden_states=True).hidden_states
        return np.concatenate([states[k][0, start:end].float().mean(0).numpy() for k in PROBE_LAYERS])


_SHARED: dict[str, ProbeFeaturizer] = {}
_SHARED_LOCK = threading.Lock()


def load_probe_featurizer(models_dir: Path) -> ProbeFeaturizer:
    """One featurizer per models dir per process (loading takes a few seconds and ~450 MB)."""
    key = str(Path(models_dir).resolve())
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = ProbeFeaturizer(Path(models_dir))
        return _SHARED[key]


def train_probe(rows: Sequence[dict], featurizer: Any, *, seed: int = 0, c: float = 0.03, folds: int = 5,
                progress: Callable[[int], Any] | None = None) -> tuple[Any, dict]:
    """Fit the probe head on the user messages of `rows` (as head.train_heads does: benign plus every
    input category): (head, card with the cross-validated catch and false positives by threshold)."""
    from assistant.safety.head import _fit, _folds, _harmful, _rates, training_label

    kept = [(r["text"], label) for r in rows
            if r.get("where", "input") == "input" and (label := training_label(r)) is not None]
    texts, labels = [t for t, _ in kept], np.array([lab for _, lab in kept])
    x = featurizer.embed(texts, progress)

    def fit(xs: np.ndarray, y: np.ndarray) -> Any:
        return _fit(xs, y, c=c, seed=seed, featurizer=featurizer.name, layers=PROBE_LAYERS)

    cv_scores = np.zeros(len(texts))
    for train_idx, test_idx in _folds(folds, seed).split(x, labels):
        cv_scores[test_idx] = _harmful(fit(x[train_idx], labels[train_idx]), x[test_idx])
    card = {"seed": seed, "C": c, "standardised": True, "num_rows": len(texts), "model": PROBE_MODEL,
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
