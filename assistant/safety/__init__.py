"""Safety classifiers wrapping both ends of every turn: offline, policy-driven, measured (issue #15).

  categories.py  the categories and what a refusal tells the user
  pinned.py      sha256 pins of the packaged classifiers' files, checked before anything is unpickled
  detectors.py   prompt_guardrail, profanity, nanoguard and our `head`: text -> scores
  head.py        the head we train on all-MiniLM-L6-v2 embeddings (`assistant safety train`)
  policy.py      TOML policies (policies/*.toml): stages, detectors, thresholds, actions
  guard.py       SafetyGuard: the InputGuard seam (user messages, retrieved and tool text)
  redact.py      secret / card / email / phone / system-prompt-leak patterns
  output.py      OutputGuard: the StreamTransformer that redacts and stops the answer in windows
  audit.py       audit rows and per-conversation policy choices in the store's database
  layer.py       SafetyLayer: what build_assistant wires, and the `assistant.safety` facade
  evaluate.py    `assistant eval safety FILE.jsonl`;  cli.py: `assistant safety ...`

Nothing here imports torch, sklearn or the classifier packages at import time: every model loads on
first use, so the core imports without them.
"""
