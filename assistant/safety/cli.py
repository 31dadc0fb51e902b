"""`assistant safety ...` and `assistant eval safety FILE.jsonl`.

  assistant safety train [--data FILE] [--seed 0]   retrain the heads, the probe, the tuned classifier and the
                                                     disclosure classifier (fixed seeds) into assistant/safety/models
                                                     [--only heads|probe|tuned|disclosure]
  assistant safety check TEXT [--where input]        the verdict and every detector's scores
  assistant safety policy CONVERSATION [NAME]        show or choose a conversation's policy ("default" resets)
  assistant safety audit [--conversation ID]         the newest audit rows
  assistant eval safety FILE.jsonl [--policy NAME]   catch rate per category, false positives, latency
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from assistant.commands import EVAL_HELP, command_group

DEFAULT_TRAIN = Path(__file__).resolve().parents[2] / "tests" / "data" / "safety_train.jsonl"


def register(subparsers: argparse._SubParsersAction, add_common) -> None:
    safety = subparsers.add_parser("safety", help="safety classifiers: train the head, check text, policies, audit")
    sub = safety.add_subparsers(dest="safety_command", required=True, metavar="ACTION")
    train = sub.add_parser("train", help="train the safety heads, the chat-model probe and the tuned classifier on "
                                         "the labelled set (reproducible; about 3 + 7 + 10 minutes on 2 vCPUs)")
    train.add_argument("--data", default=str(DEFAULT_TRAIN), help="labelled JSONL (default tests/data/safety_train.jsonl)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--out", default=None, help="head directory (default assistant/safety/models)")
    train.add_argument("--featurizer", default="minilm-l6-int8+e5-int8",  # head.DEFAULT_FEATURIZER, head.FEATURIZERS
                       choices=("minilm-l6-int8+e5-int8", "minilm-l6-int8", "minilm-l6"))
    train.add_argument("--layers", default=None, help="embedder hidden states to pool, comma-separated "
                       "(0 = embeddings, 6 = last; default: head.DEFAULT_LAYERS, 3,4,5,6)")
    train.add_argument("--only", choices=("heads", "tuned", "probe", "disclosure"), default=None,
                       help="train only the logistic heads (input stage), only the tuned classifier (passages), "
                            "only the probe on the chat model (the input stage's second opinion) or only the "
                            "disclosure classifier (answers revealing the assistant's instructions; its own data, "
                            "--disclosure-data)")
    train.add_argument("--disclosure-data", default=None,
                       help="labelled answers for the disclosure classifier (default "
                            "tests/data/safety_disclosure_train.jsonl)")
    train.add_argument("--c", type=float, default=None,
                       help="inverse regularisation of the logistic regression (default: head.DEFAULT_C)")
    add_common(train)
    train.set_defaults(func=_cmd_train)
    check = sub.add_parser("check", help="classify one text and show every score")
    check.add_argument("text")
    check.add_argument("--where", default="input", choices=("input", "retrieved", "tool", "output"))
    check.add_argument("--policy", default=None)
    add_common(check)
    check.set_defaults(func=_cmd_check)
    policy = sub.add_parser("policy", help="show or set the safety policy of a conversation")
    policy.add_argument("conversation")
    policy.add_argument("name", nargs="?", default=None, help="policy name; 'default' resets to the configured one")
    add_common(policy)
    policy.set_defaults(func=_cmd_policy)
    audit = sub.add_parser("audit", help="show the newest rows of the safety audit log")
    audit.add_argument("--conversation", default=None)
    audit.add_argument("--limit", type=int, default=20)
    add_common(audit)
    audit.set_defaults(func=_cmd_audit)

    ev = command_group(subparsers, "eval", EVAL_HELP).add_parser("safety", help="evaluate the safety guards on a labelled JSONL")
    ev.add_argument("file", help="JSONL rows: text, label (allow|block), optional category, where")
    ev.add_argument("--policy", default=None, help="policy to evaluate (default: the configured one)")
    ev.add_argument("--errors", type=int, default=15, help="mistakes to list")
    add_common(ev)
    ev.set_defaults(func=_cmd_eval)


def _layer(config, policy: str | None = None, *, store=None):
    from assistant.safety.layer import SafetyLayer

    if policy:
        config = replace(config, safety=replace(config.safety, policy=policy))
    return SafetyLayer.from_config(config, store)


def _single_thread() -> None:
    """The guard shares the CPU with the engine in `serve`; measure it the way it runs there."""
    import torch

    torch.set_num_threads(1)


def _cmd_train(args, config) -> int:
    from assistant.safety.evaluate import load_rows

    _single_thread()
    data = Path(args.data)
    rows = load_rows(data)
    trained_on = {"file": data.name, "sha256": hashlib.sha256(data.read_bytes()).hexdigest(), "rows": len(rows)}
    if args.only in (None, "heads"):
        status = _train_heads(args, rows, trained_on)
        if status:
            return status
    if args.only in (None, "probe"):
        _train_probe(args, config, rows, trained_on)
    if args.only in (None, "tuned"):
        _train_tuned(args, rows, trained_on)
    if args.only in (None, "disclosure"):
        _train_disclosure(args)
    return 0


def _train_disclosure(args) -> None:
    from assistant.safety.disclosure import DATA, DISCLOSURE_NAME, train_disclosure
    from assistant.safety.evaluate import load_rows
    from assistant.safety.head import HEAD_DIR, write_arrays

    data = Path(args.disclosure_data or DATA)
    started = time.perf_counter()
    arrays, card = train_disclosure(load_rows(data), seed=args.seed)
    card["trained_on"] = {"file": data.name, "sha256": hashlib.sha256(data.read_bytes()).hexdigest(),
                          "rows": card["num_answers"]}
    path = write_arrays(Path(args.out) if args.out else HEAD_DIR, DISCLOSURE_NAME, arrays, card)
    saved = json.loads(path.with_suffix(".json").read_text())
    print(f"{DISCLOSURE_NAME} ({card['model']}, C {card['C']}): trained on {card['num_answers']} answers "
          f"({card['num_examples']} windows) in {time.perf_counter() - started:.0f} s; saved {path} (version "
          f"{saved['version']}, sha256 {saved['sha256'][:16]}…)")
    print(f"  5-fold CV, answers read window by window (suggested threshold {card['suggested_threshold']}): " + "; ".join(
        f"{t}: catch {m['caught']:.1%} fp {m['false_positives']:.1%}" for t, m in card["cv5_answers_by_threshold"].items()))


def _train_probe(args, config, rows: list[dict], trained_on: dict) -> None:
    import torch
    from tqdm import tqdm

    from assistant.errors import ConfigError
    from assistant.safety.evaluate import load_rows
    from assistant.safety.head import HEAD_DIR, training_label
    from assistant.safety.probe import PROBE_EXTRA_DATA, PROBE_HEAD_NAME, load_probe_featurizer, train_probe

    started = time.perf_counter()
    torch.set_num_threads(max(1, os.cpu_count() or 1))  # faster; the features move only in their last bits
    extra = [Path(args.data).with_name(name) for name in PROBE_EXTRA_DATA]
    missing = [str(f) for f in extra if not f.is_file()]
    if missing:
        raise ConfigError(f"The probe also trains on the older held-out sets beside {args.data}; missing: "
                          f"{', '.join(missing)}.")
    rows = [*rows, *(r for f in extra for r in load_rows(f))]
    total = sum(r.get("where", "input") == "input" and training_label(r) is not None for r in rows)
    try:
        with tqdm(total=total, unit="message", desc="Reading messages with the chat model", file=sys.stderr,
                  disable=None) as bar:
            head, card = train_probe(rows, load_probe_featurizer(config.resolved_models_dir), seed=args.seed,
                                     progress=bar.update, **({} if args.c is None else {"c": args.c}))
    finally:
        _single_thread()
    card["trained_on"] = trained_on
    card["also_trained_on"] = [{"file": f.name, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()} for f in extra]
    path = head.save(Path(args.out) if args.out else HEAD_DIR, card=card, name=PROBE_HEAD_NAME)
    saved = json.loads(path.with_suffix(".json").read_text())
    print(f"{PROBE_HEAD_NAME} ({head.featurizer}; layers {','.join(map(str, head.layers))}, C {card['C']}): trained on "
          f"{card['num_rows']} user messages in {time.perf_counter() - started:.0f} s; saved {path} "
          f"(version {saved['version']}, sha256 {saved['sha256'][:16]}…)")
    rates = card["cv5_user_messages_by_threshold"].items()
    print("  5-fold CV, user messages: "
          + "; ".join(f"{t}: catch {m['catch_rate']:.1%} fp {m['false_positive_rate']:.1%}" for t, m in rates))


def _train_tuned(args, rows: list[dict], trained_on: dict) -> None:
    from tqdm import tqdm

    from assistant.safety import tuned
    from assistant.safety.head import HEAD_DIR, training_label

    kept = [(r["text"], label) for r in rows if (label := training_label(r)) is not None]
    started = time.perf_counter()
    with tqdm(total=tuned.num_steps(len(kept)), unit="batch", desc="Training the tuned classifier",
              file=sys.stderr, disable=None) as bar:
        arrays, card = tuned.train_tuned([t for t, _ in kept], [lab for _, lab in kept], seed=args.seed,
                                         progress=bar.update)
    card["trained_on"] = trained_on
    path = tuned.save(arrays, card, Path(args.out) if args.out else HEAD_DIR)
    saved = json.loads(path.with_suffix(".json").read_text())
    print(f"{tuned.NAME} (LoRA rank {card['rank']} on all-MiniLM-L6-v2; classes: {', '.join(card['classes'])}): "
          f"trained on {len(kept)} rows in {time.perf_counter() - started:.0f} s, losses by epoch "
          f"{card['epoch_losses']}; saved {path} (version {saved['version']}, sha256 {saved['sha256'][:16]}…)")


def _train_heads(args, rows: list[dict], trained_on: dict) -> int:
    from assistant.safety.head import HEAD_DIR, Featurizer, train_heads

    started = time.perf_counter()
    options: dict = {} if args.c is None else {"c": args.c}
    if args.layers:
        try:
            options["layers"] = tuple(int(k) for k in args.layers.split(","))
        except ValueError:
            print(f"Error: --layers {args.layers!r}: give hidden-state numbers such as 2,4,6.", file=sys.stderr)
            return 2
    trained = train_heads(rows, Featurizer(args.featurizer), seed=args.seed, **options)
    print(f"trained on {trained[0][2]['num_rows']} rows of {trained_on['file']} in {time.perf_counter() - started:.1f} s")
    for name, head, card in trained:
        card["trained_on"] = trained_on
        path = head.save(Path(args.out) if args.out else HEAD_DIR, card=card, name=name)
        saved = json.loads(path.with_suffix(".json").read_text())
        print(f"{name} ({head.featurizer}; classes: {', '.join(head.classes)}; layers "
              f"{','.join(map(str, head.layers))}, C {card['C']}): saved {path} (version {saved['version']}, "
              f"sha256 {saved['sha256'][:16]}…)")
        for key, what in (("cv5_by_threshold", "all rows"), ("cv5_user_messages_by_threshold", "user messages"),
                          ("cv5_user_messages_gated_by_threshold", "user messages, fast head on English")):
            if key in card:
                print(f"  5-fold CV, {what}: " + "; ".join(
                    f"{t}: catch {m['catch_rate']:.1%} fp {m['false_positive_rate']:.1%}" for t, m in card[key].items()))
    return 0


def _cmd_check(args, config) -> int:
    _single_thread()
    layer = _layer(config, args.policy)
    guard = layer.input_guard.for_conversation(None)
    started = time.perf_counter()
    verdict = guard.check(args.text, where=args.where) if args.where != "output" else None
    ms = (time.perf_counter() - started) * 1000
    for s in guard.scores(args.text):
        print(f"  {s.detector:<17} {s.category:<17} {s.score:.3f}")
    if verdict is not None:
        state = "allowed" if verdict.allowed and not verdict.category else ("warned" if verdict.allowed else "blocked")
        print(f"{state} ({ms:.1f} ms) policy={guard.policy.name} category={verdict.category or '-'} "
              f"score={verdict.score} threshold={verdict.threshold} detector={verdict.detector or '-'}")
        if verdict.reason:
            print(verdict.reason)
    return 0


def _cmd_policy(args, config) -> int:
    from assistant.store import Store

    store = Store(config.store_url)
    try:
        layer = _layer(config, store=store)
        if args.name:
            layer.set_policy(args.conversation, None if args.name == "default" else args.name)
        print(f"{args.conversation}: {layer.policy_of(args.conversation)} (available: {', '.join(layer.policy_names())})")
    finally:
        store.close()
    return 0


def _cmd_audit(args, config) -> int:
    from assistant.store import Store

    store = Store(config.store_url)
    try:
        rows = _layer(config, store=store).audit_log(args.conversation, args.limit)
    finally:
        store.close()
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created_at))
        print(f"{when} {r.conversation_id or '-':<32} {r.policy:<20} {r.stage:<9} {r.action:<6} {r.category:<18} "
              f"{r.score:.3f}/{r.threshold:.2f} {r.detector:<20} {r.excerpt_sha256[:16]}")
    if not rows:
        print("no audit rows")
    return 0


def _cmd_eval(args, config) -> int:
    from assistant.safety.evaluate import evaluate_rows, format_table, load_rows

    _single_thread()
    rows = load_rows(args.file)
    layer = _layer(config, args.policy)
    warm = layer.input_guard.for_conversation(None)
    warm.warm()  # load every model before timing
    for where in ("input", "retrieved"):
        warm.check("warm-up text", where=where)
    report = evaluate_rows(rows, layer)
    summary = report.summary()
    summary["policy"] = layer.policies.default.name
    print(format_table(summary, report, show_errors=args.errors))
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m assistant.safety ...`: the same commands without relying on installed entry points."""
    from assistant import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if "safety" not in sub.choices:
        register(sub, cli.add_common)
    args = parser.parse_args(argv)
    from assistant.errors import AssistantError

    try:
        return int(args.func(args, cli.load_config(args)) or 0)
    except AssistantError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
