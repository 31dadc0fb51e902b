"""Loading chat models for the in-process engine: packaged names, local HF dirs and GGUF files.

Device and dtype policy (MACHINE.md): on CPU fp32 (no native bf16 here, prefill is compute-bound),
on CUDA bf16. Thread counts are set on purpose. Measured on the 2-vCPU machine with the sibling
vCPU busy: one 4864x896 int8 GEMV took 0.36 ms with 1 thread and 8.0 ms with 2 (every parallel
region waits a scheduler quantum for the descheduled thread), and a 256-row `_int_mm` 3.7 ms vs
23 ms. One intra-op thread per two vCPUs is therefore the default (`num_threads=0`): 1 here, more on
bigger machines, leaving a core for HTTP, tokenisation and the rest of the system.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from assistant.config import AssistantConfig
from assistant.errors import ModelError
from assistant.models import MODELS, known_model_names, load_gguf, prepared_path, resolve_model_name


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel in eval mode
    tokenizer: Any  # transformers tokenizer with a chat template
    device: Any  # torch.device
    name: str  # what the user asked for
    context_window: int  # tokens the model can attend to


def _require_torch():
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        raise ModelError("The in-process engine needs torch and transformers: pip install -e '.[engine]'") from e
    return torch


def pick_device(device: str):
    torch = _require_torch()
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"engine.device={device} but no CUDA device is available: set engine.device=auto or cpu.")
    return torch.device(device)


def pick_dtype(dtype: str, device):
    torch = _require_torch()
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def set_threads(num_threads: int) -> int:
    """engine.num_threads: N > 0 gives torch and the native kernels N threads each. 0 gives torch one per
    two vCPUs (its OpenMP teams stall on a busy sibling: 2 threads ran 20x slower) and the native kernels
    one per core: their own pool (csrc/pool.h) hands a busy core's share to the others. Measured on 2
    cores, Qwen2.5-0.5B decode, the pool at 1 and 2 threads: 1 stream 43 -> 59-61 tok/s, 8 streams 211-212
    -> 348-351 tok/s; with a neighbour burning one core (the pool's first version), 35 -> 31-36 and
    178-184 -> 179-189."""
    from assistant.engine.native import set_threads as set_kernel_threads

    torch = _require_torch()
    kernels = num_threads if num_threads > 0 else physical_cores()
    if num_threads <= 0:
        num_threads = max(1, (os.cpu_count() or 2) // 2)
    torch.set_num_threads(num_threads)
    set_kernel_threads(kernels)
    return num_threads


def physical_cores() -> int:
    """Cores this process may run on, counting sibling hardware threads once (Linux sysfs; elsewhere, and
    where the topology is hidden, half the vCPUs)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus) // 2)
    return max(1, len(cores))


def resolve_model_path(config: AssistantConfig) -> Path:
    """Where the configured model's files are; raise a fix-it error when it is not prepared."""

    name = config.engine.model
    if name in known_model_names():
        spec = resolve_model_name(name)
        path = prepared_path(spec, config.resolved_models_dir)
        if path is None:
            raise ModelError(
                f"Model {spec.name} is not prepared in {config.resolved_models_dir}: run "
                f"`assistant models prepare {spec.name} --data-dir {config.data_dir}` (or `make run`)."
            )
        return path
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelError(f"Model path {path} does not exist. Known models: {', '.join(MODELS)}.")
    return path


def load_model(config: AssistantConfig) -> LoadedModel:
    _require_torch()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    set_threads(config.engine.num_threads)
    device = pick_device(config.engine.device)
    dtype = pick_dtype(config.engine.dtype, device)
    path = resolve_model_path(config)
    if path.is_file() and path.suffix == ".gguf":
        model, tokenizer = load_gguf(path, dtype=dtype)
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except (OSError, ValueError) as e:
            raise ModelError(f"Could not load the model in {path}: {e}") from e
    if getattr(tokenizer, "chat_template", None) is None:
        raise ModelError(f"{path} has no chat template: use an instruct/chat model.")
    model.to(device).eval()
    window = int(getattr(model.config, "max_position_embeddings", 0) or 4096)
    if config.engine.max_context_tokens:
        window = min(window, config.engine.max_context_tokens)
    return LoadedModel(model=model, tokenizer=tokenizer, device=device, name=config.engine.model,
                       context_window=min(window, 32768))


