"""Patterns for what an answer must not carry: secrets, card numbers, private emails and phone
numbers, and verbatim pieces of the system prompt.

These are rules on purpose: a key has a format, a card number has a checksum (Luhn), and a verbatim
leak of the system prompt is a copy; a classifier would only blur that. (A leak in other words is the
output stage's `disclosure` classifier's, assistant/safety/disclosure.py.) Each finding is a span with
its category and kind; `redact()` replaces the spans with a marker such as `[redacted: api key]`.
Kept deliberately strict, so documentation placeholders (`sk-...`, `help@example.com`, version
numbers, hashes, dates, ISBNs, IP addresses) pass.

Documentation placeholders in a secret's place pass too (`placeholder()`): a value that says so
(`EXAMPLE`, `your_`, `changeme`, `<token>`, `${VAR}`), is masked (`XXXX`, `***`, `...`), is one
capitalised word (`USER:PASSWORD@`, `YOUR_API_KEY`), or has too few distinct characters to be random
(`sk-aaaaaaaaaaaaaaaaaaaa`). AWS's documented sample pair (`AKIAIOSFODNN7EXAMPLE`) is such a value.
A real key has none of these marks, so recall on real-looking keys is unchanged. So do a value that is
the code reading the secret (`os.environ["KEY"]`) and telephone numbers reserved for fiction
(`FICTIONAL_PHONE`: 555, Ofcom's drama ranges), and so are a reference to where a secret is kept
(`var.db_password`, `secrets.TOKEN`), a login that repeats its user (`postgres:postgres@`), values public
by nature (an SSH public key, a Bitcoin address: `PUBLIC_VALUE`), numbers that cannot be anyone's
(all zeros), organisations' lines (a number just after "switchboard", "hotline", "customer service":
`ORGANISATION_LINE`) and noreply addresses. Card numbers are redacted whenever they pass Luhn, except
a network's or processor's published test number in an answer about testing (`TEST_CARDS`,
`TEST_CONTEXT`; "the card on file is 4111 ..." is still redacted). The rules that read the words around
a number see the answer's earlier text too (`find(..., before=)`), so "test mode" in one sentence
covers the list of numbers below it. Passwords in prose ("the admin password is ...", in seven
languages and Japanese, Chinese, Korean) need a token with a letter and a digit; "(at) ... (dot)"
addresses count as emails; an IBAN that checks (mod 97) is personal data ("bank account"), except the
standard's own examples in an answer about the format; a JSON Web Key's public members, a file path
in a secret's place (`*_FILE: /run/secrets/...`) and `you@yourdomain.tld` pass. So do certificates and
public key blocks, SOPS's `ENC[...]` values, jwt.io's sample token, resource references
(`random_password.db.result`), and assignments that name or locate a secret (`secretRef: billing-db`,
`SecretId=secret_id`: a name in code, or a key ending in ref/name/id/file/path/arn).

The system prompt is protected two ways: verbatim runs of >= NGRAM of its words (`LeakMatcher`, which
needs the prompt), and an answer that announces it is quoting its own instructions ("my instructions
say: \"...\"", `SELF_QUOTE`, in six languages and with « » „ “ quotes), whose quoted words are redacted
even when the guard was not told the prompt (a client's own system message on the API, a prompt
changed since start-up), and one that announces a dump of them ("here is my full system prompt:",
`SELF_DUMP`), whose remainder is redacted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

JWT_PATTERN = r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"
JWT = re.compile(JWT_PATTERN)
SECRET_PATTERNS: tuple[tuple[str, re.Pattern], ...] = tuple((kind, re.compile(p)) for kind, p in (
    ("private key", r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)"),
    ("api key", r"\bsk-(?:proj-|ant-(?:api\d+-)?|live-|test-)?[A-Za-z0-9_-]{20,}"),
    ("api key", r"\b[rsp]k_(?:live|test)_[A-Za-z0-9]{16,}"),
    ("access key", r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"),
    ("token", r"\bgh[pousr]_[A-Za-z0-9]{30,}"),
    ("token", r"\bgithub_pat_[A-Za-z0-9_]{40,}"),
    ("token", r"\bxox[abprs]-[A-Za-z0-9-]{10,}"),
    ("api key", r"\bAIza[0-9A-Za-z_-]{35}"),
    ("token", r"\bhf_[A-Za-z0-9]{30,}"),
    ("token", r"\bnpm_[A-Za-z0-9]{36}"),
    ("token", JWT_PATTERN),
    ("password", r"://(?P<u>[^\s:/@]*):(?P<v>[^\s@/]+)@"),  # user:password@ (or :password@, Redis) in a URL
    # key = value / key: value assignments of something secret-looking (only the value is redacted); the key
    # may end a longer name (WEBHOOK_SECRET, DB_PASSWORD); the value stays on its line (`SECRET=` then a newline
    # is empty) and ends at a ; or ,
    ("secret", r"(?i)(?:\b|(?<=_))(?P<k>(?:password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|auth[_-]?token"
               r"|credential)\w*|pass)[\"']?[ \t]*[:=][ \t]*[\"']?(?P<v>[^\s\"';,]{6,})"),
    ("secret", r"(?i)\b(?:token|secret|password|key) (?P<v>(?=[A-Za-z0-9/+_=-]*\d)[A-Za-z0-9/+_=-]{16,})"),
    # a password in prose, in seven languages and Japanese, Chinese and Korean: "the admin password is
    # j4i+++3Y*7I2#Yqm", "la contraseña =IY-6h...", "clave WPA2 YT36g-3V2jq": up to three words after the
    # keyword, then a token of 8+ characters with a letter and a digit (so "must be 12 characters long" and
    # "is on the router's label" pass)
    ("password", r"(?i)\b(?:password|passphrase|passcode|passwort|kennwort|contrase[ñn]a|clave|mot de passe|senha"
                 r"|wachtwoord|パスワード|暗証番号|密码|密碼|비밀번호)(?:\s+[\w-]{1,12}){0,3}?"
                 r"(?:\s+(?:is|es|ist|est|é|was|lautet|are))?(?:\s*[:=：]\s*|\s+)[\"'`]?"
                 r"(?P<v>(?=[^\s\"'`]*\d)(?=[^\s\"'`]*[A-Za-z])[^\s\"'`]{8,}?)(?=[\"'`]?[.,;:)]?(?:\s|$))"),
    ("password", r"(?<![\w-])(?:-u|--user)\s+[\"']?[^\s:,\"']+[:,](?P<v>[^\s\"']+)"),  # curl -u user:pw, lftp -u user,pw
    ("password", r"\bWIFI:(?:[^\n;]*;)*?P:(?P<v>(?:\\.|[^;\\\n])+);"),  # the Wi-Fi QR code format's P: field
    # long random-looking tokens: upper, lower and digits mixed, 32+ chars
    ("secret", r"(?<![A-Za-z0-9/+_-])(?=[A-Za-z0-9/+_-]*[A-Z])(?=[A-Za-z0-9/+_-]*[a-z])(?=[A-Za-z0-9/+_-]*\d)"
               r"[A-Za-z0-9/+_-]{32,}={0,2}"),  # "=" only as base64's padding: req_id=01J6Z8... is a name and an ID
))
CARD = re.compile(r"(?<![\d-])(?:\d[ -]?){12,18}\d(?![\d-])")
EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@([A-Za-z0-9-]+\.)+[A-Za-z]{2,}\b")
# an address written so scrapers miss it: "jana.novakova (at) seznam (dot) cz", "jo [at] mail [dot] de"
OBFUSCATED_EMAIL = re.compile(r"(?i)\b[A-Za-z0-9._%+-]+\s*(?:\(at\)|\[at\]|\{at\}|<at>|\sat\s)\s*[A-Za-z0-9-]+"
                              r"(?:\s*(?:\(dot\)|\[dot\]|\{dot\}|<dot>|\sdot\s)\s*[A-Za-z0-9-]+)+\b")
# an optional international prefix (+49, 0033; then a lone digit may follow: +33 6 ...; +44 (0)20 ...), an
# optional area code in brackets, groups of 2-8 digits split by spaces, dashes or dots
PHONE = re.compile(r"(?<![\w.+-])(?:(?:\+|00)\d{1,3}[ .-]?(?:\(0\)[ .-]?)?(?:\d[ .-])?)?(?:\(\d{1,4}\)[ .-]?)?"
                   r"\d{2,5}(?:[ .-]\d{2,8}){1,4}(?![\w-])")
IPV4 = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}")
# NANP toll-free numbers (800, 888, 877, 866, 855, 844, 833) belong to organisations, never to a private person
TOLL_FREE = re.compile(r"^1?8(?:00|88|77|66|55|44|33)\d{7}$")
# role mailboxes (RFC 2142 and their everyday kin): an organisation's published address, not a person's
ROLE_MAILBOX = re.compile(r"(?i)^(?:support|security|info|help|contact|sales|press|abuse|no-?reply|admin|privacy"
                          r"|webmaster|postmaster|hostmaster|hello|team|office|billing|jobs|careers|feedback|service"
                          r"|enquiries|inquiries|media|legal|compliance|marketing|partners|accounts|orders|returns"
                          r"|customer[._-]?service|dpo|psirt|cert|noc|security-alert|secalert|report[\w.-]*"
                          r"|[\w.-]*phishing|spam)@")
DOC_DOMAINS = re.compile(r"@(?:[\w-]+\.)*(?:example\.(?:com|org|net)|[\w-]+\.(?:example|test|invalid|localhost|tld)"
                         r"|your[\w-]*\.[\w.]+)$",
                         re.IGNORECASE)
PLACEHOLDER = re.compile(r"(?i)example|sample|dummy|placeholder|change-?me|redacted|your[_-]|<[^>]*>|\$\{\w+|^\$\w+$"
                         r"|x{4,}|\*{3,}|\.{3}|…|\b(?:foo|bar|abc|1234)\b")
_MY_INSTRUCTIONS = (  # first person, or "the system prompt"; English, Spanish, French, German, Italian, Portuguese
    r"my\s+(?:(?:full|complete|entire|exact|system|initial|hidden|original|internal|developer|secret"
    r"|confidential)\s+){0,2}(?:prompt|instructions?|system message|directives?|rules|guidelines|configuration)"
    r"|the\s+(?:(?:full|complete|entire|exact|original|actual)\s+)?(?:system|hidden|initial|developer|secret"
    r"|confidential|internal)\s+(?:prompt|message|instructions?|configuration)"
    r"|(?:the\s+)?instructions\s+I\s+(?:was|have\s+been|got)\s+given"
    r"|mis\s+instrucciones(?:\s+de\s+sistema)?|mi\s+prompt(?:\s+de\s+sistema)?|mis\s+reglas"
    r"|mes\s+(?:instructions|consignes)(?:\s+syst[eè]me)?|mon\s+prompt(?:\s+syst[eè]me)?"
    r"|meine\s+(?:System)?(?:anweisungen|regeln)|mein\s+(?:System)?prompt"
    r"|le\s+mie\s+istruzioni(?:\s+di\s+sistema)?|il\s+mio\s+prompt(?:\s+di\s+sistema)?"
    r"|minhas\s+instru[cç][oõ]es(?:\s+de\s+sistema)?|meu\s+prompt(?:\s+de\s+sistema)?")
_SAYS = (r"is|are|says?|reads?|states?|goes|went|were|was"
         r"|dicen|dice|disent|dit|sont|est|sagen|sagt|lauten|lautet|sind|ist|dicono|sono|è|dizem|diz|são|é")
QUOTES_OPEN, QUOTES_CLOSE = "\"“«„", "\"”»“"
SELF_QUOTE_OPEN = re.compile(rf"(?i)\b(?:{_MY_INSTRUCTIONS})\s*(?:(?:{_SAYS})\b[^{QUOTES_OPEN}:\n]{{0,20}})?:?\s*"
                             rf"[{QUOTES_OPEN}]")
# first person or "the system prompt": a document's "the rules state: \"...\"" is not a leak; the quote
# may run to the end of the text (an answer cut off inside it)
SELF_QUOTE = re.compile(SELF_QUOTE_OPEN.pattern + rf"(?P<v>[^{QUOTES_CLOSE}]{{40,}})(?:[{QUOTES_CLOSE}]|\Z)")
# "Sure, here is my full system prompt:" and the prompt after it, unquoted: the rest of the answer
_DISCLOSE = (r"here\s+(?:is|are|it\s+is|they\s+are)|here's|these\s+are|below\s+(?:is|are)|this\s+is|as\s+follows"
             r"|verbatim|word\s+for\s+word|aqu[ií]\s+(?:est[aá]|tienes)|voici|hier\s+(?:ist|sind)|ecco|aqui\s+est[aá]o?")
# an announcement of the assistant's own instructions and of their disclosure, in either order, ending in ":"
SELF_DUMP_OPEN = re.compile(rf"(?i)\b(?:(?:{_DISCLOSE})\s+(?:[^:\n]{{0,40}}?\s)?(?:{_MY_INSTRUCTIONS})\b[^:\n]{{0,60}}"
                            rf"|(?:{_MY_INSTRUCTIONS})\b[^:\n]{{0,60}}?\b(?:{_DISCLOSE})\b[^:\n]{{0,20}}):")
SELF_DUMP = re.compile(SELF_DUMP_OPEN.pattern + r"\s*(?P<v>[\s\S]{40,})")
PLACEHOLDER_WORDS = frozenset({"password", "passwd", "pass", "pwd", "secret", "token", "apikey", "api_key", "key",
                               "user", "username", "mypassword", "yourpassword", "pa55word", "letmein"})
# telephone numbers set aside for fiction and documentation: NANP 555 exchange, area code 555 with an exchange
# that cannot exist (0 or 1 first: "(555) 010-0199"), Ofcom's drama ranges
FICTIONAL_PHONE = re.compile(r"^(?:1?\d{3}555\d{4}|1?555[01]\d{6}"
                             r"|(?:44|0)(?:2079460|1134960|1144960|1154960|1164960|1174960"
                             r"|1184960|1214960|1314960|1414960|1514960|1614960|1632960|7700900|8081570|9098790"
                             r"|3069990|2896496|2920180)\d{3})$")
# a configuration language's reference to a secret kept elsewhere (Terraform, Actions, Ansible, settings objects)
REFERENCE = re.compile(r"(?i)(?:var|vars|local|locals|data|module|secrets|env|settings|config|params|values)\.\w[\w.]*"
                       r"|[a-z_][a-z0-9_]*(?:\.[A-Za-z_][\w-]*){2,}")  # or a resource's attribute: random_password.db.result
# public by nature, though long and random-looking: an SSH public key's body (its algorithm name base64-encoded
# at the start: ssh-rsa, ssh-ed25519, ecdsa-sha2-...) and a Bitcoin address (base58 or bech32)
PUBLIC_VALUE = re.compile(r"AAAA(?:B3NzaC1|C3NzaC1|E2VjZHNh)[A-Za-z0-9+/=]*|[13][1-9A-HJ-NP-Za-km-z]{25,34}"
                          r"|bc1[02-9ac-hj-np-z]{11,71}")
# an assignment whose name says its value names or locates the secret rather than holding it
NAMES_NOT_SECRETS = re.compile(r"(?i)(?:ref|name|id|file|path|arn|version|type|manager|store|length)$")
# a value that is a name in code (no digit; words joined by - or _, or in CamelCase): billing-db, secret_id),
# GetSecretValue; a single word ("password: swordfishes") may be the password itself
IDENTIFIER = re.compile(r"(?:[A-Za-z]+(?:[_-][A-Za-z]+)+|[A-Z]?[a-z]+(?:[A-Z][a-z]+)+)[)`.,\]]*")
PUBLIC_PEM = re.compile(r"-----(BEGIN|END) (?:CERTIFICATE|PUBLIC KEY|RSA PUBLIC KEY|PGP PUBLIC KEY BLOCK|X509 CRL)-----")
# a JSON Web Key's public members (the RSA modulus "n", the EC point "x"/"y"): what a JWKS endpoint publishes
JWK_PUBLIC = re.compile(r"\"(?:n|e|x|y|x5c|x5t)\"\s*:\s*\[?\s*\"$")
# an IBAN (ISO 13616): country, two check digits, 11-30 letters and digits, grouped by four or not; personal
# data when it checks (mod 97), except the standards' own examples in an answer explaining the format
IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?\b")
EXAMPLE_IBANS = frozenset("""GB82WEST12345698765432 GB29NWBK60161331926819 DE89370400440532013000 FR1420041010050500013M02606
ES9121000418450200051332 NL91ABNA0417164300 CH9300762011623852957 IT60X0542811101000000123456 BE68539007547034
AT611904300234573201""".split())
EXAMPLE_CONTEXT = re.compile(r"(?i)\bexample|documentation|\bformat\b|\bsample|\btest")
# card networks' and processors' published test numbers (Visa's 4111..., Stripe's 4242..., ...): nobody's card,
# so in an answer about testing (TEST_CONTEXT) they pass; anywhere else ("the card on file is 4111 ...") they
# are redacted like any card: the answer may be quoting what someone typed into a real form
TEST_CARDS = frozenset("""4111111111111111 4012888888881881 4222222222222 4242424242424242 4000056655665556
5555555555554444 2223003122003222 5200828282828210 5105105105105100 378282246310005 371449635398431
378734493671000 6011111111111117 6011000990139424 3056930009020004 36227206271667 3566002020360505
6200000000000005 4000000000000002 4000000000009995 4000002500003155 4000000000000077 4000000000000341
4000000000003220 4000000000000069 4000000000000127 4000000000000119 4000002760003184 4000000000000101""".split())
TEST_CONTEXT = re.compile(r"(?i)\btest|sandbox|\bluhn")
# a phone number this close after one of these words is an organisation's line, not a person's
ORGANISATION_LINE = re.compile(r"(?i)\b(?:switchboard|hotline|helpline|headquarters|head office"
                               r"|main (?:line|number|office)|comments? line|(?:general )?(?:enquiries|inquiries)"
                               r"|customer (?:service|support|care)|call (?:cent(?:er|re))|front desk|reception"
                               r"|box office|ticket office|reservations|visitor services|press office|information line"
                               r"|public line)\b(?:[^.\n]|\.(?=\S)){0,60}$")  # to the number: no sentence end between
NGRAM = 8  # words of the system prompt repeated in a row that count as a leak


@dataclass(frozen=True)
class Finding:
    start: int
    end: int
    category: str  # secret | pii | system_prompt_leak
    kind: str  # for the marker: "api key", "card number", "email", ...


def placeholder(value: str) -> bool:
    """True for a documentation stand-in rather than a credential (see the module notes)."""
    body = value.strip("\"'`")
    if PLACEHOLDER.search(body) or body.lower() in PLACEHOLDER_WORDS:  # user:password@, token=token
        return True
    if re.search(r"[(\[]|^(?:os\.|process\.env|getenv|env\b|\$\()", body):  # code that reads it: os.environ[...]
        return True
    if REFERENCE.fullmatch(body):  # a reference to where it is kept: var.db_password, secrets.API_TOKEN
        return True
    if body.startswith("ENC["):  # encrypted in place (SOPS): ENC[AES256_GCM,data:...]
        return True
    if re.fullmatch(r"(?:/|\./|~/)[\w./-]+", body):  # a file that holds it: /run/secrets/pg_password
        return True
    if re.fullmatch(r"[A-Z][A-Z_]*", body):  # USER, PASSWORD, YOUR_API_KEY, DBNAME
        return True
    core = re.sub(r"^(?:sk|pk|rk|gh[pousr]|xox[abprs]|hf|npm|AKIA|ASIA)[-_]?(?:live|test|proj)?[-_]?", "", body)
    return len(set(core.lower())) < 6


def in_public_block(before: str) -> bool:
    """Whether text right after `before` lies inside a certificate or public key PEM block (public by nature)."""
    last = None
    for last in PUBLIC_PEM.finditer(before):
        pass
    return last is not None and last.group(1) == "BEGIN"


def jwt_sample(token: str) -> bool:
    """jwt.io's sample token (sub 1234567890, John Doe), the one every tutorial shows."""
    import base64
    import json

    try:
        body = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (IndexError, ValueError):
        return False
    return isinstance(claims, dict) and claims.get("sub") == "1234567890" and claims.get("name") == "John Doe"


