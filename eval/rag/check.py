"""Validate the RAG eval set: eval/rag/dev.jsonl and eval/rag/test.jsonl against eval/rag/docs/.

Every document is parsed with the project's own parser (ingest.parse.parse_file), so page numbers are
the ones the assistant cites: a PDF's page index + 1, and 1 for Markdown, HTML and DOCX. For each item
this checks that every must_contain entry (a string, or a list of alternatives of which one must match)
occurs, case-insensitively, on one of the item's pages in one of its documents, and that ids are
unique, kinds and documents are known, history is used only (and always) by follow_up items,
unanswerable items have no must_contain and no pages, and each split covers every kind and document.

Run from the repository root:  PYTHONPATH=. python eval/rag/check.py
Prints a summary table and exits 0 only when everything holds; otherwise lists every problem, exit 1.

`--audit` lists, for a person to judge, the pages *outside* each answerable item's labels that may hold
its answer too: a 400-character window where every must_contain entry occurs with at least half (and at
least two) of the question's content words. A page joins the labels only when it states the answer the
question asks for (a table of contents, an index, an example that uses the value or a similar fact about
another thing does not); README.md says when this was last done.
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ingest.parse import parse_file  # noqa: E402

DOCS_DIR = HERE / "docs"
SPLITS = {"dev": HERE / "dev.jsonl", "test": HERE / "test.jsonl"}
KINDS = ("lookup", "table", "number", "two_hop", "count", "unanswerable", "follow_up")
FIELDS = {"id", "kind", "docs", "question", "must_contain", "pages", "history"}

# Count items: the count itself is usually not written on the page, so each count item lists here the
# members that were counted. Every member must occur on the item's pages, and the count entry of
# must_contain (a number, or a list of alternatives spelling one number) must equal len(members).
# Members are written so that each one matches its own list entry, not a word found anywhere.
IDN2_RETURN_CODES = """OK MALLOC NO_CODESET ICONV_FAIL ENCODING_ERROR NFC PUNYCODE_BAD_INPUT PUNYCODE_BIG_OUTPUT PUNYCODE_OVERFLOW TOO_BIG_DOMAIN TOO_BIG_LABEL INVALID_ALABEL UALABEL_MISMATCH INVALID_FLAGS
NOT_NFC 2HYPHEN HYPHEN_STARTEND LEADING_COMBINING DISALLOWED CONTEXTJ CONTEXTJ_NO_RULE CONTEXTO CONTEXTO_NO_RULE UNASSIGNED BIDI DOT_IN_LABEL INVALID_TRANSITIONAL INVALID_NONTRANSITIONAL""".split()
COUNTED: dict[str, list[str]] = {
    "tasn1-015": ["3.1 Invoking asn1Parser", "3.2 Invoking asn1Coding", "3.3 Invoking asn1Decoding"],
    "tasn1-016": ["-b, --benchmark", "-s, --strict", "-t, --no-time-strict", "-h, --help display this help and exit -v",
                  "-v, --version output version information and exit report bugs"],
    "smi-014": ["<MIME>/globs (", "<MIME>/globs2 (", "<MIME>/magic (", "<MIME>/subclasses (", "<MIME>/aliases (",
                "<MIME>/icons (", "<MIME>/generic-icons (", "<MIME>/XMLnamespaces (", "<MIME>/MEDIA/SUBTYPE.xml (",
                "<MIME>/mime.cache ("],
    "smi-015": ["All text/* types are subclasses of text/plain", "everything except the inode/* types) are subclasses of application/octet-stream"],
    "smi-016": ["GNOME[GNOME]", "KDE[KDE]", "ROX[ROX]"],
    "idn2-015": ["idn2_flags IDN2_NFC_INPUT", "idn2_flags IDN2_ALABEL_ROUNDTRIP", "idn2_flags IDN2_TRANSITIONAL",
                 "idn2_flags IDN2_NONTRANSITIONAL", "idn2_flags IDN2_NO_TR46", "idn2_flags IDN2_USE_STD3_ASCII_RULES"],
    "idn2-016": [f"idn2_rc IDN2_{code}\n" for code in IDN2_RETURN_CODES],
    "dejagnu-015": ["PASS A test has succeeded", "FAIL A test has not succeeded", "UNRESOLVED A test produced indeterminate",
                    "UNTESTED A test was not run", "UNSUPPORTED There is no support for the tested case"],
    "dejagnu-016": ["1. Support for target communication via SSH", "2. A large number of very old config", "3. The --status command line option",
                    "4. runtest now exits with exit code 0", "5. runtest now exits with the standard exit codes",
                    "6. The user-visible utility procedures absolute", "7. Support was added for testing the D compiler",
                    "8. ~/.dejagnurc is now loaded last", "9. The user-visible utility procedure unsetenv"],
    "dejagnu-017": ["can use ssh,", " rsh,", " rlogin,", " telnet,", " tip,", " and kermit for remote communications"],
    "ninja-015": ["Explicit dependencies, as listed", "Implicit dependencies, either as picked up", "Order-only dependencies, expressed"],
    "ninja-016": ["builddir: a directory for some Ninja output files", "ninja_required_version: the minimum version of Ninja required"],
    "sqldate-011": ["date(time-value, modifier", "\ntime(time-value, modifier", "datetime(time-value, modifier",
                    "julianday(time-value, modifier", "unixepoch(time-value, modifier", "strftime(format, time-value, modifier"],
    "sqldate-012": ["NNN days", "NNN hours", "NNN minutes", "NNN.NNNN seconds", "NNN months", "NNN years", "start of month \n",
                    "start of year \n", "start of day \n", "weekday N \n", "\nunixepoch \n", "\njulianday \n", "\nauto \n",
                    "\nlocaltime \n", "\nutc \n"],
    "sqldate-013": ["\nYYYY-MM-DD \n", "\nYYYY-MM-DD HH:MM \n", "\nYYYY-MM-DD HH:MM:SS \n", "\nYYYY-MM-DD HH:MM:SS.SSS \n",
                    "\nYYYY-MM-DDTHH:MM \n", "\nYYYY-MM-DDTHH:MM:SS \n", "\nYYYY-MM-DDTHH:MM:SS.SSS \n", "\nHH:MM \n",
                    "\nHH:MM:SS \n", "\nHH:MM:SS.SSS \n", "\nnow \n", "\nDDDDDDDDDD \n"],
    "sqllimits-011": ["The number of columns in a table", "The number of columns in an index", "The number of columns in a view",
                      "The number of terms in the SET clause", "The number of columns in the result set",
                      "The number of terms in a GROUP BY or ORDER BY clause", "The number of values in an INSERT statement"],
    "sqltypes-013": ["NULL. The value is a NULL value", "INTEGER. The value is a signed integer", "REAL. The value is a floating point value",
                     "TEXT. The value is a text string", "BLOB. The value is a blob of data"],
    "sqltypes-014": ['contains the string "INT" then', '"CHAR", "CLOB", or "TEXT" then', 'contains the string "BLOB" or if no type',
                     '"REAL", "FLOA", or "DOUB" then', "Otherwise, the affinity is NUMERIC"],
    "sqltypes-015": ["BINARY - Compares string data", "NOCASE - Similar to binary", "RTRIM - The same as binary"],
    "zstd-010": ["**zstd 1.5.1 -1**", "**zstd 1.5.1 --fast=1**", "**zstd 1.5.1 --fast=3**", "**zstd 1.5.1 --fast=4**"],
    "zstd-011": ["| **zstd 1.5.1 -1**", "| [zlib] 1.2.11 -1", "| brotli 1.0.9 -0", "| **zstd 1.5.1 --fast=1**", "| **zstd 1.5.1 --fast=3**",
                 "| quicklz 1.5.0 -1", "| **zstd 1.5.1 --fast=4**", "| lzo1x 2.10 -1", "| [lz4] 1.9.3", "| lzf 3.6 -1", "| snappy 1.1.9"],
    "tasn1-201": ["• INTEGER;", "• ENUMERATED;", "• BOOLEAN;", "• OBJECT IDENTIFIER;", "• NULL;", "• BIT STRING;", "• OCTET STRING;",
                  "• UTCTime;", "• GeneralizedTime;", "• GeneralString;", "• NumericString;", "• IA5String;", "• TeletexString;",
                  "• PrintableString;", "• UniversalString;", "• BMPString;", "• UTF8String;", "• VisibleString;", "• SEQUENCE;",
                  "• SEQUENCE OF;", "• SET;", "• SET OF;", "• CHOICE;", "• ANY;", "• ANY DEFINED BY."],
    "smi-201": ["• glob elements have", "• A glob-deleteall element", "• magic elements contain", "• A magic-deleteall element",
                "• alias elements indicate", "• sub-class-of elements indicate", "• comment elements give", "• acronym elements give",
                "• expanded-acronym elements are", "• icon elements specify", "• generic-icon elements specify",
                "• root-XML elements have", "• treemagic elements contain"],
    "idn2-201": ["html/rfc5890)", "html/rfc5891)", "html/rfc5892)", "html/rfc5893)", "html/rfc3492)"],
    "idn2-202": ["-h, --help Print help", "-V, --version Print version", "-d, --decode Decode", "-l, --lookup Lookup",
                 "-r, --register Register", "-T, --tr46t Enable", "-N, --tr46nt Enable", "--no-tr46 Disable TR46",
                 "--usestd3asciirules Enable", "--no-alabelroundtrip Disable", "--debug Print debugging", "--quiet Silent"],
    "dejagnu-201": ["• note emits a note", "• pass prints a message", "• fail prints a message", "• xfail prints a message",
                    "• xpass prints a message", "• untested prints a placeholder", "• unresolved prints a message", "• totals prints out"],
    "dejagnu-202": ["• Execution of a test is interrupted.", "• A test does not produce a clear result.",
                    "• A test depends on a previous test", "• The test was set up incorrectly.", "• A test script aborts due to a Tcl error."],
    "ninja-201": ["very fast (i.e., instant) incremental builds", "very little policy about how code is built",
                  "get dependencies correct, and in particular", "when convenience and speed are in conflict, prefer speed"],
    "ninja-202": ["The number of started edges", "The total number of edges", "The percentage of started edges",
                  "The number of currently running edges", "The number of remaining edges", "The number of finished edges",
                  "Overall rate of finished edges", "Current rate of finished edges", "Elapsed time in seconds", "A plain % character"],
    "sqldate-201": ["day of month: 00", "fractional seconds: SS.SSS", "hour: 00-24", "day of year: 001-366", "Julian day number (fractional)",
                    "month: 01-12", "minute: 00-59", "seconds since 1970-01-01", "seconds: 00-59", "day of week 0-6",
                    "week of year: 00-53", "year: 0000-9999", "%%"],
    "sqllimits-201": ["(db,SQLITE_LIMIT_LENGTH,size)", "(db,SQLITE_LIMIT_COLUMN,size)", "(db,SQLITE_LIMIT_SQL_LENGTH,size)",
                      "(db,SQLITE_LIMIT_EXPR_DEPTH,size)", "(db,SQLITE_LIMIT_FUNCTION_ARG,size)", "(db,SQLITE_LIMIT_COMPOUND_SELECT,size)",
                      "(db,SQLITE_LIMIT_LIKE_PATTERN_LENGTH,size)", "(db,SQLITE_LIMIT_VARIABLE_NUMBER,size)", "(db,SQLITE_LIMIT_ATTACHED,size)"],
    "sqltypes-201": ["Mathematical operators (+,", "+, -,", "-, *,", "*, /,", "/, %,", "%, <<,", "<<, >>,", ">>, &,", "&, and |)"],
    "zstd-201": ["`.zst`,", "`.gz`,", "`.xz` and", "`.lz4` files"],
}
NUMBER_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen "
    "eighteen nineteen twenty".split())}
TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50}


def norm(text: str) -> str:
    """Lower-case, with runs of whitespace made one space (PDF text breaks lines anywhere)."""
    return re.sub(r"\s+", " ", text).lower()


def load_docs() -> dict[str, dict[int, str]]:
    pages: dict[str, dict[int, str]] = {}
    for path in sorted(DOCS_DIR.iterdir()):
        if path.is_file():
            parsed = parse_file(path)
            pages[path.name] = {p.number: norm(p.text) for p in parsed.pages}
    return pages


def load_split(path: Path, problems: list[str]) -> list[dict]:
    items = []
    if not path.is_file():
        problems.append(f"{path.name}: missing")
        return items
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"{path.name}:{number}: not JSON ({e})")
            continue
        if not isinstance(obj, dict):
            problems.append(f"{path.name}:{number}: not a JSON object")
            continue
        obj["_where"] = f"{path.name}:{number} {obj.get('id', '?')}"
        items.append(obj)
    return items


def alternatives(entry) -> list[str] | None:
    if isinstance(entry, str) and entry.strip():
        return [entry]
    if isinstance(entry, list) and entry and all(isinstance(a, str) and a.strip() for a in entry):
        return entry
    return None


def check_item(item: dict, docs: dict[str, dict[int, str]], problems: list[str]) -> None:
    where = item["_where"]
    keys = set(item) - {"_where"}
    if keys != FIELDS:
        missing, extra = FIELDS - keys, keys - FIELDS
        problems.append(f"{where}: fields wrong (missing {sorted(missing)}, extra {sorted(extra)})")
        return
    kind, names, must, pages, history = item["kind"], item["docs"], item["must_contain"], item["pages"], item["history"]
    if kind not in KINDS:
        problems.append(f"{where}: unknown kind {kind!r}")
    if not isinstance(item["question"], str) or len(item["question"].strip()) < 10:
        problems.append(f"{where}: question missing or too short")
    if not isinstance(names, list) or not names:
        problems.append(f"{where}: docs must be a non-empty list")
        return
    unknown = [n for n in names if n not in docs]
    if unknown:
        problems.append(f"{where}: unknown docs {unknown}")
        return
    if not isinstance(history, list) or not all(isinstance(h, str) and h.strip() for h in history):
        problems.append(f"{where}: history must be a list of questions")
    elif kind == "follow_up" and not history:
        problems.append(f"{where}: follow_up item without history")
    elif kind != "follow_up" and history:
        problems.append(f"{where}: only follow_up items have a history")
    if not isinstance(must, list) or not isinstance(pages, list) or not all(isinstance(p, int) for p in pages):
        problems.append(f"{where}: must_contain and pages must be lists (pages of ints)")
        return
    if kind == "unanswerable":
        if must or pages:
            problems.append(f"{where}: unanswerable items have must_contain [] and pages []")
        return
    if not must:
        problems.append(f"{where}: must_contain is empty")
    if not pages:
        problems.append(f"{where}: pages is empty")
    texts = []
    for name in names:
        for page in pages:
            if page in docs[name]:
                texts.append(docs[name][page])
    bad_pages = [p for p in pages if not any(p in docs[n] for n in names)]
    if bad_pages:
        problems.append(f"{where}: pages {bad_pages} do not exist in {names}")
    counted = False
    for entry in must:
        alts = alternatives(entry)
        if alts is None:
            problems.append(f"{where}: bad must_contain entry {entry!r}")
            continue
        if kind == "count" and (value := count_value(alts)) is not None:
            counted = True
            check_count(item, value, texts, problems)
            continue
        if not any(norm(a) in t for a in alts for t in texts):
            found = sorted({f"{n} p{p}" for n in names for p, t in docs[n].items() for a in alts if norm(a) in t})
            hint = f"; found on {', '.join(found[:8])}" if found else "; found nowhere in its docs"
            problems.append(f"{where}: {entry!r} not on pages {pages} of {names}{hint}")
    if kind == "count" and not counted:
        problems.append(f"{where}: count item without a count in must_contain")


def count_value(alts: list[str]) -> int | None:
    """The number that a list of alternatives like ["4", "four"] spells, or None if it is not a count."""
    values = set()
    for a in alts:
        word = a.strip().lower().replace("-", " ")
        if word.isdigit():
            values.add(int(word))
        elif word in NUMBER_WORDS:
            values.add(NUMBER_WORDS[word])
        elif len(parts := word.split()) == 2 and parts[0] in TENS and parts[1] in NUMBER_WORDS:
            values.add(TENS.get(parts[0], 0) + NUMBER_WORDS[parts[1]])  # "twenty-eight"
        else:
            return None
    return values.pop() if len(values) == 1 else None


def check_count(item: dict, value: int, texts: list[str], problems: list[str]) -> None:
    """A count is verified against the members listed in COUNTED: all present, and as many as claimed."""
    where, members = item["_where"], COUNTED.get(item["id"])
    if members is None:
        problems.append(f"{where}: count item has no COUNTED entry listing what was counted")
        return
    if len(members) != value:
        problems.append(f"{where}: must_contain says {value} but COUNTED lists {len(members)} members")
    for member in members:
        if not any(norm(member) in t for t in texts):
            problems.append(f"{where}: counted member {member!r} not on pages {item['pages']}")


def audit() -> int:
    """Print the candidate pages outside the labels (see the module docstring); always exit 0."""
    from assistant.citations import content_words

    docs = load_docs()
    found = 0
    for name, path in SPLITS.items():
        for item in load_split(path, []):
            if item.get("kind") in ("unanswerable", "count") or not item.get("must_contain"):
                continue
            entries = [alternatives(e) or [] for e in item["must_contain"]]
            terms = content_words(item["question"])
            for doc in item["docs"]:
                for page, text in docs.get(doc, {}).items():
                    if page in item["pages"]:
                        continue
                    windows = [text[i:i + 400] for i in range(0, max(1, len(text) - 200), 100)]
                    held = [(len(terms & content_words(w)), w) for w in windows
                            if all(any(a.lower() in w for a in alts) for alts in entries)]
                    held = [h for h in held if h[0] >= max(2, len(terms) // 2)]
                    if held:
                        found += 1
                        shared, window = max(held)
                        print(f"== {name} {item['id']} labels {item['pages']}, candidate {doc} page {page} "
                              f"({shared} question words)\n Q: {item['question']}\n   {window}\n")
    print(f"{found} candidate page(s) to judge")
    return 0


def main() -> int:
    if "--audit" in sys.argv[1:]:
        return audit()
    problems: list[str] = []
    docs = load_docs()
    splits = {name: load_split(path, problems) for name, path in SPLITS.items()}
    ids = collections.Counter(item.get("id") for items in splits.values() for item in items)
    for dup, n in ids.items():
        if n > 1:
            problems.append(f"duplicate id {dup!r} ({n} times)")
    for items in splits.values():
        for item in items:
            check_item(item, docs, problems)
    # coverage: every kind and every document in every split
    for name, items in splits.items():
        kinds = {i.get("kind") for i in items}
        used = {d for i in items for d in (i.get("docs") or []) if isinstance(d, str)}
        for kind in KINDS:
            if kind not in kinds:
                problems.append(f"{name}: no {kind} item")
        for doc in docs:
            if doc not in used:
                problems.append(f"{name}: no item on {doc}")
    for doc in docs:
        if not any(doc in (i.get("docs") or []) for items in splits.values() for i in items):
            problems.append(f"document {doc} has no questions")

    print_summary(splits, docs)
    if problems:
        print(f"\n{len(problems)} problem(s):", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    total = sum(len(v) for v in splits.values())
    print(f"\nOK: {total} items ({', '.join(f'{k} {len(v)}' for k, v in splits.items())}), all answers found on their pages.")
    return 0


def print_summary(splits: dict[str, list[dict]], docs: dict[str, dict[int, str]]) -> None:
    names = list(splits)
    print("Items per kind")
    print(f"  {'kind':<14}" + "".join(f"{n:>7}" for n in names) + f"{'total':>7}")
    for kind in KINDS:
        counts = [sum(i.get("kind") == kind for i in splits[n]) for n in names]
        print(f"  {kind:<14}" + "".join(f"{c:>7}" for c in counts) + f"{sum(counts):>7}")
    counts = [len(splits[n]) for n in names]
    print(f"  {'all':<14}" + "".join(f"{c:>7}" for c in counts) + f"{sum(counts):>7}")
    print("\nItems per document (an item on two documents counts for both)")
    print(f"  {'document':<28}{'pages':>6}" + "".join(f"{n:>7}" for n in names) + f"{'total':>7}")
    for doc in docs:
        counts = [sum(doc in (i.get("docs") or []) for i in splits[n]) for n in names]
        print(f"  {doc:<28}{len(docs[doc]):>6}" + "".join(f"{c:>7}" for c in counts) + f"{sum(counts):>7}")


if __name__ == "__main__":
    sys.exit(main())
