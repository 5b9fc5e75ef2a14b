"""A request's prompt as token ids, exactly as vLLM will tokenize it, for Route to hash.

The model's own tokenizer and chat template, loaded from its local folder with transformers'
``AutoTokenizer`` (imported here, not before: ``kvpool --help`` must not pay for it). What vLLM
(0.32, its OpenAI server) does, and so what this does:

- ``/v1/completions``: ``prompt`` is a string, a list of token ids, or a batch of either; text is
  encoded with ``add_special_tokens`` (request field, default true). A batch goes to one engine,
  routed by its first prompt.
- ``/v1/chat/completions``: the template renders ``messages`` to text (``add_generation_prompt``
  default true, ``continue_final_message``, ``chat_template_kwargs``, ``tools``), which is then
  encoded with ``add_special_tokens`` (default false: the template writes the special tokens).
  A message's content given as parts keeps its text parts, joined by newlines, as vLLM does for
  templates that take string content.

Checking a request here is only what tokenizing needs; everything else is the engine's to judge
(its error bodies are passed through).
"""

from __future__ import annotations

import threading
from typing import Any

from kvpool.gateway.errors import BadRequest


class PromptTokenizer:
    """Thread-safe (one lock: transformers sets truncation state on each call)."""

    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer
        try:
            self._tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load the tokenizer of {model_dir}: {e}") from None
        self._lock = threading.Lock()
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))

    def completion(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]      # a batch: routed by its first prompt
        if isinstance(prompt, str):
            return self._encode(prompt, _flag(body, "add_special_tokens", True))
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise BadRequest("`prompt` must be a non-empty string, a list of token ids, or a list "
                         "of either", param="prompt")

    def chat(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("`messages` must be a non-empty list of messages", param="messages")
        conversation = [_message(m, i) for i, m in enumerate(messages)]
        if not self.has_chat_template and not body.get("chat_template"):
            raise BadRequest("the model has no chat template; use /v1/completions",
                             param="messages")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("`chat_template_kwargs` must be an object",
                             param="chat_template_kwargs")
        continue_final = _flag(body, "continue_final_message", False)
        try:
            with self._lock:
                text = self._tok.apply_chat_template(
                    conversation, tokenize=False, chat_template=body.get("chat_template"),
                    tools=body.get("tools"),
                    add_generation_prompt=_flag(body, "add_generation_prompt",
                                                not continue_final),
                    continue_final_message=continue_final, **kwargs)
        except Exception as e:   # noqa: BLE001  (jinja and the template raise anything)
            raise BadRequest(f"the chat template cannot render these messages: {e}",
                             param="messages") from None
        return self._encode(text, _flag(body, "add_special_tokens", False))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        with self._lock:
            return self._tok.encode(text, add_special_tokens=add_special_tokens)


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"`{name}` must be true or false", param=name)
    return value


def _message(m: Any, i: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRequest(f"messages[{i}] must be an object with a `role`", param=f"messages[{i}]")
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict):
                raise BadRequest(f"messages[{i}].content parts must be objects",
                                 param=f"messages[{i}].content")
            if part.get("type") == "text":
                texts.append(str(part.get("text", "")))
        m = {**m, "content": "\n".join(texts)}
    elif content is not None and not isinstance(content, str):
        raise BadRequest(f"messages[{i}].content must be a string or a list of parts",
                         param=f"messages[{i}].content")
    return m