def iban_ok(iban: str) -> bool:
    """ISO 13616 check: the first four characters moved to the end, letters as 10-35, mod 97 == 1."""
    if not 15 <= len(iban) <= 34:
        return False
    moved = iban[4:] + iban[:4]
    return int("".join(str(int(ch, 36)) for ch in moved)) % 97 == 1


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card_like(digits: str) -> bool:
    """Shaped like a real card: a network's prefix, 13-19 digits, Luhn."""
    return 13 <= len(digits) <= 19 and re.match(r"4|5[1-5]|2[2-7]|3[47]|6(?:011|5)|3(?:0[0-5]|[68])", digits) is not None \
        and luhn_ok(digits)


class LeakMatcher:
    """Finds runs of >= NGRAM words copied from the protected texts (the system prompt)."""

    def __init__(self, protected: Iterable[str]) -> None:
        self.shingles: set[tuple[str, ...]] = set()
        # the word after each word inside the shingles: output.py never cuts between such a pair
        self.after: dict[str, set[str]] = {}
        self.add(protected)

    def add(self, protected: Iterable[str]) -> None:
        """Protect more texts (the tools' descriptions and the turn's own instructions, known only
        once the assistant is built)."""
        for text in protected:
            ws = [w for w, _, _ in words(text)]
            if len(ws) >= NGRAM:
                self.shingles.update(tuple(ws[i:i + NGRAM]) for i in range(len(ws) - NGRAM + 1))
                for first, second in zip(ws, ws[1:]):
                    self.after.setdefault(first, set()).add(second)

    def plus(self, protected: Iterable[str]) -> "LeakMatcher":
        """A copy that also protects `protected` (one turn's own system message), leaving this one as it is."""
        out = LeakMatcher(())
        out.shingles = set(self.shingles)
        out.after = {word: set(nexts) for word, nexts in self.after.items()}
        out.add(protected)
        return out

    def may_continue(self, word: str, next_start: str) -> bool:
        """Whether `word` followed by a word beginning with `next_start` (lower-case; "" when nothing of
        it is written yet) could be a pair of consecutive protected words."""
        return any(w.startswith(next_start) for w in self.after.get(word, ()))

    def find(self, text: str) -> list[Finding]:
        if not self.shingles:
            return []
        ws = words(text)
        out: list[Finding] = []
        i = 0
        while i + NGRAM <= len(ws):
            if tuple(w for w, _, _ in ws[i:i + NGRAM]) in self.shingles:
                j = i + NGRAM
                while j < len(ws) and tuple(w for w, _, _ in ws[j - NGRAM + 1:j + 1]) in self.shingles:
                    j += 1
                out.append(Finding(ws[i][1], ws[j - 1][2], "system_prompt_leak", "system prompt"))
                i = j
            else:
                i += 1
        return out


