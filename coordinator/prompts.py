"""Prompt rendering: an environment's :class:`~veriroll.coordinator.environments.Prompt` to the token ids a lease carries.

An instruct model is prompted the way it was tuned: the prompt's chat messages (a system prompt first,
when the operator set one) rendered with the tokenizer's own chat template, ending with the header of
the assistant's turn (``add_generation_prompt``). A base model without a template gets the prompt's
plain text, tokenized exactly as before chat rendering existed (``tokenizer(text).input_ids``): the tiny
character-level presets and their tests depend on those ids bit for bit.

``chat_template`` chooses between them: ``"auto"`` (the template when the tokenizer has one), ``"always"``
(a tokenizer without one is a :class:`PromptRenderError` when the coordinator starts) or ``"never"``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import get_args

from veriroll.coordinator.config import ChatTemplate
from veriroll.protos.errors import VerirollError

__all__ = ["CHAT_TEMPLATE_MODES", "PromptRenderError", "PromptRenderer", "prompt_messages"]

CHAT_TEMPLATE_MODES = get_args(ChatTemplate)


class PromptRenderError(VerirollError, ValueError):
    """Prompts cannot be rendered as configured; the message names the model and the fix."""


def prompt_messages(prompt, system_prompt: str = "") -> list[dict[str, str]]:
    """The conversation a prompt stands for: its ``messages`` (or one user turn with its text), with
    ``system_prompt`` as a first system turn unless the prompt brings its own system turn."""
    messages = [dict(m) for m in (prompt.messages or [{"role": "user", "content": prompt.text}])]
    for m in messages:
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise PromptRenderError(f"prompt messages must be {{'role': str, 'content': str}} dicts, got {m!r}")
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _plain_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text).input_ids)


class PromptRenderer:
    """Renders prompts to token ids for one tokenizer and one setting of ``system_prompt`` and ``chat_template``.

    ``encode_text`` tokenizes plain prompts (default ``tokenizer(text).input_ids``); the service passes
    its faster codec, which is checked to give the same ids.
    """

    def __init__(self, tokenizer, *, system_prompt: str = "", chat_template: str = "auto",
                 encode_text: Callable[[str], list[int]] | None = None):
        if chat_template not in CHAT_TEMPLATE_MODES:
            raise PromptRenderError(f"chat_template must be one of {', '.join(CHAT_TEMPLATE_MODES)}, got {chat_template!r}")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat_template == "always" and not has_template:
            where = getattr(tokenizer, "name_or_path", "") or "(unknown directory)"
            raise PromptRenderError(
                f"environment.chat_template = 'always' but the tokenizer of the model at {where} has no chat template "
                "(a base model?). Set environment.chat_template = 'auto' or 'never' to prompt it with plain text, "
                "or use an instruct model whose tokenizer ships a chat template (tokenizer_config.json "
                "'chat_template' or chat_template.jinja)")
        self.uses_chat_template = has_template and chat_template != "never"
        self._encode_text = encode_text or (lambda text: _plain_ids(tokenizer, text))

    def messages(self, prompt) -> list[dict[str, str]]:
        """The conversation as the model sees it (system prompt included), stored with the prompt for the reward."""
        return prompt_messages(prompt, self.system_prompt)

    def render(self, prompt) -> list[int]:
        """Token ids of ``prompt``: the chat template with the assistant's turn opened, or the plain text."""
        if self.uses_chat_template:
            return self.render_messages(self.messages(prompt))
        text = prompt.text if not self.system_prompt else f"{self.system_prompt}\n\n{prompt.text}"
        return list(self._encode_text(text))

    def render_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation through the chat template, ending where the assistant starts to write."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        # transformers 5 returns a BatchEncoding (input_ids, attention_mask); 4.x returned the id list.
        if isinstance(out, Mapping) or hasattr(out, "keys"):
            out = out["input_ids"]
        ids = [int(i) for i in out]
        if not ids:
            raise PromptRenderError("the chat template rendered an empty prompt")
        return ids

    def stop_token_ids(self, eos_token_ids: list[int], override: list[int] | tuple[int, ...] = ()) -> list[int]:
        """Where generation stops, which every lease carries: the one place it is decided.

        The operator's ``override`` (``leases.stop_token_ids``), when given, is final: exactly those ids, nothing
        added. Otherwise the model's EOS ids (``PolicyStore.stop_token_ids``), and with the chat template also the
        tokenizer's EOS and the token that ends a turn (``<|im_end|>``, ``<|eot_id|>``, ...), so a completion
        never runs into a new turn."""
        if override:
            return [int(i) for i in override]
        if not self.uses_chat_template:
            return [int(i) for i in eos_token_ids]
        from veriroll.coordinator.models import tokenizer_facts

        # The facts' stop ids are the tokenizer's EOS plus the template's end-of-turn tokens.
        extra = tokenizer_facts(self.tokenizer, {}).stop_token_ids
        return [int(i) for i in eos_token_ids] + [i for i in extra if i not in eos_token_ids]