def load_draft_model(config: AssistantConfig) -> LoadedModel | None:
    """engine.draft_model (draft.py), loaded like engine.model; None when there is none or speculation
    is off."""
    e = config.engine
    if not e.draft_model or e.speculation == "off":
        return None
    return load_model(replace(config, engine=replace(e, model=e.draft_model)))


def check_same_vocabulary(tokenizer: Any, draft_tokenizer: Any, draft_name: str) -> None:
    """A draft model proposes token ids: they must mean the same text to the model that checks them."""
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ModelError(f"engine.draft_model {draft_name!r} has another tokenizer than the model it drafts for: "
                         "pick a smaller model of the same family (qwen2.5-coder-0.5b drafts for the Qwen2.5 "
                         "models), or set engine.draft_model = \"\" to speculate by prompt lookup.")


def eos_token_ids(hf_model: Any, tokenizer: Any) -> set[int]:
    """Every token that ends an answer: the config's EOS ids plus the chat templates' end-of-turn tokens."""
    ids: set[int] = set()
    for source in (getattr(hf_model, "generation_config", None), hf_model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id >= 0 and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return ids


class ChatTemplateEncoding:
    """`encode` / `count_tokens` for engines that hold a transformers tokenizer (`self.tokenizer`):
    chat messages are rendered with the model's own chat template (tools included)."""

    tokenizer: Any
    context_window: int

    def token_text(self, token: int) -> str:
        """One token's own text, as logprobs name it (engine/base.py TokenLogprob)."""
        return self.tokenizer.decode([token])

    def checked_prompt_ids(self, prompt: Sequence[Any], params: Any, tools: Sequence[dict] | None) -> list[int]:
        """Validate a request and encode its prompt, refusing one that leaves no room to answer."""
        from assistant.errors import EngineError

        params.verify()
        prompt_ids = self.encode(prompt, tools)
        if not prompt_ids:
            raise EngineError("The prompt is empty.")
        if len(prompt_ids) >= self.context_window:
            raise EngineError(
                f"The prompt has {len(prompt_ids)} tokens but the model's context window is {self.context_window}: "
                "shorten the conversation or the documents in it.")
        return prompt_ids

    def encode(self, prompt: Sequence[Any], tools: Sequence[dict] | None = None) -> list[int]:
        if prompt and isinstance(prompt[0], int):
            return list(prompt)
        messages, prefixed = template_messages(prompt)
        rendered = self.tokenizer.apply_chat_template(
            messages, tools=list(tools) if tools else None, add_generation_prompt=not prefixed,
            continue_final_message=prefixed, tokenize=False)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    def count_tokens(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None) -> int:
        return len(self.encode(messages, tools))


def template_messages(prompt: Sequence[dict]) -> tuple[list[dict], bool]:
    """Messages as chat templates want them, and whether the last one is a prefix to continue
    (engine/base.py PREFIX). Tool-call arguments sent as a JSON string (OpenAI's wire format) become
    objects: templates render them with `tojson`, which would quote the string a second time."""
    import json

    from assistant.engine.base import PREFIX

    out = []
    for message in prompt:
        message = {k: v for k, v in message.items() if k != PREFIX}
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function", call))
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except json.JSONDecodeError:
                        pass  # not JSON: rendered as the model would have seen it
                calls.append({**call, "function": function} if "function" in call else function)
            message["tool_calls"] = calls
        out.append(message)
    prefixed = bool(prompt) and prompt[-1].get("role") == "assistant" and bool(prompt[-1].get(PREFIX))
    return out, prefixed