def words(text: str) -> list[tuple[str, int, int]]:
    """(lower-cased word, start, end) for each run of letters and digits, inner apostrophes included
    ("don't"), quote marks around it not ('Answer → answer): what leaks count."""
    return [(m.group().lower(), m.start(), m.end()) for m in re.finditer(r"[A-Za-z0-9]+(?:'[A-Za-z0-9]+)*", text)]


def find(text: str, leaks: LeakMatcher | None = None, *, before: str = "") -> list[Finding]:
    """Non-overlapping findings in `text`, in order (the earliest, then longest, wins an overlap). `before`:
    the answer's text before `text` (output.py passes what it released), read by the rules that look at
    the words around a number (a test card in "test mode", an organisation's switchboard), never scanned."""
    around = before + text
    found: list[Finding] = []
    samples = [m.span() for m in JWT.finditer(text) if jwt_sample(m.group())]  # public, and no part of it is secret
    for kind, pattern in SECRET_PATTERNS:
        for m in pattern.finditer(text):
            group = "v" if "v" in pattern.groupindex else 0  # only the value of `key=value`
            value = m.group(group)
            if kind == "private key":
                body = re.sub(r"-----[^-]*-----|\s", "", value)
                if len(body) < 16 or re.search(r"\.{3}|…|<|(?i:example|your)", body):
                    continue  # "-----BEGIN PRIVATE KEY-----\n...\n-----END PRIVATE KEY-----"
            elif placeholder(value) or PUBLIC_VALUE.fullmatch(value) or JWK_PUBLIC.search(text[:m.start(group)]) \
                    or in_public_block(around[:len(around) - len(text) + m.start()]) \
                    or re.search(r"ENC\[[^\]\n]*$", text[:m.start(group)]):  # inside SOPS's ENC[...]: encrypted
                continue
            elif "k" in pattern.groupindex and m.group("k") and (NAMES_NOT_SECRETS.search(m.group("k"))
                                                                 or IDENTIFIER.fullmatch(value)):
                continue  # secretRef: billing-db, SecretId=secret_id): a name, not the secret
            elif any(start <= m.start(group) < end for start, end in samples):
                continue
            elif "u" in pattern.groupindex and m.group("u") == value:
                continue  # postgres:postgres@, guest:guest@: a default login, the same word twice
            found.append(Finding(m.start(group), m.end(group), "secret", kind))
    for m in CARD.finditer(text):
        digits = re.sub(r"\D", "", m.group())
        if _card_like(digits) and not (digits in TEST_CARDS and TEST_CONTEXT.search(around)):
            found.append(Finding(m.start(), m.end(), "pii", "card number"))
    for m in EMAIL.finditer(text):
        before = text[:m.start()]
        in_url = bool(before) and not before[-1].isspace() and "://" in before.rsplit(None, 1)[-1]
        noreply = re.search(r"(?i)@(?:[\w-]+\.)*no-?reply\.", m.group())  # ID+user@users.noreply.github.com
        if not DOC_DOMAINS.search(m.group()) and not ROLE_MAILBOX.match(m.group()) and not in_url \
                and not noreply:  # user:password@host is the URL's
            found.append(Finding(m.start(), m.end(), "pii", "email"))
    ibans = []
    for m in IBAN.finditer(text):
        compact = m.group().replace(" ", "")
        ibans.append((m.start(), m.end()))
        if iban_ok(compact) and not (compact in EXAMPLE_IBANS and EXAMPLE_CONTEXT.search(around)):
            found.append(Finding(m.start(), m.end(), "pii", "bank account"))
    for m in PHONE.finditer(text):
        if any(start <= m.start() < end for start, end in ibans):
            continue  # the digits of an IBAN, not a phone number
        digits = re.sub(r"\D", "", m.group())
        formatted = m.group().startswith(("+", "(")) or len(digits) >= 10
        dotted = "." in m.group() and not m.group().startswith(("+", "00"))
        if dotted and (IPV4.fullmatch(m.group()) or re.search(r"(?:^|\.)\d(?:\.|$)", m.group())):
            continue  # an IP address or a version number (1.2.3), not a phone number
        if 9 <= len(digits) <= 15 and formatted and not _card_like(digits) and not _date_like(m.group()) \
                and not FICTIONAL_PHONE.match(digits) and not TOLL_FREE.match(digits) and len(set(digits)) > 2 \
                and not ORGANISATION_LINE.search(around[max(0, len(around) - len(text) + m.start() - 120):
                                                        len(around) - len(text) + m.start()]):
            found.append(Finding(m.start(), m.end(), "pii", "phone number"))
    for m in OBFUSCATED_EMAIL.finditer(text):
        found.append(Finding(m.start(), m.end(), "pii", "email"))
    if leaks is not None:
        found += leaks.find(text)
    for pattern in (SELF_QUOTE, SELF_DUMP):
        for m in pattern.finditer(text):
            found.append(Finding(m.start("v"), m.end("v"), "system_prompt_leak", "system prompt"))
    found.sort(key=lambda f: (f.start, -(f.end - f.start)))
    kept: list[Finding] = []
    for f in found:
        if not kept or f.start >= kept[-1].end:
            kept.append(f)
    return kept


def _date_like(s: str) -> bool:
    """An ISO date, or one with its hour: "0000-01-01 00" of "0000-01-01 00:00:00" (SQLite's manual)."""
    return re.fullmatch(r"\d{4}-\d{2}-\d{2}(?:[ T]\d{2})?", s.strip()) is not None


def redact(text: str, findings: Sequence[Finding]) -> str:
    out, last = [], 0
    for f in findings:
        out += [text[last:f.start], f"[redacted: {f.kind}]"]
        last = f.end
    return "".join(out) + text[last:]
