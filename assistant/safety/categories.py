"""The safety categories, and what a refusal says about each.

Input categories are what the input guard blocks (the user's message) or quarantines (retrieved and
tool text); output categories are what the output guard redacts or stops. Every refusal names its
category and tells the user what they can do instead: a refusal that only says "no" is a bug.
"""

from __future__ import annotations

INPUT_CATEGORIES = ("prompt_injection", "toxicity", "weapons", "malware", "self_harm", "drugs")
OUTPUT_CATEGORIES = ("secret", "pii", "system_prompt_leak", "toxicity")
BENIGN = "benign"

LABELS = {
    "prompt_injection": "prompt injection / jailbreak",
    "toxicity": "harassment, hate or toxicity",
    "weapons": "weapons or explosives",
    "malware": "malware or break-ins to systems",
    "self_harm": "self-harm",
    "drugs": "drug synthesis or trafficking",
    "secret": "secrets (keys, tokens, passwords)",
    "pii": "personal data (card numbers, emails, phone numbers)",
    "system_prompt_leak": "the assistant's instructions",
}

# What the user can do instead, one sentence per category.
ADVICE = {
    "prompt_injection": "Ask your question directly; instructions that try to change or reveal the assistant's rules "
                        "are not followed.",
    "toxicity": "Rephrase without insults or attacks on people or groups; for help with a conflict, describe what "
                "happened and what you want to achieve.",
    "weapons": "Questions about history, law, safe storage or how things work in general are fine; step-by-step "
               "instructions for making or misusing weapons are not given.",
    "malware": "Defensive questions are welcome: how an attack works in general, how to detect, patch or harden "
               "your own systems.",
    "self_harm": "If you are thinking about hurting yourself, please talk to someone now: call or text your local "
                 "emergency number or a crisis line (988 in the US, 116 123 in the UK and Ireland). "
                 "You can also ask me how to find support.",
    "drugs": "Questions about medication doses, effects, risks, harm reduction or the law are fine; synthesis, "
             "extraction or trafficking instructions are not given.",
}


def label(category: str) -> str:
    return LABELS.get(category, category or "unsafe content")


def refusal(category: str, *, policy: str = "") -> str:
    """The text a blocked user message gets as its answer."""
    advice = ADVICE.get(category, "Rephrase the request, or ask the administrator about the safety policy.")
    where = f" (policy '{policy}')" if policy else ""
    return f"I can't help with this request: it was flagged as {label(category)}{where}. {advice}"


def quarantine_notice(where: str, category: str) -> str:
    """What the user sees when retrieved or tool text was fenced as untrusted data."""
    return (f"Some {where} text looked like {label(category)}; it was kept, marked, and shown to the model only as "
            "data, never as instructions.")
